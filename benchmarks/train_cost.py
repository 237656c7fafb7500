"""What a fresh `python jobs/train_embedded.py` costs on this machine, measured without training to the end.

Each training step's batch is a pure function of (seed, step) (``embedded/curriculum.py``), and a step's
time depends on its batch (task, scene, text length), not on the weights. So ``--per-phase`` steps drawn evenly
from each stage and curriculum phase are timed on a fresh model (one untimed step first), and the projected total
is each phase's mean step time times its number of steps. Run it on an otherwise idle machine: a training run must
be paused (``kill -STOP``) while it measures, and the load average is printed before and after. Other arguments
are the trainer's recipe flags.

    python -m benchmarks.train_cost                          # the shipped recipe, at its thread count
    python -m benchmarks.train_cost --per-phase 12 --steps 6000
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch

from embedded import cli, train
from embedded.assets import build_processor, build_tokenizer
from embedded.batches import BatchBuilder
from embedded.curriculum import CURRICULUM
from embedded.loops import Meter, Polisher, Trainer
from embedded.vision import VisionPretrainer


def timed(stage: Trainer, steps) -> float:
    """Mean seconds of ``stage``'s training steps ``steps``, after one untimed step."""
    def one(s: int) -> float:
        t0 = time.perf_counter()
        stage.step = int(s)
        stage.train_step(Meter())
        return time.perf_counter() - t0

    one(steps[0])  # first-call allocations
    return float(np.mean([one(s) for s in steps]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-phase", type=int, default=8, help="timed steps per stage and curriculum phase")
    args, recipe_flags = ap.parse_known_args(argv)
    recipe, opts = cli.parse(recipe_flags + ["--fresh"])
    torch.set_num_threads(os.cpu_count() if recipe.threads == "auto" else int(recipe.threads))
    print(f"load average before: {os.getloadavg()[0]:.2f}; torch threads {torch.get_num_threads()}; recipe "
          + " ".join(f"{k}={v}" for k, v in recipe.to_dict().items()), flush=True)
    tok = build_tokenizer()
    model, sink = train.build_run_model(recipe, tok, "cpu")
    train.training_attention(model, recipe)
    model.train()
    builder, ckpt = BatchBuilder(build_processor(tok)), Path(os.devnull)  # no checkpoint is ever written
    opt = train.main_optimizer(model, recipe)
    rows, total = [], 0.0
    if recipe.vision_steps:
        pre = VisionPretrainer(recipe, opts, model, ckpt, "cpu")
        rows.append(("vision", recipe.vision_steps, timed(pre, np.linspace(0, recipe.vision_steps - 1,
                                                                            args.per_phase).round())))
    trainer = Trainer(recipe, opts, model, opt, builder, ckpt, 0, 0.0, sink)
    lo = 0
    for until, *_ in CURRICULUM:
        hi = min(recipe.steps, int(round(until * recipe.steps)))
        rows.append((f"{lo}-{hi}", hi - lo, timed(trainer, np.linspace(lo, hi - 1, args.per_phase).round())))
        lo = hi
    if recipe.polish_steps:
        polisher = Polisher(recipe, opts, model, opt, builder, ckpt, 0.0, sink)
        rows.append(("polish", recipe.polish_steps, timed(polisher, np.linspace(0, recipe.polish_steps - 1,
                                                                                 args.per_phase).round())))
    print(f"{'stage/phase':>12}  {'steps':>6}  {'s/step':>7}  {'min':>6}")
    for name, n, mean in rows:
        total += mean * n
        print(f"{name:>12}  {n:>6}  {mean:>7.2f}  {mean * n / 60:>6.1f}")
    print(f"projected fresh run: {total / 60:.0f} min; load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
