"""Training runs of the embedded model (embedded/train.py, loops.py, vision.py, checkpoints.py) on the tiny
size: at a fixed thread count the weights are a function of the recipe through every stage and resume; each stage
resumes only from a checkpoint of its own recipe and curriculum; the vision stage trains the tower alone."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from embedded import checkpoints, cli, train
from embedded.assets import build_processor, build_tokenizer
from embedded.batches import BatchBuilder
from embedded.curriculum import batch_plan, make_batch
from embedded.loops import Polisher, RunOptions
from embedded.recipe import Recipe
from embedded.vision import VisionPretrainer

TINY = ["--size", "tiny", "--threads", "1", "--warmup", "1", "--batch-scale", "0.25"]
NO_POLISH = ["--polish-steps", "0", "--polish-ground-spread"]


def run(argv: list[str], tmp, name: str, *extra: str):
    """One ``jobs/train_embedded.py`` run into ``tmp / name``; its saved model directory or None."""
    return train.run(*cli.parse(argv + ["--run-dir", str(tmp / name), "--out", str(tmp / name / "model"), *extra]))


def weights(path) -> dict:
    return load_file(path / "model" / "model.safetensors")


def test_a_fixed_thread_count_reproduces_the_weights_through_every_stage_and_resume(tmp_path, capsys):
    """The shipped recipe's reproduction claim: at a fixed thread count, a run of all three stages (vision, main,
    polish) that is interrupted and resumed saves the weights of one run straight through, and --same-as says so;
    when part of a run ran at another thread count, the resume says so and --same-as counts the tensors that differ.
    The saved directory is a Qwen2-VL with its processor and the recipe that made it."""
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    common = TINY[:2] + ["--vision-steps", "2", "--steps", "10", "--polish-steps", "2", "--warmup", "1",
                         "--batch-scale", "0.25", "--threads", "2"]
    run(common, tmp_path, "a", "--fresh")
    with pytest.raises(SystemExit, match="--same-as .*no model.safetensors"):
        run(common, tmp_path, "b", "--same-as", str(tmp_path / "a"))
    same = ["--same-as", str(tmp_path / "a" / "model")]
    assert run(common, tmp_path, "b", "--fresh", "--stop-after", "5") is None  # stopped inside the main stage
    assert (tmp_path / "b" / "ckpt.pt").exists() and not (tmp_path / "b" / "model").exists()
    capsys.readouterr()
    run(common, tmp_path, "b", *same)
    wa = weights(tmp_path / "a")
    out = capsys.readouterr().out
    assert f"weights equal {tmp_path / 'a' / 'model'}'s bit for bit ({len(wa)} tensors)" in out and "note:" not in out
    assert all(torch.equal(wa[k], v) for k, v in weights(tmp_path / "b").items())
    saved = Recipe.load(tmp_path / "a" / "model")
    assert saved == cli.parse(common)[0] and saved.polish_steps == 2
    saved_dir = str(tmp_path / "a" / "model")
    assert Qwen2VLForConditionalGeneration.from_pretrained(saved_dir).config.model_type == "qwen2_vl"
    assert AutoProcessor.from_pretrained(saved_dir).tokenizer.eos_token == "<|im_end|>"

    # another count for part of the run: the resume says so, and --same-as counts what differs
    one = [x if x != "2" or common[i - 1] != "--threads" else "1" for i, x in enumerate(common)]
    run(one, tmp_path, "c", "--fresh", "--stop-after", "5")
    capsys.readouterr()
    run(common, tmp_path, "c", *same)
    out = capsys.readouterr().out
    assert f"note: {tmp_path / 'c' / 'ckpt.pt'} was written at threads 1 and this process runs at threads 2" in out
    wc = weights(tmp_path / "c")
    differ = [k for k in wa if not torch.equal(wa[k], wc[k])]
    if differ:  # the sums' order follows the thread count (measured: most tensors move by ~1e-7)
        gap = max(float((wa[k] - wc[k]).abs().max()) for k in differ)
        assert f"{len(differ)} of {len(wa)} tensors differ; max abs diff {gap:.2g}" in out
    else:
        assert "bit for bit" in out


def test_each_checkpoint_resumes_only_under_its_own_recipe_and_curriculum(tmp_path, monkeypatch):
    """A main stage's checkpoint names every recipe field that differs; it still exports its weights under another
    curriculum, but does not resume."""
    common = TINY + NO_POLISH + ["--vision-steps", "0", "--steps", "5", "--ground-loss", "1"]
    run(common, tmp_path, "r", "--stop-after", "3", "--fresh")
    for flag, value, field in (("--ground-loss", "2", "ground_loss 1.0 (this run: 2.0)"),
                               ("--ground-tasks", "textcaps", "ground_tasks ['detailcaps'] (this run: ['textcaps'])"),
                               ("--lr", "0.001", "lr 0.002 (this run: 0.001)"),
                               ("--batch-scale", "0.5", "batch_scale 0.25 (this run: 0.5)")):
        with pytest.raises(SystemExit, match=re.escape(f"another recipe: {field}")):
            run(common + [flag, value], tmp_path, "r")
    monkeypatch.setattr(checkpoints, "CURRICULUM_ID", "0123456789ab")
    with pytest.raises(SystemExit, match="another curriculum"):
        run(common, tmp_path, "r")
    assert not (tmp_path / "r" / "model").exists()
    run(common, tmp_path, "r", "--export", str(tmp_path / "peek"))  # its weights can still be looked at
    assert (tmp_path / "peek" / "model.safetensors").exists() and Recipe.load(tmp_path / "peek").steps == 5


def test_vision_stage_trains_the_tower_alone_and_resumes_exactly(tmp_path):
    """The vision stage: the text model does not move while the vision tower learns to name the objects (held-out
    size, colour and texture well above chance after 80 steps of the tiny model), and an interrupted vision stage
    resumes to the same weights as one run straight through."""
    recipe, opts = cli.parse(TINY + NO_POLISH + ["--vision-steps", "80", "--warmup", "10", "--layout", "v1",
                                                 "--ground-loss", "0", "--ground-tasks",  # flat canvases: quick
                                                 "--run-dir", str(tmp_path)])
    model, _ = train.build_run_model(recipe, build_tokenizer(), torch.device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pre = VisionPretrainer(recipe, opts, model, tmp_path / "vision.pt", torch.device("cpu"))
    chance = pre.held_out_accuracy()
    assert pre.run() and pre.step == 80
    moved = {k for k, v in model.state_dict().items() if not torch.equal(before[k], v)}
    assert moved and all(k.startswith("model.visual.") for k in moved), sorted(moved)[:5]
    acc = pre.held_out_accuracy()
    assert acc["colour"] >= 0.9 and acc["size"] >= 0.8 and acc["texture"] >= 0.6, (chance, acc)

    common = TINY + NO_POLISH + ["--vision-steps", "4", "--steps", "2"]
    run(common, tmp_path, "a", "--fresh")
    assert run(common, tmp_path, "b", "--fresh", "--stop-after", "2") is None
    assert (tmp_path / "b" / "vision.pt").exists() and not (tmp_path / "b" / "ckpt.pt").exists()
    run(common, tmp_path, "b")
    wa, wb = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(SystemExit, match="another recipe: vision_steps 4 \\(this run: 5\\)"):
        run([x if x != "4" else "5" for x in common], tmp_path, "b")


def test_vision_lr_scale_slows_the_tower_body_alone(tmp_path, capsys):
    """vision_lr_scale F: one main-stage step from the same vision stage moves the tower's patch embedding and
    blocks F times as far as at the full rate (AdamW's first step is lr times the gradient's sign plus the decay)
    and the merger and decoder the same; one vision stage's checkpoint starts main stages of other recipes."""
    common = TINY + NO_POLISH + ["--vision-steps", "3", "--steps", "1"]
    run(common + ["--vision-lr-scale", "1"], tmp_path, "full", "--fresh")
    (tmp_path / "slow").mkdir()
    shutil.copy(tmp_path / "full" / "vision.pt", tmp_path / "slow" / "vision.pt")  # the same tower to start from
    capsys.readouterr()
    run(common + ["--vision-lr-scale", "0.1"], tmp_path, "slow")
    assert "resumed the vision stage" in capsys.readouterr().out
    start = {k: v for k, v in torch.load(tmp_path / "full" / "vision.pt", weights_only=False)["stage"].items()
             if k.startswith("visual.")}  # the tower as the main stage found it, under the saved names
    wf, ws = weights(tmp_path / "full"), weights(tmp_path / "slow")
    for k, v in start.items():
        moved_full, moved_slow = wf[k] - v, ws[k] - v
        if k.startswith("visual.merger."):
            assert torch.allclose(moved_slow, moved_full, atol=1e-7), k
        else:
            assert moved_full.abs().max() > 1e-4, k
            assert torch.allclose(moved_slow, 0.1 * moved_full, atol=1e-7, rtol=1e-3), k
    text = [k for k in wf if not k.startswith("visual.")]
    assert text and all(torch.allclose(wf[k], ws[k], atol=1e-7) for k in text)


def test_polish_stage_continues_a_finished_main_stage(tmp_path, capsys):
    """A finished main stage's checkpoint, copied into a new run directory, starts a polish stage (the main stage's
    recipe check ignores the polish fields); the polish stage trains polish_steps more steps on the last phase's
    batches drawn with polish_seed, grounding the polish_ground_tasks (spread on polish_ground_spread's), with the
    polish_mix's tasks; it checkpoints, and resumes only under the same polish fields."""
    common = TINY + ["--layout", "v5", "--vision-steps", "0", "--steps", "10", "--ground-loss", "1"]
    run(common + NO_POLISH, tmp_path, "main")
    (tmp_path / "polish").mkdir()
    shutil.copy(tmp_path / "main" / "ckpt.pt", tmp_path / "polish" / "ckpt.pt")
    flags = ["--polish-steps", "4", "--polish-lr", "1e-3", "--polish-cooldown", "0", "--polish-mix", "none",
             "--polish-ground-tasks", "textcaps", "detailcaps", "--polish-ground-spread", "detailcaps"]
    capsys.readouterr()
    assert run(common + flags, tmp_path, "polish", "--stop-after", "2") is None
    out = capsys.readouterr().out
    assert "at step 10" in out and "--stop-after: checkpointed at step 2" in out
    with pytest.raises(SystemExit, match="another recipe: polish_lr 0.001 \\(this run: 0.002\\)"):
        run(common + flags + ["--polish-lr", "2e-3"], tmp_path, "polish")
    run(common + flags, tmp_path, "polish")
    out = capsys.readouterr().out
    assert f"resumed from {tmp_path / 'polish' / 'polish.pt'} at step 2" in out and "polish step 4/4" in out
    assert "lr 1.00e-03" in out and "after 10 steps + 4 polish steps" in out

    # its batches: the last phase's plan steps (14-21 of 22), the polish seed, the polish stage's targets and mix
    tok = build_tokenizer()
    builder = BatchBuilder(build_processor(tok))
    for mix in (None, {"textcaps": 2.0}):
        recipe = cli.parse(common + flags + ["--steps", "22", "--polish-steps", "8", "--polish-seed", "5"])[0]
        recipe = recipe.replace(polish_mix=mix)
        model, sink = train.build_run_model(recipe, tok, "cpu")
        polisher = Polisher(recipe, RunOptions(tmp_path, tmp_path), model, train.main_optimizer(model, recipe),
                            builder, tmp_path / "unused.pt", 0.0, sink)
        tasks = set()
        for step in range(8):
            polisher.step = step
            task, want = make_batch(builder, 5, 14 + step, 22, 0.25, "v5", ground=("detailcaps", "textcaps"), mix=mix)
            got = polisher.batch()
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
            assert polisher.ground_spread() == (task == "detailcaps")
            own = batch_plan(5, 14 + step, 22, 0.25, "v5")
            assert batch_plan(5, 14 + step, 22, 0.25, "v5", mix)[1::2] == own[1::2]  # the phase's layout, canvas
            tasks.add(task)
        # the last phase's own mix draws several tasks at these steps; textcaps alone draws textcaps only
        assert (tasks == {"textcaps"}) == (mix is not None) and "textcaps" in tasks, tasks


def test_the_share_stage_runs_alone_from_the_model_its_recipe_made_and_resumes_exactly(tmp_path, capsys):
    """A recipe with a share stage, given --init-from a model its other fields made, runs only the share stage: on
    share_layout's tinted scenes, each description batch carries its scenes' share targets (log-linear in the
    tint); it checkpoints, resumes to the weights of a straight run, and saves a model whose recipe names the stage
    (so its scene layout is the share stage's). A model of another recipe starts the whole run from its weights."""
    from embedded.share import Sharer, share_target
    from pipeline.data import synthetic as S
    from rcr.embedded import scene_layout

    common = TINY + ["--layout", "v5", "--vision-steps", "0", "--steps", "10", "--polish-steps", "2"]
    base = run(common, tmp_path, "base")
    share = common + ["--share-steps", "2", "--share-layers", "0", "1", "--init-from", str(base)]
    capsys.readouterr()
    assert run(share, tmp_path, "a", "--stop-after", "1") is None
    out = capsys.readouterr().out
    assert "running only that stage" in out and "--stop-after: checkpointed at step 1" in out
    run(share, tmp_path, "a")
    out = capsys.readouterr().out
    assert f"resumed from {tmp_path / 'a' / 'share.pt'} at step 1" in out and "after 2 share steps" in out
    run(share, tmp_path, "b", "--same-as", str(tmp_path / "a" / "model"))
    assert "bit for bit" in capsys.readouterr().out
    saved = Recipe.load(tmp_path / "a" / "model")
    assert saved.share_steps == 2 and scene_layout(str(tmp_path / "a" / "model")) == "v6"
    before = load_file(base / "model.safetensors")
    moved = [k for k, v in weights(tmp_path / "a").items() if not torch.equal(v, before[k])]
    assert moved, "the share stage trained nothing"

    # another recipe's model: the whole run starts from its weights (the main stage's first step)
    capsys.readouterr()
    assert run(share + ["--polish-lr", "1e-3"], tmp_path, "c", "--stop-after", "1") is None
    out = capsys.readouterr().out
    assert "running only that stage" not in out and "checkpointed at step 1" in out
    assert (tmp_path / "c" / "ckpt.pt").exists() and not (tmp_path / "c" / "share.pt").exists()

    # its optimizer: the value projections at share_value_lr_scale, the tower's body at vision_lr_scale
    from embedded.share import share_optimizer

    recipe = cli.parse(share[:-2] + ["--share-value-lr-scale", "10"])[0]
    model, _ = train.build_run_model(recipe, build_tokenizer(), "cpu")
    names = {id(p): n for n, p in model.named_parameters()}
    scales = {names[id(p)]: g["lr_scale"] for g in share_optimizer(model, recipe).param_groups for p in g["params"]}
    assert {n for n, s in scales.items() if s == 10} == {n for n in scales if ".self_attn.v_proj." in n}
    assert scales["model.visual.blocks.0.mlp.fc1.weight"] == recipe.vision_lr_scale

    # its batches: the polish stage's plan, on v6, with the share targets on descriptions only
    tok = build_tokenizer()
    builder = BatchBuilder(build_processor(tok))
    recipe = cli.parse(common + ["--share-steps", "6", "--share-layers", "1", "--polish-steps", "6", "--steps",
                                 "30"])[0]
    model, sink = train.build_run_model(recipe, tok, "cpu")
    sharer = Sharer(recipe, RunOptions(tmp_path, tmp_path), model, train.main_optimizer(model, recipe), builder,
                    tmp_path / "unused.pt", 0.0, sink)
    seen = set()
    for step in range(6):
        sharer.step = step
        task, lay, items, _ = batch_plan(recipe.polish_seed, 24 + step, 30, 0.25, "v6", recipe.polish_mix)
        batch = sharer.batch()
        assert lay == "v6" and ("share_target" in batch) == (task == "detailcaps"), (task, batch.keys())
        if task == "detailcaps":
            want = [share_target(S.scene_tint(task, s, i, "v6"), recipe.share_range) for s, i, _ in items]
            assert batch["share_target"].tolist() == pytest.approx(want)
        seen.add(task)
    assert "detailcaps" in seen
