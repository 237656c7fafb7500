"""What sets a sample's drift: its scene, its task, or the model's layers?

The paper's per-sample threshold exists because drift differs in scale between samples: in its Qwen2-VL, at
tau = 0.03, the low-drift third of the samples refreshes 1% of its layer-steps and the high-drift third 35%. This
decodes held-out samples of several kinds side by side, through the pipeline's own evaluator, with ``exact`` and
``fixed`` (tau = 0.03, the default config's 32 selected + 32 window): detailcaps scenes with a forced number of
objects (``--objects``; the layout's own range if empty), textcaps captions and video (``--tasks``). Per kind it
prints:

* ``drift``: the sample's mean exact drift on its ``exact`` row (the mass each step's query puts on what the
  previous step's top-32 left out: the part no 32-entry selection holds, plus one step of movement), its spread
  between samples (``sd``), and per re-selected layer;
* ``fixed drift`` and ``fixed refresh``: what ``fixed`` measures against its own (stale) selection, and the share
  of layer-steps it refreshes.

Then, over all samples together (the pipeline's ``analyze``, as a job's drift terciles): ``fixed``'s refresh
fraction in the low / mid / high tercile of sample drift, and Spearman's rho of a detailcaps sample's drift
against its object count. A model whose drift is set by its layers shows the same drift for every kind and no
tercile spread; one whose drift follows what the description reads shows it rising with the count.

    python -m embedded.probes.drift_spread   # the embedded model, 8 samples per kind
    python -m embedded.probes.drift_spread --model runs/train/final --objects 3,6,12,18 --tasks textcaps,video
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import pandas as pd
from scipy.stats import spearmanr

from embedded.probes.common import evaluate_task, layout_flag, model_layout
from pipeline.analysis.analyze import analyze
from pipeline.data import synthetic as S
from pipeline.run.config import EMBEDDED, JobConfig

METHODS = ["full", "exact", "fixed"]


def kinds(objects: list[int], tasks: list[str]) -> list[tuple[str, str, int | None]]:
    """(label, task, forced detailcaps object count) of each kind of sample."""
    return [(f"detailcaps n={n}", "detailcaps", n) for n in objects] + \
        ([("detailcaps", "detailcaps", None)] if not objects else []) + [(t, t, None) for t in tasks]


def layer_means(rows: pd.DataFrame, col: str = "drift_exact") -> dict[int, float]:
    """{layer: mean over samples of the layer's mean drift over the sample's steps}, for the layers with a drift
    (a sliding-window layer is never re-selected: its drift is NaN)."""
    per = []
    for row in rows[col]:
        a = np.stack([np.asarray(x, float) for x in row])  # (L, steps); samples differ in steps
        seen = ~np.isnan(a)
        per.append(np.where(seen.any(-1), np.where(seen, a, 0.0).sum(-1) / np.maximum(seen.sum(-1), 1), np.nan))
    per = np.stack(per)  # (samples, L)
    return {int(i): float(np.nanmean(per[:, i])) for i in np.flatnonzero(~np.isnan(per).all(0))}


def kind_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per kind (the rows' ``kind`` column): exact drift mean / sd between samples / per layer, and
    fixed's drift and refresh fraction."""
    out = []
    for kind, g in rows.groupby("kind", sort=False):
        ex, fx = g[g["method"] == "exact"], g[g["method"] == "fixed"]
        out.append({"kind": kind, "samples": len(ex), "drift": ex["mean_drift_exact"].mean(),
                    "sd": ex["mean_drift_exact"].std(ddof=0), "fixed drift": fx["mean_drift"].mean(),
                    "fixed refresh": fx["refresh_fraction"].mean(),
                    "drift per layer": " ".join(f"{i}:{v:.3f}" for i, v in layer_means(ex).items())})
    return pd.DataFrame(out)


def count_rho(rows: pd.DataFrame) -> tuple[float, float, int]:
    """Spearman's rho (and p) of an ``exact`` detailcaps sample's drift against its forced object count."""
    ex = rows[(rows["method"] == "exact") & rows["objects"].notna()]
    if ex["objects"].nunique() < 2:
        return float("nan"), float("nan"), len(ex)
    r = spearmanr(ex["objects"].astype(float), ex["mean_drift_exact"])
    return float(r.statistic), float(r.pvalue), len(ex)


def decode(model: str, kind: tuple[str, str, int | None], n: int, layout: str, threads: int) -> pd.DataFrame:
    """``n`` held-out samples of one kind, decoded by ``full``, ``exact`` and ``fixed``: the job's rows."""
    label, task, count = kind
    cfg = JobConfig.from_dict(dict(task=task, model=model, methods=METHODS, device="cpu", batch_size=8,
                                   torch_threads=threads, rcr={"record_attention": True, "exact_drift": True}))
    rows = evaluate_task(cfg, task, n, S.HELDOUT_SEED, layout, n_objects=count, label=label)
    return rows.assign(kind=label, objects=count)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EMBEDDED, help="'embedded' (the shipped model) or a model directory")
    layout_flag(ap)
    ap.add_argument("--objects", default="3,6,12,18",
                    help="comma-separated detailcaps object counts, one kind each ('' = the layout's own draw)")
    ap.add_argument("--tasks", default="textcaps", help="comma-separated other tasks, one kind each")
    ap.add_argument("--n", type=int, default=8, help="held-out samples per kind")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args(argv)
    args.layout = model_layout(args.model or "embedded", args.layout)
    try:
        objects = [int(x) for x in args.objects.split(",") if x]
    except ValueError:
        ap.error(f"--objects: comma-separated integers, got {args.objects!r}")
    lay = S.get_layout(args.layout)
    if any(not 1 <= n <= lay.rows * lay.cols for n in objects):
        ap.error(f"--objects: counts in 1..{lay.rows * lay.cols} (the cells of layout {args.layout}), got {objects}")
    tasks = [t for t in args.tasks.split(",") if t]
    for t in tasks:
        if t not in S.TASKS or t == "detailcaps":
            ap.error(f"--tasks: one of textcaps, video (detailcaps kinds come from --objects), got {t!r}")
    if args.n < 3:
        ap.error("--n: at least 3 samples per kind")

    print(f"{args.model} | layout {args.layout} | {args.n} held-out samples per kind | 32 selected + 32 window, "
          f"fixed at tau = 0.03 | load average {os.getloadavg()[0]:.2f}, {args.threads} thread(s)")
    rows = pd.concat([decode(args.model, k, args.n, args.layout, args.threads)
                      for k in kinds(objects, tasks)], ignore_index=True)
    a = analyze(rows.drop(columns=["kind", "objects"]), baselines=())
    print("\n" + kind_table(rows).to_string(index=False, float_format="{:.3f}".format))
    t = a.terciles[a.terciles["method"] == "fixed"].set_index("tercile")
    print("\nfixed, all kinds together, by tercile of sample drift (low / mid / high): refresh "
          + " / ".join(f"{t.loc[k, 'refresh_fraction']:.3f}" for k in ("low", "mid", "high"))
          + "; mean drift " + " / ".join(f"{t.loc[k, 'drift_mean']:.3f}" for k in ("low", "mid", "high"))
          + "  (the paper's Qwen2-VL: refresh 0.01 / - / 0.35)")
    rho, p, m = count_rho(rows)
    print(f"Spearman rho of drift against the detailcaps object count: {rho:+.2f} (p = {p:.2g}, {m} samples)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
