"""Prefix reads per decode step for every method, measured, next to the paper's cost model; and the bytes that
offload mode really moves from host memory, next to the 160·r model.

    python -m benchmarks.reads_per_step [--model PATH] [--samples 3] [--max-new-tokens 48] [--image-size 896]

Model: ``--model``, else the embedded model (rcr/embedded_model) when it exists, else a tiny random-weight
Qwen2-VL (tests/tiny_models.py) with a realistic prefix (896 px: 1,024 visual tokens). Every method decodes
the same samples (batch 1 each) with the paper's budget: 32 selected + 32 window slots, 128 candidates, rank 8,
pages of 16. Reads are the output rows' columns (``pipeline/schema.py``): per KV head and layer-step, over the
layers the method re-selects (docs/algorithms.md, "Cost per decode step": what a step must bring from the prefix
store).

Cost model (docs/algorithms.md, "Cost per decode step"), per KV head and layer-step, next to what the RCR paper
charges ("Cost per KV head per step is about Np/16 detector dot products plus 160·r CPU reads [...] Quest, ArkVale
and InfiniGen read 64 vectors per step"):
- rcr / fixed / rcr_layer: 160·r vector reads (128 candidate keys + 32 values when the layer refreshes, r the
  refresh fraction); detector Np·rank/d dot products (Np/16 at d=128, rank 8).
- quest / arkvale / infinigen: 64 vectors (32 keys + 32 values); summaries of 2 vectors per page (Np/8) for
  Quest/ArkVale, Np/4 partial keys for InfiniGen. ArkVale's own recalls into its page cache are printed apart.
- exact: Np keys + 32 values. refreshkv: 2·Np·r (every prefix key and value at a full step, r the fraction of
  full steps). bacon / prefill_oracle / full: 0.
- Offload bytes per step (all layers and KV heads): L'·Hkv·160·r·d·s, L' the re-selected layers (r is over
  them), s = bytes per element.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

import rcr
from pipeline.schema import telemetry_summary
from pipeline.tasks import TASKS
from rcr.embedded import model_dir
from rcr.models import build_inputs, geometry

OFFLOAD = ["fixed", "rcr", "rcr_layer"]
EMBEDDED = str(model_dir())


def load_model(args):
    path = args.model or (EMBEDDED if os.path.isdir(EMBEDDED) else None)
    if path:
        model, proc = rcr.models.load(path, device="cpu", dtype=torch.float32)
        from pipeline.data.synthetic import render  # the embedded model was trained on the synthetic scenes

        def image(i):
            from PIL import Image

            return Image.fromarray(render("detailcaps", args.seed, i)[0][0])
        return path, model, proc, image
    from tests import tiny_models

    model, proc = tiny_models.qwen2_vl()
    proc.image_processor.size = {"shortest_edge": 56 * 56, "longest_edge": args.image_size ** 2}  # full-size images
    return ("tiny random Qwen2-VL (tests/tiny_models.py)", model, proc,
            lambda i: tiny_models.random_image(args.seed + i, args.image_size))


RCR = rcr.methods.RCR()  # the paper's detector, candidates and controller (the defaults)
Quest = rcr.methods.Quest()


def model_reads(m, np_: float, r: float, d: int) -> tuple[str, float, float, str]:
    """(formula, vectors per KV head per step, detector dots per query vector) of method ``m``'s cost model (its
    own knobs), and what the RCR paper charges it."""
    s, label = m.config.selected, m.name
    if label in ("rcr", "fixed", "rcr_layer"):
        return "160·r", (m.candidates + s) * r, np_ * m.rank / d, "160·r"
    if label in ("quest", "arkvale"):
        return "64", 2.0 * s, 2 * np.ceil(np_ / m.page_size), "64"
    if label == "infinigen":
        return "64", 2.0 * s, np_ * round(m.partial_ratio * d) / d, "64"
    if label == "exact":
        return "Np+32", np_ + s, 0.0, "prefix scan"
    if label == "refreshkv":  # a full step reads the layer's whole prefix, keys and values; r: its full steps
        return "2·Np·r", 2.0 * np_ * r, 0.0, "-"
    return "0", 0.0, 0.0, "-"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: the embedded model, else a tiny random Qwen2-VL)")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--image-size", type=int, default=896, help="for synthetic/random images (896: 1,024 tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default=",".join(rcr.METHODS))
    ap.add_argument("--infinigen-calibration",
                    help="directory from python -m rcr.calibrate_infinigen (default: calibrate offline here, on "
                         "4 held-out prompts of the same kind, and store it beside --json)")
    ap.add_argument("--per-sample-calibration", action="store_true",
                    help="InfiniGen calibrates each sample from its own prefill instead")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

    name, model, proc, image = load_model(args)
    geo = geometry(model)
    calib = args.infinigen_calibration
    if calib is None and not args.per_sample_calibration:  # offline, on prompts that are not evaluated
        import tempfile

        from rcr.calibrate_infinigen import calibrate
        from rcr.skewing import save_calibration

        base = os.path.dirname(os.path.abspath(args.json)) if args.json else tempfile.mkdtemp(prefix="rcr-bench-")
        calib = os.path.join(base, "infinigen_calibration")
        held_out = [build_inputs(proc, [TASKS["detailcaps"].prompt], [[image(1000 + i)]]) for i in range(4)]
        skews, cols, stats = calibrate(model, held_out, 0.25)
        save_calibration(calib, skews, cols, {"command": "python -m benchmarks.reads_per_step " + " ".join(
            sys.argv[1:] if argv is None else argv), "model": name, "prompts": "4 held-out images (index 1000+)",
            "prompt": TASKS["detailcaps"].prompt, **stats})
    cfg = rcr.RCRConfig()  # the paper's budget and defaults
    labels = [m for m in args.methods.split(",") if m]
    built = {m: rcr.parse_method(m, cfg) for m in labels}
    if calib is not None and "infinigen" in built:  # its offline calibration
        built["infinigen"] = rcr.methods.InfiniGen(config=cfg, calibration=calib)
    methods = list(built.values())
    elt = next(model.parameters()).element_size()
    rows: dict[str, list[dict]] = {m: [] for m in labels}
    off_rows: dict[str, list[dict]] = {m: [] for m in OFFLOAD if m in labels}
    t0 = time.perf_counter()
    for i in range(args.samples):
        inputs = build_inputs(proc, [TASKS["detailcaps"].prompt], [[image(i)]])
        res = rcr.generate(model, inputs, method=methods, max_new_tokens=args.max_new_tokens, config=cfg,
                           ignore_eos=True)
        off = rcr.generate(model, inputs, method=list(off_rows), max_new_tokens=args.max_new_tokens,
                           config=cfg.replace(offload=True), ignore_eos=True) if off_rows else {}
        for m in labels:
            s = telemetry_summary(res[m].sample(0))
            rows[m].append(dict(np_=int(res[m].prefix_len[0]), r=s["refresh_fraction"], k=s["keys_read_per_step"],
                                v=s["values_read_per_step"], dots=s["detector_dots_per_step"],
                                recalled=np.nan if s["recalled_per_step"] is None else s["recalled_per_step"],
                                match=float((res[m].sequences == res["full"].sequences).float().mean())
                                if "full" in res else float("nan")))
        for m in off_rows:
            s = telemetry_summary(off[m].sample(0))
            assert torch.equal(off[m].sequences, res[m].sequences), f"{m}: offload output != resident output"
            layers = int((~np.isnan(off[m].telemetry.trigger[0]).all(-1)).sum())  # re-selected layers
            off_rows[m].append(dict(r=s["refresh_fraction"], bytes=s["bytes_moved_per_step"], layers=layers))
    wall = time.perf_counter() - t0

    np_mean = float(np.mean([r["np_"] for r in rows[labels[0]]]))
    print(f"model: {name}  ({geo.n_layers} layers, {geo.n_q_heads} q / {geo.n_kv_heads} KV heads, d={geo.head_dim}, "
          f"{elt}-byte elements)")
    print(f"InfiniGen calibration: {calib or 'per sample, from its own prefill'}")
    print(f"samples: {args.samples} x {args.max_new_tokens} new tokens, prefix Np = {np_mean:.0f} entries per KV head; "
          f"budget {cfg.selected} selected + {cfg.window} window, {RCR.candidates} candidates, rank {RCR.rank}, "
          f"page {Quest.page_size}; wall {wall:.0f} s")
    print()
    print("Prefix reads per KV head per re-selected layer-step (keys + values), measured vs cost model and the RCR "
          "paper; ArkVale's own recalls apart")
    hdr = (f"{'method':<15}{'r':>7}{'keys':>9}{'values':>9}{'total':>9}   {'model':<7}{'= vectors':>10}"
           f"{'paper':>13}{'recalled':>10}{'dots meas.':>12}{'dots model':>12}{'= x Np':>9}{'tok match':>11}")
    print(hdr)
    print("-" * len(hdr))
    out = {"model": name, "geometry": vars(geo), "np": np_mean, "config": cfg.to_dict(), "methods": {},
           "offload": {}}
    for m in labels:
        rr = rows[m]
        r = float(np.mean([x["r"] for x in rr]))
        k = float(np.mean([x["k"] for x in rr]))
        v = float(np.mean([x["v"] for x in rr]))
        dots = float(np.mean([x["dots"] for x in rr]))
        recalled = float(np.mean([x["recalled"] for x in rr]))
        match = float(np.mean([x["match"] for x in rr]))
        formula, vec, dmodel, paper = model_reads(built[m], np_mean, r, geo.head_dim)
        own = "-" if np.isnan(recalled) else f"{recalled:.1f}"
        print(f"{m:<15}{r:>7.3f}{k:>9.1f}{v:>9.1f}{k + v:>9.1f}   {formula:<7}{vec:>10.1f}{paper:>13}{own:>10}"
              f"{dots:>12.1f}{dmodel:>12.1f}{(dots / np_mean if np_mean else 0):>9.3f}{match:>11.2f}")
        out["methods"][m] = dict(refresh_fraction=r, keys=k, values=v, model=formula, model_vectors=vec,
                                 paper=paper, recalled=None if np.isnan(recalled) else recalled,
                                 detector_dots=dots, detector_dots_model=dmodel, token_match_vs_full=match)
    if off_rows:
        print()
        print("Offload mode: host-to-device bytes per decode step (all layers and KV heads); outputs equal resident")
        hdr = f"{'method':<15}{'r':>7}{'bytes/step':>13}{'160·r model':>13}{'ratio':>7}{'at r=rho':>11}"
        print(hdr)
        print("-" * len(hdr))
        n_sel = max(x["layers"] for rr in off_rows.values() for x in rr)
        per_r = n_sel * geo.n_kv_heads * (RCR.candidates + cfg.selected) * geo.head_dim * elt
        for m, rr in off_rows.items():
            r = float(np.mean([x["r"] for x in rr]))
            b = float(np.mean([x["bytes"] for x in rr]))
            model_b = per_r * r
            print(f"{m:<15}{r:>7.3f}{b:>13.0f}{model_b:>13.0f}{(b / model_b if model_b else float('nan')):>7.3f}"
                  f"{per_r * RCR.rho:>11.0f}")
            out["offload"][m] = dict(refresh_fraction=r, bytes_per_step=b, model_bytes=model_b,
                                     model_bytes_at_rho=per_r * RCR.rho)
        print(f"(model: L'·Hkv·160·r·d·s = {n_sel}·{geo.n_kv_heads}·160·r·{geo.head_dim}·{elt} bytes, L' the "
              f"re-selected layers of {geo.n_layers})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
