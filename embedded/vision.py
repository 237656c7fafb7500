"""The vision stage: the vision tower pretrained alone, as a VLM's vision encoder comes pretrained.

A real VLM's encoder (CLIP, SigLIP) tells a striped object from a dotted one and a small one from a big one before
the decoder ever sees it. Trained only through the decoder's loss, the embedded model's tower learns colour alone,
so a description step gains nothing by looking at the object it describes but its colour. Trained alone on single
objects, with a linear head per attribute on the max over an image's merged tokens, the same tower names all four
within a few hundred steps. The heads are then dropped and the model stays a plain Qwen2-VL; the main stage trains
the tower's body at a fraction of the learning rate (``vision_lr_scale``), so that its loss does not erode what the
tower learnt.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.data import synthetic as S

from . import checkpoints
from .batches import VISION_ATTRIBUTES, vision_batch
from .curriculum import BOOTSTRAP_LAYOUT, cosine_lr
from .loops import Meter, RunOptions, Trainer
from .losses import make_optimizer
from .recipe import VISION_FIELDS, Recipe


class VisionPretrainer(Trainer):
    """``vision_steps`` steps of the tower and its attribute heads on single-object scenes, alternately on the flat
    bootstrap canvas and on the recipe's layout (what it learns on one canvas it does not know on the other); the
    text model does not move. Checkpoints to ``ckpt_path`` (the tower, the heads, the optimizer) and resumes from
    it unless ``opts.fresh``."""

    name = "vision "

    def __init__(self, recipe: Recipe, opts: RunOptions, model, ckpt_path: Path, device):
        import torch

        self.visual = model.model.visual
        width = model.config.vision_config.hidden_size  # the merger's output: the decoder's width
        with torch.random.fork_rng(devices=[]):  # the heads' init follows the seed and leaves the global RNG alone
            torch.manual_seed(recipe.seed)
            self.heads = torch.nn.ModuleDict(
                {k: torch.nn.Linear(width, len(v)) for k, v in VISION_ATTRIBUTES.items()}).to(device)
        self.stage = torch.nn.ModuleDict({"visual": self.visual, "heads": self.heads})
        opt = make_optimizer(self.stage, recipe.lr, recipe.weight_decay)
        step, elapsed = 0, 0.0
        if ckpt_path.exists() and not opts.fresh:
            # one vision stage may start several main stages: checked on the fields the tower depends on
            ck = checkpoints.read(ckpt_path, recipe, VISION_FIELDS, device)
            self.stage.load_state_dict(ck["stage"])
            opt.load_state_dict(ck["opt"])
            step, elapsed = ck["step"], ck["elapsed"]
            print(f"resumed the vision stage from {ckpt_path} at step {step}", flush=True)
        super().__init__(recipe, opts, model, opt, None, ckpt_path, step, elapsed)
        self.total = recipe.vision_steps
        self.held_out = vision_batch(S.HELDOUT_SEED, 0, recipe.layout, BOOTSTRAP_LAYOUT, n=64)

    def logits(self, pixel_values, grid_thw):
        """(B, attributes, most values) per image; the padding of attributes with fewer values is -inf."""
        import torch

        merged = self.visual(pixel_values, grid_thw=grid_thw).pooler_output  # (sum of merged tokens, width)
        sizes = (grid_thw.prod(-1) // self.visual.spatial_merge_size ** 2).tolist()
        pooled = torch.stack([t.max(0).values for t in merged.split(sizes)])  # (B, width)
        most = max(len(v) for v in VISION_ATTRIBUTES.values())
        return torch.stack([torch.nn.functional.pad(h(pooled), (0, most - h.out_features), value=float("-inf"))
                            for h in self.heads.values()], 1)

    def lr(self) -> float:
        return cosine_lr(self.r.lr, min(self.r.warmup, self.total // 10), self.total, self.step)

    def train_step(self, meter: Meter) -> None:
        import torch

        batch = vision_batch(self.r.seed, self.step, self.r.layout, BOOTSTRAP_LAYOUT)
        pixel_values, grid_thw, labels = (t.to(self.device) for t in batch)
        self.last_lr = self.lr()
        for g in self.opt.param_groups:
            g["lr"] = self.last_lr
        logits = self.logits(pixel_values, grid_thw)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.stage.parameters(), 1.0)
        self.opt.step()
        self.step += 1
        with torch.no_grad():
            meter.add(loss, logits, labels, labels.shape[0])

    def held_out_accuracy(self) -> dict[str, float]:
        """Each head's accuracy on 64 held-out single-object scenes (32 on each canvas)."""
        import torch

        pixel_values, grid_thw, labels = (t.to(self.device) for t in self.held_out)
        with torch.no_grad():
            hits = (self.logits(pixel_values, grid_thw).argmax(-1) == labels).float().mean(0)
        return dict(zip(VISION_ATTRIBUTES, hits.tolist()))

    def log(self, meter: Meter) -> None:
        super().log(meter)
        if self.step % 100 == 0 or self.step == self.total:
            acc = self.held_out_accuracy()
            print("  held-out " + " ".join(f"{k} {v:.2f}" for k, v in acc.items()), flush=True)

    def checkpoint(self) -> None:
        checkpoints.save({"stage": self.stage.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                          "elapsed": self.elapsed(), "recipe": self.r.to_dict()}, self.ckpt_path)
