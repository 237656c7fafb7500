"""The first real-size run, rehearsed: the published models' dimensions on real-resolution images.

    python -m benchmarks.real_size                          # build once, then measure every family (CPU)
    python -m benchmarks.real_size build [--root DIR]       # only write the model directories and the data
    python -m benchmarks.real_size bench --families qwen2_vl
    python -m benchmarks.real_size --device cuda            # benchmarks/gpu_check.sh's real_size step

``build`` writes, under ``--root`` (default ``$RCR_RUNS_DIR/real_size``), three model directories laid out as the Hub
lays them out (``benchmarks/real_size_models.py``: published config.json, random bf16 weights in sharded safetensors
with an index, the published preprocessor_config.json, a tokenizer and chat template with the family's special
tokens): Qwen2-VL-2B-Instruct and Qwen3-VL-2B-Instruct whole, and LLaVA-NeXT-Mistral-7B with its decoder cut to
``--llava-layers`` (on CPU 12 of 32, 6.4 GB of weights: an actor stays well within the ~14 GB one job may take on
the shared 24 GB machine beside the Ray head and driver, docs/models.md; the whole 32 on a GPU); and
``data/DetailCaps-4870/``, a DetailCaps-shaped copy (the published file's columns, read by a job's ``--dataset``) of
8 synthetic scenes at DetailCaps' resolutions.

``bench`` measures each family in its own process (one model in memory at a time; the process is one job actor:
the job's loader, dtype bf16, the job's image decoding and prompt, ``--threads`` torch threads as an actor on CPU):

- visual tokens per image (all 8 images, through the published processor), prefix length;
- prefill seconds and each method's decode ms per token, on the first ``--samples`` rows (the rows a job with
  ``--limit`` takes first), from one prefill per sample, methods in a shuffled order per sample; in thread CPU time
  (what the step spends, steady on a loaded machine) and wall time; ``rcr / full`` tokens/s in the same run;
- the floors, measured in the same run (``benchmarks/decode_cost.py``'s read bandwidth and GEMM rate, plus a bf16
  GEMM): decode reads the text weights and the KV store once per token, prefill does 2 FLOPs per weight per token;
- peak RSS (VmHWM) next to the weights' bytes, the prefix KV store's bytes and one layer's activations (the
  largest of a decoder layer over the prompt and a vision block over the patches, attention scores included),
  and their ratio;
- prefix reads per KV head per re-selected layer-step against the cost model (``benchmarks/reads_per_step.py``);
- the load average before and after. InfiniGen runs with an offline calibration made, as a job makes it, from a
  held-out row (the smallest row not measured) through ``InfiniGen.prepare``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.decode_cost import Clock, load_line, machine
from benchmarks.real_size_models import DIR_NAMES, FAMILIES, write_detailcaps, write_model_dir

METHODS = ["full", "bacon", "rcr", "quest", "infinigen"]
LLAVA_LAYERS = {"cpu": 12, "cuda": 32}  # see the module docstring


def default_root() -> Path:
    return Path(os.environ.get("RCR_RUNS_DIR", Path.home() / "rcr-runs")).expanduser() / "real_size"


def build(args) -> dict[str, Path]:
    root = Path(args.root)
    t0 = time.perf_counter()
    dirs = {}
    for fam in args.families:
        dirs[fam] = write_model_dir(root / "models", fam, args.device, args.llava_layers)
        print(f"[real_size] {fam}: {dirs[fam]}", flush=True)
    data = write_detailcaps(root / "data")
    print(f"[real_size] data: {data} (--dataset {data}); built in {time.perf_counter() - t0:.0f} s", flush=True)
    return dirs


# ------------------------------------------------------------------------------------------- one family
def param_bytes(params) -> int:
    """Bytes of distinct parameters (a tied lm_head counts once)."""
    return sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in params}.values())


def rss_peak() -> int:
    """This process's peak resident set (VmHWM), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def bf16_gemm_rate(clock: Clock, device) -> tuple[float, float]:
    """FLOP/s of a bf16 1024 x 1024 matmul (the model's dtype), best of 5, in CPU (GPU: wall) and wall time."""
    a = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)
    t = [clock(torch.mm, a, a) for _ in range(5)]
    return 2 * 1024 ** 3 / min(x[0] for x in t), 2 * 1024 ** 3 / min(x[1] for x in t)


def layer_activations(model, n_text: int, n_patches: int) -> int:
    """Bytes of one layer's activations at prefill, the larger of a decoder layer over ``n_text`` tokens and a
    vision block over ``n_patches`` patches: inputs, projections, MLP intermediates, and the attention scores
    (heads x n^2, as if materialised: an upper bound)."""
    t = model.config.get_text_config()
    elt = 2
    d = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    text = n_text * (4 * t.hidden_size + 3 * t.intermediate_size
                     + (t.num_attention_heads + 2 * t.num_key_value_heads) * d) * elt
    text += t.num_attention_heads * n_text ** 2 * 4
    v = model.config.vision_config
    width = getattr(v, "embed_dim", None) or v.hidden_size
    mlp = getattr(v, "intermediate_size", None) or width * getattr(v, "mlp_ratio", 4)
    heads = getattr(v, "num_heads", None) or v.num_attention_heads
    vision = n_patches * (6 * width + 2 * mlp) * elt + heads * n_patches ** 2 * elt
    return int(max(text, vision))


def n_patches(model, inputs) -> int:
    """Patches the vision tower runs over: Qwen's flattened patches, else LLaVA-NeXT's tiles x (336/14)^2 + CLS."""
    pv = inputs["pixel_values"]
    if pv.dim() == 2:
        return int(pv.shape[0])
    v = model.config.vision_config
    return int(pv.shape[-4] if pv.dim() == 5 else pv.shape[0]) * ((v.image_size // v.patch_size) ** 2 + 1)


def one(args) -> dict:
    """Measure one family (this process is one actor); returns the figures as a dict."""
    import rcr
    from benchmarks.reads_per_step import model_reads
    from pipeline.data.convert import parse_dataset
    from pipeline.data.images import load_sample_images
    from pipeline.schema import telemetry_summary
    from pipeline.tasks import TASKS
    from rcr.config import MAX_IMAGE_TOKENS
    from rcr.methods import parse_method
    from rcr.models import build_inputs, geometry, limit_image_tokens, load

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    clock = Clock(device)
    rates = machine(clock, device, torch.bfloat16)
    rates["bf16_cpu"], rates["bf16_wall"] = bf16_gemm_rate(clock, device)
    kind = "wall" if device.type == "cuda" else "cpu"
    t0 = time.perf_counter()
    model, proc = load(args.model, device=device, dtype=torch.bfloat16)
    load_s = time.perf_counter() - t0
    limit_image_tokens(proc, MAX_IMAGE_TOKENS)  # the job's --max-image-tokens default (docs/pipeline.md)
    geo = geometry(model)
    lm = model.model.language_model  # the text model: embed_tokens, layers, norm
    head = model.get_output_embeddings().weight
    weights = param_bytes(model.parameters())
    decoder = param_bytes([*lm.layers.parameters(), *lm.norm.parameters()])
    vision = weights - param_bytes([*lm.parameters(), head])  # the vision tower and projector
    step_bytes = decoder + head.numel() * head.element_size()  # what one decode step reads (the embedding: a row)
    task = TASKS["detailcaps"]
    records = list(parse_dataset(args.data, "detailcaps").records())
    limits = (64, 64 * 2**20, 50_000_000)  # the job's defaults (max_frames, max_image_bytes, max_image_pixels)
    image_id = getattr(model.config, "image_token_id", None) or model.config.image_token_index

    def inputs_of(rec):
        return build_inputs(proc, [task.prompt], [load_sample_images(rec["images"], "detailcaps", *limits)])

    visual = []
    for rec in records:
        img = load_sample_images(rec["images"], "detailcaps", *limits)[0]
        visual.append((f"{img.size[0]}x{img.size[1]}", int((inputs_of(rec)["input_ids"] == image_id).sum())))
    cfg = rcr.RCRConfig()
    methods = {m: parse_method(m, cfg) for m in args.methods}
    calib_s = 0.0
    if "infinigen" in methods:  # offline, as a job's actor does (InfiniGen.prepare on held-out rows): on the
        # smallest row not measured, to keep the two calibration passes short on a CPU
        held = min(range(args.samples, len(records)), key=lambda i: visual[i][1])
        t = time.perf_counter()
        with torch.inference_mode():
            methods["infinigen"].prepare(model, [inputs_of(records[held])], f"held-out row {held}")
        calib_s = time.perf_counter() - t
    samples = []
    for i, rec in enumerate(records[: args.samples]):
        inputs = inputs_of(rec)
        c0, w0 = time.thread_time(), time.perf_counter()
        with torch.inference_mode():
            prefix = rcr.prefill(model, inputs, cfg)
        clock.sync()
        pre = (time.thread_time() - c0, time.perf_counter() - w0)
        kv = sum(t.numel() * t.element_size() for layer in prefix.layers
                 for t in (layer.keys, layer.values, layer.window_queries))
        s = {"n": int(inputs["input_ids"].shape[1]), "np": prefix.n_prefix, "prefill_cpu": pre[0],
             "prefill_wall": pre[1], "kv_bytes": kv, "patches": n_patches(model, inputs), "methods": {}}
        order = list(methods)
        random.Random(i).shuffle(order)
        for m in order:
            c0, w0 = time.thread_time(), time.perf_counter()
            with torch.inference_mode():
                res = rcr.decode(model, prefix, methods[m], args.max_new_tokens, eos_token_id=[])
            clock.sync()
            steps = int(res.lengths[0])
            tel = telemetry_summary(res.sample(0))
            s["methods"][m] = {"ms_cpu": (time.thread_time() - c0) / steps * 1e3,
                               "ms_wall": (time.perf_counter() - w0) / steps * 1e3, "steps": steps,
                               "r": tel["refresh_fraction"], "reads": tel["keys_read_per_step"]
                               + tel["values_read_per_step"], "dots": tel["detector_dots_per_step"]}
        samples.append(s)
        print(f"[real_size] {args.family} row {i}: N={s['n']} prefill {pre[0]:.1f} s cpu / {pre[1]:.1f} s wall; "
              + "; ".join(f"{m} {v['ms_cpu']:.0f} ms" for m, v in s["methods"].items()), flush=True)
        del prefix
    np_ = float(np.mean([s["np"] for s in samples]))
    reads = {}
    for m in methods:
        r = float(np.nanmean([s["methods"][m]["r"] for s in samples]))
        formula, vec, _, _ = model_reads(methods[m], np_, r, geo.head_dim)
        reads[m] = {"measured": float(np.mean([s["methods"][m]["reads"] for s in samples])), "model": vec,
                    "formula": formula, "r": r}
    act = max(layer_activations(model, s["n"], s["patches"]) for s in samples)
    out = {"family": args.family, "model": args.model, "device": str(device), "threads": args.threads,
           "geometry": {"layers": geo.n_layers, "q_heads": geo.n_q_heads, "kv_heads": geo.n_kv_heads,
                        "head_dim": geo.head_dim}, "weights_bytes": weights, "step_bytes": step_bytes,
           "decoder_bytes": decoder, "vision_bytes": vision,
           "load_s": load_s, "calibration_s": calib_s, "visual_tokens": visual, "samples": samples, "reads": reads,
           "activations_bytes": act, "rss_peak": rss_peak(), "rates": rates, "kind": kind,
           "device_peak": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    return out


# ------------------------------------------------------------------------------------------- the table
def _gb(b: float) -> str:
    return f"{b / 1e9:.2f}"


def report(r: dict) -> list[str]:
    """The family's lines: figures, then one markdown table row for docs/models.md."""
    ss, kind = r["samples"], r["kind"]
    bw, gemm = r["rates"][f"bw_{kind}"], r["rates"][f"bf16_{kind}"]
    got = ss[0]["methods"]
    order = [m for m in METHODS if m in got] + [m for m in got if m not in METHODS]
    ms = {m: float(np.mean([s["methods"][m][f"ms_{kind}"] for s in ss])) for m in order}
    kv = max(s["kv_bytes"] for s in ss)
    floor_ms = (r["step_bytes"] + kv) / bw * 1e3  # a decode step reads the text weights and (full) the store
    prefill = float(np.mean([s[f"prefill_{kind}"] for s in ss]))
    # prefill: 2 FLOPs per weight per token (decoder) and per patch (vision tower), bf16 (2 bytes per weight)
    flops = float(np.mean([s["n"] * r["decoder_bytes"] + s["patches"] * r["vision_bytes"] for s in ss]))
    base = r["weights_bytes"] + kv + r["activations_bytes"]
    vis = [v for _, v in r["visual_tokens"]]
    g = r["geometry"]
    lines = [
        f"== {r['family']}: {g['layers']} layers, {g['q_heads']}:{g['kv_heads']} heads, d={g['head_dim']}; "
        f"{r['device']}, bf16, {r['threads']} thread(s); load {r['load_s']:.1f} s, InfiniGen calibration "
        f"{r['calibration_s']:.0f} s",
        "visual tokens per image: " + ", ".join(f"{k} {v}" for k, v in r["visual_tokens"]),
        f"prefix N = {', '.join(str(s['n']) for s in ss)} (Np {', '.join(str(s['np']) for s in ss)}); prefill "
        f"{prefill:.1f} s {kind} (floor {flops / gemm:.1f} s at {gemm / 1e9:.0f} GFLOP/s bf16)",
        "decode ms/token (" + kind + "): " + ", ".join(f"{m} {v:.0f}" for m, v in ms.items())
        + f"; floor {floor_ms:.0f} ms ({_gb(r['step_bytes'] + kv)} GB at {bw / 1e9:.1f} GB/s); "
        f"full x floor {ms['full'] / floor_ms:.2f}"
        + (f"; rcr / full tok/s {ms['full'] / ms['rcr']:.3f}" if "rcr" in ms else ""),
        f"memory: peak RSS {_gb(r['rss_peak'])} GB; weights {_gb(r['weights_bytes'])} GB + KV store {_gb(kv)} GB + "
        f"one layer's activations {_gb(r['activations_bytes'])} GB = {_gb(base)} GB; ratio {r['rss_peak'] / base:.2f}"
        + (f"; device peak {_gb(r['device_peak'])} GB" if r["device_peak"] else ""),
        "reads per KV head per layer-step, measured / cost model: " + ", ".join(
            f"{m} {v['measured']:.1f}/{v['model']:.1f} ({v['formula']}, r={v['r']:.2f})" for m, v in r["reads"].items()
            if v["formula"] != "0"),
    ]
    rr = r["reads"]
    row = (f"| {r['family']} | {min(vis)}-{max(vis)} | {', '.join(str(s['n']) for s in ss)} | {prefill:.0f} | "
           + " | ".join(f"{ms.get(m, float('nan')):.0f}" for m in METHODS)
           + f" | {ms['full'] / ms['rcr']:.2f} | {_gb(r['rss_peak'])} ({_gb(r['weights_bytes'])} + {_gb(kv)}) | "
           + ", ".join(f"{m} {rr[m]['measured']:.0f}/{rr[m]['model']:.0f}" for m in ("rcr", "quest", "infinigen")
                       if m in rr) + " |")
    return lines + ["table row: " + row]


def bench(args) -> int:
    root = Path(args.root)
    print(f"[real_size] {load_line()}", flush=True)
    t0 = time.perf_counter()
    results = []
    for fam in args.families:
        model = root / "models" / DIR_NAMES[fam]
        js = root / f"{fam}.json"
        cmd = [sys.executable, "-m", "benchmarks.real_size", "one", "--family", fam, "--model", str(model),
               "--data", str(root / "data" / "DetailCaps-4870"), "--json", str(js), "--device", args.device,
               "--samples", str(args.samples), "--max-new-tokens", str(args.max_new_tokens),
               "--threads", str(args.threads), "--methods", ",".join(args.methods)]
        t = time.perf_counter()
        rc = subprocess.run(cmd, check=False).returncode
        if rc != 0:
            print(f"[real_size] {fam}: FAILED (exit {rc})", flush=True)
            return rc
        results.append(json.loads(js.read_text()))
        print(f"[real_size] {fam}: {time.perf_counter() - t:.0f} s", flush=True)
    for r in results:
        print("\n".join(report(r)), flush=True)
    print(f"[real_size] bench wall {time.perf_counter() - t0:.0f} s; {load_line()}", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", default="all", choices=["all", "build", "bench", "one"])
    ap.add_argument("--root", default=None, help="where models and data go (default: $RCR_RUNS_DIR/real_size)")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--llava-layers", type=int, default=None, help="LLaVA-NeXT decoder layers (CPU 12, GPU 32)")
    ap.add_argument("--samples", type=int, default=1, help="rows measured (the first is 1024x768)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a job's actor on CPU: 1)")
    ap.add_argument("--family", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.root = args.root or str(default_root())
    args.families = [f for f in args.families.split(",") if f]
    args.methods = ["full", *[m for m in args.methods.split(",") if m and m != "full"]]
    if args.llava_layers is None:
        args.llava_layers = LLAVA_LAYERS[args.device]
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device is visible")
    if args.what == "one":
        Path(args.json).write_text(json.dumps(one(args)))
        return 0
    if args.what in ("all", "build"):
        build(args)
    return bench(args) if args.what in ("all", "bench") else 0


if __name__ == "__main__":
    raise SystemExit(main())
