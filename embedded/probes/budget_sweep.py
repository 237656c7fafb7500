"""Fidelity against the resident budget on the embedded model: when does re-selection beat a static selection?

    python -m embedded.probes.budget_sweep [--model embedded] [--samples 16] [--selected 16,32,64]
    python -m embedded.probes.budget_sweep --whole-layers 0    # ablation: layer 0 attends to its whole prefix
    python -m embedded.probes.budget_sweep --selected 32 --methods exact,quest,arkvale --page-sizes 1,4,8,16
    python -m embedded.probes.budget_sweep --selected 32 --methods exact,infinigen \
        --set infinigen.partial_ratio=1.0

For each ``selected`` budget (window fixed at 32), every method decodes the same held-out synthetic
``detailcaps`` scenes (seed ``pipeline.data.synthetic.HELDOUT_SEED``) from one prefill per batch, through the
pipeline's own evaluator, and is scored with the pipeline's own statistics: ROUGE-L fidelity against the
uncompressed output of the same run, the exact drift (the attention mass each step's query puts on the
prefix entries evicted when it arrived, before that step's refresh; mean over layer-steps) and the realised
refresh fraction. Everything is measured side by side in one run, so the comparison between methods holds
on a noisy machine; the seconds do not.

``--page-sizes`` repeats each budget at several page sizes of the page-based baselines (Quest, ArkVale; the
token-level methods ignore it), and prints, per layer, how often one of Quest's kept pages is the prompt's first
page: a page that holds an attention sink outranks every other page, so at 2 pages of 16 (the paper's 32 slots)
it leaves 16 slots for everything else where a token-level selection spends one (docs/embedded.md).

``--whole-layers`` is an ablation, not a method: in the listed layers every method attends to the whole prefix
(plus the window and the answer so far), as ``full`` does, while the other layers keep their selections. It
shows how much of a method's loss comes from those layers (docs/embedded.md: v2's first layer). The telemetry
of those layers still describes the selection the method made there.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time

import numpy as np

from embedded.probes.common import evaluate_task, layout_flag, model_layout
from pipeline.analysis.analyze import analyze
from pipeline.data import synthetic as S
from pipeline.run.config import EMBEDDED, JobConfig


@contextlib.contextmanager
def whole_layers(layers: set[int]):
    """Within the block, decoding attends to the whole prefix in ``layers`` (the ablation above)."""
    import torch

    from rcr.attention import attend

    gen = importlib.import_module("rcr.generate")  # the module (``rcr.generate`` the name is the function)
    selective = gen.DecodeSession.__call__

    def call(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        out = selective(self, module, query, key, value, attention_mask, scaling, **kwargs)  # decides, records
        if module.layer_idx not in layers:
            return out
        res = self.cache.layers[module.layer_idx]
        k_p, v_p = self.prefix.prefix_kv(module.layer_idx)  # (B, Hkv, Np, d)
        s = res.n_selected  # resident layout [selected | window | answer]: keep all but the selection
        keys = torch.cat([k_p, res.resident_keys[..., s:, :]], 2)
        values = torch.cat([v_p, res.resident_values[..., s:, :]], 2)
        valid = torch.cat([self.prefix.prefix_valid.unsqueeze(1).expand(-1, k_p.shape[1], -1),
                           res.resident_valid[..., s:]], -1)
        return attend(query, keys, values, valid, scaling), None

    gen.DecodeSession.__call__ = call
    try:
        yield
    finally:
        gen.DecodeSession.__call__ = selective


@contextlib.contextmanager
def quest_first_page(counts: dict[int, list[float]]):
    """Within the block, record per layer the share of (sample, KV head) decisions in which Quest keeps the
    prompt's first page (``counts[layer]`` gets one share per decode step)."""
    from rcr.methods.quest import Quest
    from rcr.scoring import top_sorted

    score = Quest.score

    def recording(self, ctx):
        scores = score(self, ctx)  # (B, Hkv, Np)
        sel = top_sorted(scores, ctx.resident.n_selected)  # (B, Hkv, S): the entries Quest keeps
        page = ctx.state.layout.page_of.unsqueeze(1).expand(-1, sel.shape[1], -1).gather(2, sel)  # (B, Hkv, S)
        counts.setdefault(ctx.layer, []).append((page == 0).any(-1).double().mean().item())
        return scores

    Quest.score = recording
    try:
        yield
    finally:
        Quest.score = score


def labels_for(methods: list[str], settings: dict) -> tuple[dict[str, str], dict]:
    """Each method's label with the settings that are its own knobs (``rule``: every listed method with that knob;
    ``arkvale.rule``: that method's alone), and the shared RCRConfig settings. A setting that is neither is an
    error."""
    import dataclasses

    from rcr import RCRConfig
    from rcr.methods import METHODS
    from rcr.methods.knobs import knob_fields, with_knobs

    shared = {f.name for f in dataclasses.fields(RCRConfig)}
    labels, config, used = {}, {}, set()
    for m in methods:
        fields = knob_fields(METHODS[m])
        own = {}
        for k, v in settings.items():
            name = k.removeprefix(f"{m}.")
            if name in fields:
                own[name] = v
                used.add(k)
        labels[m] = with_knobs(m, own)
    for k, v in settings.items():
        if k in shared:
            config[k] = v
        elif k not in used:
            raise SystemExit(f"--set {k}=...: neither an RCRConfig field nor a knob of {', '.join(methods)}")
    return labels, config


def parse_setting(text: str) -> tuple[str, object]:
    field, sep, value = text.partition("=")
    if not sep or not field:
        raise SystemExit(f"--set {text!r}: expected FIELD=VALUE, e.g. infinigen.partial_ratio=1.0")
    try:
        return field, json.loads(value)
    except json.JSONDecodeError:
        return field, value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EMBEDDED)
    layout_flag(ap)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--selected", default="16,32,64", help="comma-separated budgets of selected prefix entries")
    ap.add_argument("--methods", default="bacon,prefill_oracle,exact,fixed,rcr,quest,arkvale",
                    help="compared against full")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--whole-layers", default="", help="ablation: comma-separated layers that attend to the whole "
                    "prefix in every method (default: none)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="an RCRConfig field, or a method's knob (rule=recall: every listed method's; "
                         "arkvale.rule=recall: arkvale's), for every run (repeatable; the value is read as JSON, "
                         "else as text)")
    ap.add_argument("--page-sizes", default=None, help="comma-separated page sizes of quest and arkvale "
                    "(default: the config's); with quest, also how often it keeps the prompt's first page")
    args = ap.parse_args(argv)
    args.layout = model_layout(args.model or "embedded", args.layout)
    whole = {int(x) for x in args.whole_layers.split(",") if x}
    overrides = dict(parse_setting(x) for x in args.set)
    methods = ["full"] + [m for m in args.methods.split(",") if m != "full"]
    print(f"model {args.model} (layout {args.layout}); {args.samples} held-out detailcaps scenes; window 32; "
          f"load average {os.getloadavg()[0]:.1f}" + (f"; layers {sorted(whole)} whole (ablation)" if whole else "")
          + (f"; rcr {overrides}" if overrides else ""))
    pages = [int(x) for x in args.page_sizes.split(",")] if args.page_sizes else [None]
    pad = " " * 6 if args.page_sizes else ""  # the page column, only when pages are swept
    print(f"{'selected':>8}  " + ("page  " if pad else "")
          + f"{'method':<15} {'fidelity [95% CI]':<22} {'exact drift':>11} {'refresh':>7}")
    for k in [int(x) for x in args.selected.split(",")]:
        for page in pages:
            t0 = time.time()
            settings = {"candidates": max(128, 4 * k), **({"page_size": page} if page is not None else {}),
                        **overrides}
            labels, shared = labels_for(methods, settings)
            rcr_cfg = {"selected": k, **shared, "exact_drift": True}
            cfg = JobConfig.from_dict(dict(task="detailcaps", model=args.model, methods=list(labels.values()),
                                           device="cpu", batch_size=args.batch_size, torch_threads=args.threads,
                                           rcr=rcr_cfg))
            first_page: dict[int, list[float]] = {}
            with whole_layers(whole), quest_first_page(first_page):
                rows = evaluate_task(cfg, "detailcaps", args.samples, S.HELDOUT_SEED, args.layout,
                                     log=lambda *a, **k: None)
            rows = rows.assign(method=rows["method"].map({v: n for n, v in labels.items()}))  # the plain names
            a = analyze(rows, reference_metrics=False)
            drift = rows.groupby("method")["mean_drift_exact"].mean()
            label = "" if page is None else f"{page:>4}  "
            for _, r in a.methods.set_index("method").loc[methods[1:]].iterrows():
                ci = f"{r['fidelity']:.3f} [{r['fidelity_ci_low']:.3f}, {r['fidelity_ci_high']:.3f}]"
                print(f"{k:>8}  {label}{r.name:<15} {ci:<22} {drift[r.name]:11.3f} {r['refresh_fraction']:7.3f}")
            if first_page:
                share = ", ".join(f"layer {i} {np.mean(v):.2f}" for i, v in sorted(first_page.items()))
                print(f"{'':>8}  {pad}(quest keeps the prompt's first page in: {share})")
            prefix = rows.loc[rows["method"] == "full", "prefix_len"].to_numpy(float)
            print(f"{'':>8}  {pad}(valid prefix entries per sample: mean {np.mean(prefix):.0f}; "
                  f"{time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
