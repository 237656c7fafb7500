"""Where does the uncompressed output's distance from the ground truth come from?

The quality bars (`jobs/eval_embedded.py`) score the full model's greedy output against the generator's text by
ROUGE-L. A synthetic description is a fixed template around the words only the image tells: each object's size,
colour, texture and shape (pipeline/data/synthetic.py). This script generates the full model's output on
held-out samples and scores it four more ways: with every attribute word replaced by its class name in both
texts (so only the template, the cells and the occupancy count), and with one class at a time left as it is
and the other three masked (so only that class's mistakes count, besides the template's).

    python -m embedded.probes.quality_gap                          # the embedded model, 8 samples per task
    python -m embedded.probes.quality_gap --model /tmp/peek --layout v4 --n 16 --tasks detailcaps

A model whose "masked" score is near 1 writes the template right and loses only on reading the objects.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from embedded.probes.common import evaluate_task, layout_flag, model_layout
from embedded.probes.reading import ATTRIBUTES
from pipeline.analysis.text_metrics import rouge_l_f1
from pipeline.data import synthetic as S
from pipeline.run.config import JobConfig

CLASSES = {name: vocab for name, (_, vocab) in ATTRIBUTES.items()}  # the words only the image tells
WORD_CLASS = {w: c for c, words in CLASSES.items() for w in words}


def masked(text: str, keep: str | None = None) -> str:
    """``text`` with each attribute word replaced by ``<class>``, except the words of class ``keep``."""
    return " ".join(f"<{WORD_CLASS[w]}>" if w in WORD_CLASS and WORD_CLASS[w] != keep else w
                    for w in S.canonical(text).split())


def gap_scores(reference: str, output: str) -> dict[str, float]:
    """ROUGE-L F1 as scored, with every attribute masked, and with only one class unmasked."""
    out = {"as scored": rouge_l_f1(reference, output), "masked": rouge_l_f1(masked(reference), masked(output))}
    for c in CLASSES:
        out[c] = rouge_l_f1(masked(reference, keep=c), masked(output, keep=c))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    layout_flag(ap)
    ap.add_argument("--n", type=int, default=8, help="held-out samples per task")
    ap.add_argument("--tasks", default="detailcaps,textcaps")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    args.layout = model_layout(args.model or "embedded", args.layout)

    print(f"model {args.model}, layout {args.layout}, {args.n} held-out samples per task; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("ROUGE-L(full, truth), mean over samples; masked: attribute words replaced by their class in both texts;"
          " a class: only that class unmasked")
    cols = ["as scored", "masked", *CLASSES]
    print(f"{'task':<12}" + "".join(f"{c:>11}" for c in cols))
    for task in [t for t in args.tasks.split(",") if t]:
        cfg = JobConfig.from_dict(dict(task=task, model=args.model, methods=["full"], device="cpu",
                                       batch_size=8, torch_threads=args.threads))
        rows = evaluate_task(cfg, task, args.n, S.HELDOUT_SEED, args.layout, log=lambda *a, **k: None)
        scores = [gap_scores(r["references"][0], r["output_text"]) for _, r in rows.iterrows()]
        print(f"{task:<12}" + "".join(f"{np.mean([s[c] for s in scores]):>11.3f}" for c in cols), flush=True)


if __name__ == "__main__":
    main()
