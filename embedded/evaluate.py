"""The embedded default's bars: the premise check (``jobs/diagnose.py``'s figures) on held-out synthetic samples,
plus the embedded model's own bars (``embedded/bars.py``).

Runs the pipeline's own evaluator (``SampleEvaluator``, the callable class a Ray actor runs) in this process on
held-out synthetic samples (seed ``pipeline.data.synthetic.HELDOUT_SEED``; training never uses it) and scores them
with the pipeline's own statistics (``analyze``: ROUGE-L fidelity against the uncompressed output, paired bootstrap
95% CIs, drift terciles, top-position stability), so every figure here is what a job on the same samples would
report. Exit status 1 if a bar is missed.

    python jobs/eval_embedded.py                                   # the shipped model, 100 samples per task
    python jobs/eval_embedded.py --model embedded-drift            # the drift test bed, by its own bars
    python jobs/eval_embedded.py --model ~/rcr-runs/train_embedded/model --n 20   # a candidate, quick look

A model is judged by the bars its recipe calls for (``bars.bar_set``) on the scene layout it was trained on.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from embedded import bars as B
from embedded.probes.common import evaluate_task, layout_flag, model_layout
from pipeline.analysis.analyze import analyze
from pipeline.analysis.labels import BACON, PREFILL_ORACLE
from pipeline.data import synthetic as S
from pipeline.diagnose import premises
from pipeline.run.config import EMBEDDED, JobConfig
from pipeline.tasks import TASKS

# methods each task decodes (besides full); detailcaps carries the premises, textcaps the short-answer one
TASK_METHODS = {
    "detailcaps": ["full", "bacon", "prefill_oracle", "exact", "fixed"],
    "textcaps": ["full", "bacon", "prefill_oracle", "exact"],
    "video": ["full"],
}


def layer_probes(model_name: str, layout: str, seed: int, picks: dict[str, str], threads: int):
    """The premise check's per-layer probes (attention profile, detector recall, and the attention profile per
    drift tercile) on the detailcaps answers of ``seed``'s scenes that ``picks`` names (sample id -> tercile,
    ``premises.probe_picks``), with eager attention (the weights are materialised only there)."""
    import torch

    from embedded.probes.common import held_out_answers
    from pipeline.diagnose import attention, detector
    from rcr.methods import RCR
    from rcr.models import geometry, load

    torch.set_num_threads(threads)
    model, processor = load(model_name)
    model.set_attn_implementation("eager")
    ids = sorted(picks, key=S.scene_index)
    answers = held_out_answers(model, processor, "detailcaps", layout, [S.scene_index(s) for s in ids],
                               TASKS["detailcaps"].max_new_tokens, seed)
    rcr_ = RCR()  # the paper's budget, detector and candidates
    per_sample = attention.sample_profiles(model, answers, rcr_.config.selected)
    by_tercile = attention.mean_profiles_by(per_sample, [picks[s] for s in ids])
    context = answers[0].inputs["input_ids"].shape[1] + TASKS["detailcaps"].max_new_tokens - 1
    return attention.mean_profile(per_sample), detector.probe(model, answers, rcr_), \
        geometry(model).reselected(context), by_tercile


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EMBEDDED, help="'embedded' (the shipped model), 'embedded-drift' (the drift "
                    "test bed) or a model directory")
    layout_flag(ap)
    ap.add_argument("--n", type=int, default=100, help="held-out samples per task (the bars need >= 100)")
    ap.add_argument("--tasks", default=",".join(TASK_METHODS), help="comma-separated subset of tasks")
    ap.add_argument("--seed", type=int, default=S.HELDOUT_SEED, help="held-out seed (training never uses it)")
    ap.add_argument("--batch-size", type=int, default=8, help="samples per left-padded model batch")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--json", default=None, help="also write every bar and figure to this file")
    ap.add_argument("--attention-samples", type=int, default=3,
                    help="detailcaps samples of each drift tercile the per-layer probes answer again (0: skip "
                         "them)")
    args = ap.parse_args(argv)
    if args.attention_samples < 0:
        ap.error(f"--attention-samples must be >= 0, got {args.attention_samples}")
    args.layout = model_layout(args.model, args.layout)
    args.tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in args.tasks if t not in TASK_METHODS]
    if unknown or not args.tasks:
        ap.error(f"--tasks {','.join(args.tasks)!r}: give some of {', '.join(TASK_METHODS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    judged = B.bar_set(args.model)
    bars: list[B.Bar] = []
    tables: dict[str, str] = {}
    figs: list[premises.Figure] = []
    print(f"model {args.model}; scene layout {args.layout}; {args.n} held-out samples per task (seed {args.seed}); "
          f"{judged.name}")
    for task in args.tasks:
        cfg = JobConfig.from_dict(dict(task=task, model=args.model, methods=TASK_METHODS[task], device="cpu",
                                       batch_size=args.batch_size, torch_threads=args.threads,
                                       rcr={"record_attention": True, "exact_drift": True}))
        rows = evaluate_task(cfg, task, args.n, args.seed, args.layout)
        a = analyze(rows, baselines=(BACON, PREFILL_ORACLE) if task != "video" else ())
        tables[task] = B.method_table(task, a)
        bars.append(B.quality_bar(task, a, judged))
        if task == "detailcaps":
            order = sorted(rows["sample_id"].unique(), key=S.scene_index)
            terc = a
            if judged.tercile_samples is not None:  # the test bed's terciles: its first tercile_samples samples
                order = order[:judged.tercile_samples]
                terc = analyze(rows[rows["sample_id"].isin(order)], baselines=(BACON, PREFILL_ORACLE))
            picks = premises.probe_picks(terc, order, args.attention_samples)
            probes = layer_probes(args.model, args.layout, args.seed, picks, args.threads) \
                if args.attention_samples else (None, None, None, None)
            figs = premises.figures(a, *probes)
            if judged is B.TESTBED:
                tercile_figs = premises.drift_spread(terc) + premises.tercile_staleness(terc)
                print(f"\n=== drift terciles of the first {len(order)} detailcaps samples ===")
                print(premises.table(tercile_figs))
                bars += B.testbed_bars(tercile_figs, figs)
            else:
                bars += B.premise_bars(figs, rows) + B.aims(figs)
        if task == "textcaps" and judged is B.DEFAULT:
            bars.append(B.short_answer_bar(a))
    print("\n=== per method (fidelity = ROUGE-L against the uncompressed output; paired bootstrap 95% CI) ===")
    print("\n".join(tables.values()))
    if figs:
        print("\n=== premise check, detailcaps (jobs/diagnose.py's figures) ===")
        print(premises.table(figs))
    print(f"\n=== {judged.name} (32 selected + 32 window) ===")
    print("\n".join(b.line() for b in bars))
    ok = all(b.passed for b in bars if not b.aim)
    print("\nALL BARS MET" if ok else "\nSOME BARS MISSED")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"model": args.model, "layout": args.layout, "n": args.n, "bars": [b.__dict__ for b in bars],
             "figures": premises.frame(figs).to_dict("records") if figs else [], "all_bars_met": ok}, indent=2,
            default=lambda x: x.item() if isinstance(x, np.generic) else str(x)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
