"""The embedded model's attention, layer by layer, on its held-out synthetic scenes: ``pipeline.diagnose.attention``'s
profile (prefix, image, on-img, top-S, static, entries, dwell) with the two columns only the synthetic scenes
can give:

* ``flat``: the part of the image mass on visual tokens whose 28 x 28 pixels are one flat colour (the scenes' empty
  background; single-image tasks): such tokens all carry the same value, so a head can park its idle mass on them
  as on a sink spread over hundreds of entries, which no 32-entry selection holds;
* ``cell`` (detailcaps on a layout that describes every cell): the share of a step's image mass on the cell its
  description is at (the last "row .. , column .." written), against ``1 / cells`` for attention that ignores
  where the description is. A model that reads what it writes puts most of its image mass there.

    python -m embedded.probes.attention                     # the embedded model, 4 detailcaps samples
    python -m embedded.probes.attention --model /tmp/peek --n 8
    python -m embedded.probes.attention --per-head          # also one row per KV head (its query heads)

A sliding-window layer is marked ``local``: it keeps its window and no method re-selects it.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch

from embedded.probes.common import held_out_answers, model_layout, sample_args
from pipeline.data import synthetic as S
from pipeline.diagnose.attention import profile
from rcr.models import geometry, load


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sample_args(ap, n=4)
    ap.add_argument("--selected", type=int, default=32, help="the selection budget S for the top-S share (32)")
    ap.add_argument("--per-head", action="store_true", help="also a row per KV head under each layer")
    args = ap.parse_args(argv)
    args.layout = model_layout(args.model or "embedded", args.layout)
    torch.set_num_threads(args.threads)
    model, processor = load(args.model)
    model.set_attn_implementation("eager")  # the attention weights are materialised only by the eager path
    geo = geometry(model)
    answers = held_out_answers(model, processor, args.task, args.layout, args.n, args.max_new_tokens)
    layers = profile(model, answers, args.selected, args.per_head)
    reselected = geo.reselected(answers[0].inputs["input_ids"].shape[1] + args.max_new_tokens - 1)
    print(f"{args.model} | {args.task}, layout {args.layout}, {args.n} held-out samples | "
          f"load average {os.getloadavg()[0]:.2f}, {args.threads} thread(s)")
    top = f"top-{args.selected}"
    lay = S.get_layout(args.layout)
    cells = args.task == "detailcaps" and lay.every_cell
    chance = f"cell (chance {1 / (lay.rows * lay.cols):.3f})" if cells else "cell"
    print(f"{'layer':>5}  {'kind':<6} {'prefix':>7} {'image':>7} {'on-img':>7} {'flat':>7} {top:>7} {'static':>7} "
          f"{'entries':>8} {'dwell':>7}  {chance}")
    for i, r in enumerate(layers):
        kind = "global" if reselected[i] else "local"
        for name, k, row in [(f"{i}", kind, r)] + [(f"kv{h}", "", x) for h, x in enumerate(r.get("heads", []))]:
            print(f"{name:>5}  {k:<6} {row['prefix']:7.3f} {row['image']:7.3f} {row['on_image']:7.3f} "
                  f"{row['flat']:7.3f} {row['top']:7.3f} {row['static']:7.3f} {row['entries']:8.1f} "
                  f"{row['dwell']:7.3f}  {row['cell']:7.3f}")
    treated = [r for i, r in enumerate(layers) if reselected[i]]
    print(f"re-selected layers: mean top-{args.selected} share {np.mean([r['top'] for r in treated]):.3f}, "
          f"dwell {np.mean([r['dwell'] for r in treated]):.3f}")


if __name__ == "__main__":
    main()
