"""What a fresh `python jobs/train_embedded.py` costs on this machine, measured without training to the end.

Each training step's batch is a pure function of (seed, step) (``jobs/train_embedded.py``, ``batch_plan``), and a
step's time depends on its batch (task, scene, text length), not on the weights. So ``--per-phase`` steps drawn
evenly from each curriculum phase are timed on a fresh model (one untimed step first), and the projected total is
each phase's mean step time times its number of steps. Run it on an otherwise idle machine: a training run must
be paused (``kill -STOP``) while it measures, and the load average is printed before and after.

    python benchmarks/train_cost.py                          # the default recipe, 2 threads (what a lone run uses)
    python benchmarks/train_cost.py --hold-sink --per-phase 12
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from jobs import train_embedded as T  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-phase", type=int, default=8, help="timed steps per curriculum phase")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (a lone training run uses every core)")
    ap.add_argument("--train-args", default="", help="extra jobs/train_embedded.py flags, e.g. '--size mini_2d'")
    ap.add_argument("--hold-sink", action="store_true")
    args = ap.parse_args(argv)
    targs = T.parse_args(args.train_args.split() + (["--hold-sink"] if args.hold_sink else []))
    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()[0]:.2f}; torch threads {args.threads}; "
          f"recipe --size {targs.size} --layout {targs.layout} --steps {targs.steps}"
          f"{' --hold-sink' if targs.hold_sink else ''}"
          f"{f' --vision-steps {targs.vision_steps}' if targs.vision_steps else ''}"
          f"{' --freeze-vision' if targs.freeze_vision else ''}", flush=True)

    tok = T.build_tokenizer()
    processor = T.build_processor(tok)
    model, sink = T.build_run_model(targs, tok, "cpu")
    T.training_attention(model, targs)  # as main() does
    model.train()
    # the trainer's own step (batch, optimizer step, held-sink restore, meter); no checkpoint is ever written
    trainer = T.Trainer(targs, model, T.main_optimizer(model, targs), T.BatchBuilder(processor),
                        Path(os.devnull), 0, 0.0, sink)

    def step(s: int, stage: T.Trainer = trainer) -> float:
        """Seconds of ``stage``'s training step ``s`` (the main stage's by default)."""
        t0 = time.perf_counter()
        stage.step = s
        stage.train_step(T.Meter())
        return time.perf_counter() - t0

    step(0)  # untimed: first-call allocations
    lo, total = 0, 0.0
    print(f"{'phase':>12}  {'steps':>6}  {'s/step':>7}  {'min':>6}")
    if targs.vision_steps:  # --vision-steps: the vision stage runs first (never resumed here, nothing written)
        pre = T.VisionPretrainer(argparse.Namespace(**{**vars(targs), "fresh": True}), model, Path(os.devnull), "cpu")
        step(0, pre)
        picks = np.linspace(0, targs.vision_steps - 1, args.per_phase).round().astype(int)
        mean = float(np.mean([step(int(s), pre) for s in picks]))
        total += mean * targs.vision_steps
        print(f"{'vision':>12}  {targs.vision_steps:>6}  {mean:>7.2f}  {mean * targs.vision_steps / 60:>6.1f}",
              flush=True)
    T.freeze_tower(model, targs)  # --freeze-vision: the main stage's backward skips the tower's weights
    for until, *_ in T.CURRICULUM:
        hi = min(targs.steps, int(round(until * targs.steps)))
        picks = np.linspace(lo, hi - 1, args.per_phase).round().astype(int)
        mean = float(np.mean([step(int(s)) for s in picks]))
        total += mean * (hi - lo)
        print(f"{lo:>5}-{hi:<6}  {hi - lo:>6}  {mean:>7.2f}  {mean * (hi - lo) / 60:>6.1f}", flush=True)
        lo = hi
    print(f"projected fresh run: {total / 60:.0f} min for {targs.steps} steps "
          f"({total / targs.steps:.2f} s/step); load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
