"""How fast does a fresh embedded-size model learn to read a scene layout? textcaps only, from scratch.

textcaps answers are short ("A big red plain circle at the top left .") and name 1-2 objects, so the words
only the image tells (the ``reading`` probe) are learnt first here, or not at all. Every ``--every`` steps the
held-out reading accuracy is printed for ``--layout`` and for each ``--also`` layout. ``--boot N`` trains the first N
steps on ``--boot-layout``'s scenes instead (what the trainer's curriculum does, ``embedded.curriculum``),
and ``--ramp M`` then fades ``--layout``'s textured canvas in from flat grey over the next M steps.

    python -m embedded.probes.vision_bootstrap --layout v1 --steps 400   # the small flat canvas
    python -m embedded.probes.vision_bootstrap --layout v4 --steps 400   # v4's textured 448 x 560 canvas
    python -m embedded.probes.vision_bootstrap --layout v4 --boot 800 --steps 1000 --also v1
    python -m embedded.probes.vision_bootstrap --layout v4 --boot 600 --ramp 400 --steps 1400 --also v3
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from embedded.assets import MODEL_SIZES, build_model, build_processor, build_tokenizer
from embedded.batches import BatchBuilder
from embedded.curriculum import BATCH_SIZES, BOOTSTRAP_LAYOUT, cosine_lr
from embedded.losses import make_optimizer, optimizer_step
from embedded.probes.reading import probe
from pipeline.data import synthetic as S


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="mini_2d_slow", choices=sorted(MODEL_SIZES))
    ap.add_argument("--layout", default="v4", choices=sorted(S.LAYOUTS))
    ap.add_argument("--also", default="", help="comma-separated layouts also evaluated")
    ap.add_argument("--boot", type=int, default=0, help="the first BOOT steps train on --boot-layout")
    ap.add_argument("--boot-layout", default=BOOTSTRAP_LAYOUT, choices=sorted(S.LAYOUTS))
    ap.add_argument("--ramp", type=int, default=0,
                    help="after the boot, --layout's canvas strength grows from 0 to 1 over RAMP steps")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--batch", type=int, default=BATCH_SIZES["textcaps"])
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--n", type=int, default=24, help="held-out samples per evaluation")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    tok = build_tokenizer()
    processor = build_processor(tok)
    model = build_model(tok, args.size, seed=args.seed)
    opt = make_optimizer(model, args.lr, weight_decay=0.1)
    builder = BatchBuilder(processor)
    layouts = [args.layout] + [x for x in args.also.split(",") if x and x != args.layout]
    print(f"size {args.size}, textcaps only, batch {args.batch}, {args.steps} steps"
          + (f", the first {args.boot} on {args.boot_layout}" if args.boot else f" on {args.layout}")
          + (f", then {args.layout}'s canvas faded in over {args.ramp}" if args.ramp else "")
          + f"; load average {os.getloadavg()[0]:.2f}; held-out accuracy [chance]", flush=True)
    t0 = time.time()
    for step in range(args.steps + 1):
        if step % args.every == 0 or step == args.steps:
            model.eval()
            cells = []
            for lay in layouts:
                res = probe(model, processor, "textcaps", lay, args.n)
                cells.append(f"{lay}: " + " ".join(f"{k} {c / m:.2f} [{ch:.2f}]" for k, (c, m, ch) in res.items()
                                                   if k in ("colour", "texture", "shape") and m))
            print(f"step {step:>5}  " + "   ".join(cells) + f"   {time.time() - t0:.0f} s", flush=True)
            model.train()
        if step == args.steps:
            break
        lay = args.boot_layout if step < args.boot else args.layout
        strength = min(1.0, (step - args.boot) / args.ramp) if args.ramp and step >= args.boot else 1.0
        batch = builder.build("textcaps", [S.render("textcaps", args.seed, step * 64 + i, layout=lay,
                                                    canvas_strength=strength) for i in range(args.batch)])
        optimizer_step(model, opt, batch, cosine_lr(args.lr, 50, args.steps, step))


if __name__ == "__main__":
    main()
