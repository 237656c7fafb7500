"""One training run of the embedded model, stage after stage: vision (``vision.py``), main and polish
(``loops.py``), the share stage where the recipe has one (``share.py``), then the saved model directory with the
recipe that made it. A run whose ``--init-from`` model was made by the same recipe up to the share stage runs only
that stage.

A run resumes from the checkpoints in its run directory. At a fixed thread count the saved weights are a function
of the recipe, resumes included.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import checkpoints
from .assets import SYSTEM_PROMPT_ROLE, build_model, build_processor, build_tokenizer, save_assets
from .batches import BatchBuilder
from .loops import Polisher, RunOptions, Trainer, load_into
from .losses import is_tower_body, make_optimizer
from .recipe import MAIN_FIELDS, RECIPE_NAME, Recipe
from .share import Sharer, share_optimizer, starts_from
from .sink import HeldSink, sink_logit_at
from .vision import VisionPretrainer


def build_run_model(recipe: Recipe, tok, device, init_from: str | None = None):
    """The model a run starts from before any checkpoint, and its held attention sink."""
    model = build_model(tok, recipe.size, seed=recipe.seed).to(device)
    sink = HeldSink(model, tok.convert_tokens_to_ids(SYSTEM_PROMPT_ROLE),
                    logit=sink_logit_at(recipe.sink_logit, recipe.sink_ramp, 0.0))
    if init_from:
        checkpoints.init_weights_from(model, init_from)
        sink.restore()
    return model, sink


def main_optimizer(model, recipe: Recipe):
    """The main stage's optimizer: the tower's body at ``vision_lr_scale`` times the learning rate."""
    return make_optimizer(model, recipe.lr, recipe.weight_decay,
                          lambda name: recipe.vision_lr_scale if is_tower_body(name) else 1.0)


def training_attention(model, recipe: Recipe) -> None:
    """The attention a training run uses (the saved model goes back to SDPA): the vision tower's attention over
    ~1,300 patches of 16-dim heads runs ~13% faster eager than SDPA on CPU, and the grounding loss reads the
    decoder's attention weights, which only eager attention returns (so does the share loss)."""
    text = {"text_config": "eager"} if recipe.ground_loss or recipe.share_steps and recipe.share_loss else {}
    model.set_attn_implementation({"vision_config": "eager", **text})


def export(recipe: Recipe, opts: RunOptions, model, opt, processor, device) -> None:
    """Save the run directory's latest checkpoint (the polish stage's, where one is under way) as a model
    directory at ``opts.export``: look at a run while it trains."""
    ckpt = opts.run_dir / "ckpt.pt"
    if not ckpt.exists():
        raise checkpoints.CheckpointError(f"--export: no checkpoint at {ckpt} (check --run-dir)")
    step = load_into(ckpt, model, opt, recipe, MAIN_FIELDS, resume=False, device=device)[0]
    for stage, steps, stage_opt in (("polish", recipe.polish_steps, opt),
                                    ("share", recipe.share_steps, share_optimizer(model, recipe))):
        path = opts.run_dir / f"{stage}.pt"
        if steps and path.exists():
            got = load_into(path, model, stage_opt, recipe, MAIN_FIELDS, False, device)[0]
            step = f"{step} + {stage} step {got}"
    model.eval()
    save_assets(model.to("cpu").float(), processor, Path(opts.export), recipe.to_dict())
    print(f"exported step {step} to {opts.export}", flush=True)


def run(recipe: Recipe, opts: RunOptions) -> Path | None:
    """Train (or resume) ``recipe`` into ``opts.out``; the saved model directory, or None when the run stopped
    early (a signal or ``stop_after``: run it again to resume) or only exported a checkpoint."""
    import torch

    if recipe.threads != "auto":
        torch.set_num_threads(int(recipe.threads))
    device = torch.device(opts.device)
    opts.run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = opts.run_dir / "ckpt.pt"
    reference = checkpoints.reference_weights(opts.same_as)
    tok = build_tokenizer()
    processor = build_processor(tok)
    model, sink = build_run_model(recipe, tok, device, opts.init_from)
    opt = main_optimizer(model, recipe)
    if opts.export:
        return export(recipe, opts, model, opt, processor, device)
    step, elapsed = 0, 0.0
    resumed = ckpt.exists() and not opts.fresh
    if resumed:
        step, elapsed = load_into(ckpt, model, opt, recipe, MAIN_FIELDS)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M params ({n_params * 4 / 2**20:.1f} MB fp32), device {device}, "
          f"threads {torch.get_num_threads()}", flush=True)

    training_attention(model, recipe)
    stop_after = opts.stop_after  # counts this process's steps over every stage
    if starts_from(recipe, _recipe_of(opts.init_from)):
        print(f"{opts.init_from} was made by this recipe up to its share stage: running only that stage", flush=True)
        share = Sharer(recipe, opts, model, share_optimizer(model, recipe), BatchBuilder(processor),
                       opts.run_dir / "share.pt", 0.0, sink)
        if not share.run(stop_after):
            return None
        return _save(recipe, opts, model, processor, reference, f"{share.step} share steps", share.elapsed(),
                     {"share_steps": share.step, "init_from": str(opts.init_from)}, share.auto_threads)
    if recipe.vision_steps and not resumed:  # a run that has not started its main stage
        pre = VisionPretrainer(recipe, opts, model, opts.run_dir / "vision.pt", device)
        if not pre.run(stop_after) or pre.step < pre.total:
            print(f"the vision stage stopped at step {pre.step} of {pre.total} (no model saved); run the same "
                  "command to resume", flush=True)
            return None
        elapsed = pre.elapsed()
        stop_after = None if stop_after is None else stop_after - pre.steps_taken
    trainer = Trainer(recipe, opts, model, opt, BatchBuilder(processor), ckpt, step, elapsed, sink)
    if not trainer.run(stop_after):
        return None
    total, steps = trainer.elapsed(), f"{trainer.step} steps"
    if recipe.polish_steps and trainer.step >= recipe.steps:  # not after a main stage cut short by --minutes
        stop_after = None if stop_after is None else stop_after - trainer.steps_taken
        polish = Polisher(recipe, opts, model, opt, trainer.builder, opts.run_dir / "polish.pt", total, sink)
        if not polish.run(stop_after):
            return None
        total, steps = polish.elapsed(), f"{steps} + {polish.step} polish steps"
        if recipe.share_steps:
            stop_after = None if stop_after is None else stop_after - polish.steps_taken
            share = Sharer(recipe, opts, model, share_optimizer(model, recipe), trainer.builder,
                           opts.run_dir / "share.pt", total, sink)
            if not share.run(stop_after):
                return None
            total, steps = share.elapsed(), f"{steps} + {share.step} share steps"
    return _save(recipe, opts, model, processor, reference, steps, total,
                 {"steps": trainer.step, "polish_steps": recipe.polish_steps, "share_steps": recipe.share_steps},
                 trainer.auto_threads)


def _recipe_of(model_dir: str | None) -> dict | None:
    """The recipe a saved model directory carries, or None (no directory, or one without a recipe)."""
    path = Path(model_dir) / RECIPE_NAME if model_dir else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def _save(recipe: Recipe, opts: RunOptions, model, processor, reference, steps: str, seconds: float, summary: dict,
          auto_threads: bool) -> Path:
    """Save the trained model directory (SDPA attention, fp32, the recipe beside it) and the run's summary."""
    model.set_attn_implementation({"vision_config": "sdpa", "text_config": "sdpa"})
    model.eval()
    save_assets(model.to("cpu").float(), processor, opts.out, recipe.to_dict())
    n_params = sum(p.numel() for p in model.parameters())
    (opts.run_dir / "train_summary.json").write_text(json.dumps(
        {**summary, "train_minutes": seconds / 60, "params": n_params, "out": str(opts.out),
         "recipe": recipe.to_dict()}, indent=2))
    print(f"saved {opts.out} after {steps}, {seconds / 60:.1f} min of training", flush=True)
    if reference is not None:
        print(checkpoints.weights_verdict(opts.out, reference, opts.same_as), flush=True)
    if auto_threads:
        print("(threads auto: the thread count followed the machine's load, so a rerun matches these weights only in "
              "distribution; pass --threads N for weights a rerun at N threads reproduces bit for bit)", flush=True)
    return opts.out
