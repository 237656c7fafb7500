"""Decode cost of full, bacon, exact, rcr and quest, measured side by side in one run, against the cost model's floor.

Two modes:

``--mode layer`` (default): one decoder layer's decode step at the Qwen2-VL-7B attention geometry (28 query
heads, 4 KV heads, head dim 128). For each prefix length, one layer's prefix store is filled with random
post-RoPE keys/values and the real decode machinery (ResidentLayer + DecodeSession: decide, merge, attention over
resident slots) is timed one layer-step at a time, in thread CPU time (what the step itself spends, stable on a
loaded machine) and in wall time. ``full(gqa)`` is the attention path before the one-token fast path (SDPA with
``enable_gqa=True`` over the Hkv heads), kept here for the comparison.

Each step is held to its floor, measured in the same run: the machine's read bandwidth (a sum over 256 MB) and
fp32 GEMM rate (1024 x 1024 matmul), in the same clock as the steps, at the same thread count. A method's floor is
the larger of its bytes over the bandwidth and its dot products over the GEMM rate, per layer-step, from what its
telemetry counts at that step: attention over the n resident slots (n keys and n values read, 2 n d multiply-adds
per query head), the device-resident summary (``detector dots``, in key equivalents: rcr's rank-8 projected keys,
Quest's page bounds) and the prefix keys and values read (rcr: 160 r, exact: Np + 32, quest: 64), each key dotted
with the KV head's G query heads. The exponentials and the top-k are not in the model.

The settle steps come first, untimed and the same for every method: the rate controller starts at tau0, far below
the drift of random keys, and takes about 100 layer-steps to reach its steady state (refreshing about rho of the
steps). They also append a generated token per step, so the caches hold S + W + settle slots when timing starts
(32 + 32 + 150 = 214 by default, every method the same number of generated entries) and S + W + settle + steps when
it ends; the floor takes each step's own resident size. ``full``'s resident slots are the whole prefix plus the same.

Methods are interleaved round-robin in an order shuffled every round, and the ratios (to the floor, ``x full``,
``x bacon``, and the closing rcr / bacon and rcr / full) are of medians measured in the same run, so they share the
machine's noise. Torch runs on 1 thread unless ``--threads`` says otherwise; the load average is printed. On CPU,
``rcr(torch)`` is rcr with ``fused_kernel=False`` (rcr/fused.py).

``--mode model``: decode tokens/s of whole models from one prefill (prefix store), every method decoding the
same number of tokens: the embedded model (``rcr.embedded.model_dir()``) on a synthetic detailcaps scene, and a
few random-weight layers of the 7B geometry (hidden 3584, MLP 18944) on a random prefix store of Np entries.

    python benchmarks/decode_cost.py                            # layer mode: 1k, 4k, 16k on CPU (fp32)
    python benchmarks/decode_cost.py --compile default          # the same, each layer-step one compiled region
    python benchmarks/decode_cost.py --mode model               # tokens/s: embedded model, 7B-geometry stack
    python benchmarks/decode_cost.py --device cuda              # bf16 on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

import rcr
from rcr import RCRConfig
from rcr.cache import PrefixLayer, PrefixStore
from rcr.embedded import model_dir
from rcr.generate import DecodeSession, build_cache, compile_options
from rcr.methods import RCR, parse_method
from rcr.telemetry import Telemetry

HQ, HKV, D = 28, 4, 128  # Qwen2-VL-7B attention
HIDDEN, MLP = 3584, 18944  # Qwen2-VL-7B text layer
LAYER_METHODS = ["full(gqa)", "full", "bacon", "exact", "rcr", "rcr(torch)", "quest"]
MODEL_METHODS = ["full", "bacon", "exact", "rcr", "rcr(torch)", "quest"]
# variants timed next to the method they belong to (run whenever it is): the attention before the one-token fast
# path, and rcr with its detector pass as composed torch ops instead of the fused CPU kernel (rcr/fused.py)
VARIANTS = {"full(gqa)": ("full", {}), "rcr(torch)": ("rcr", {"fused_kernel": False})}


def selected_methods(candidates: list[str], wanted: list[str], device) -> list[str]:
    """The methods of ``wanted`` with their variants, in table order; the kernel exists only on CPU."""
    return [m for m in candidates if VARIANTS.get(m, (m,))[0] in wanted
            and not (m == "rcr(torch)" and device.type != "cpu")]


def shuffled(methods: list[str], i: int) -> list[str]:
    """The order of round ``i``, a fixed shuffle per round: which method runs right before which changes from round
    to round, because a step runs slower right after another method's step has evicted its data from the caches
    (at 1k, rcr's layer-step took 0.3-0.5 ms longer right after ``bacon``'s, whichever rcr variant ran there)."""
    order = list(methods)
    random.Random(i).shuffle(order)
    return order


def method_for(label: str, cfg: RCRConfig):
    base, changes = VARIANTS.get(label, (label, {}))
    return parse_method(base, cfg.replace(**changes))


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return (f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs; "
            f"torch threads {torch.get_num_threads()}")


class Clock:
    """Thread CPU time and wall time of one call; on a GPU only wall time (after a synchronisation) means anything."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.sync = (lambda: torch.cuda.synchronize(device)) if self.cuda else (lambda: None)

    def __call__(self, fn, *args) -> tuple[float, float]:
        self.sync()
        c0, w0 = time.thread_time(), time.perf_counter()
        fn(*args)
        self.sync()
        wall = time.perf_counter() - w0
        return (wall if self.cuda else time.thread_time() - c0), wall


def machine(clock: Clock, device, dtype) -> dict:
    """Read bandwidth (bytes/s: a sum over 256 MB, beyond every cache) and GEMM rate (FLOP/s: fp32 1024 x 1024
    matmul, or the dtype's on a GPU), the best of 5, in CPU time and in wall time."""
    x = torch.ones(64 * 2 ** 20, device=device)
    a = torch.randn(1024, 1024, device=device, dtype=dtype if clock.cuda else torch.float32)
    bw = [clock(torch.sum, x) for _ in range(5)]
    mm = [clock(torch.mm, a, a) for _ in range(5)]
    work = (("bw", x.numel() * 4, bw), ("gemm", 2 * 1024 ** 3, mm))  # bytes read, FLOPs
    out = {f"{k}_{c}": v / min(t[i] for t in ts) for k, v, ts in work for i, c in enumerate(("cpu", "wall"))}
    print(f"machine: read {out['bw_cpu'] / 1e9:.1f} GB/s, GEMM {out['gemm_cpu'] / 1e9:.0f} GFLOP/s in CPU time; "
          f"{out['bw_wall'] / 1e9:.1f} GB/s, {out['gemm_wall'] / 1e9:.0f} GFLOP/s in wall time", flush=True)
    return out


def floor_s(rates: dict, clock: str, n_slots: float, keys_read: float, values_read: float, summary: float,
            elt: int) -> float:
    """Seconds of one layer-step at the machine's rates: attention over n_slots resident slots, the summary (key
    equivalents, fp32) and the prefix keys and values read, per KV head; every key dotted with the G query heads."""
    keys = 2 * n_slots + keys_read  # resident keys and values, read prefix keys
    nbytes = HKV * D * (elt * (keys + values_read) + 4 * summary)
    flops = 2 * HQ * D * (keys + summary)
    return max(nbytes / rates[f"bw_{clock}"], flops / rates[f"gemm_{clock}"])


def random_prefix(n_layers: int, n_prompt: int, cfg: RCRConfig, device, dtype, vocab: int = 8,
                  seed: int = 0) -> PrefixStore:
    """A prefix store of random post-RoPE keys/values at the 7B attention geometry, batch 1, no padding."""
    g = torch.Generator(device="cpu").manual_seed(seed + n_prompt)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    layers = [PrefixLayer(rnd(1, HKV, n_prompt, D), rnd(1, HKV, n_prompt, D), rnd(1, HQ, cfg.window, D))
              for _ in range(n_layers)]
    return PrefixStore(layers=layers, valid=torch.ones(1, n_prompt, dtype=torch.bool, device=device),
                       next_position=torch.tensor([n_prompt], device=device),
                       first_logits=torch.randn(1, vocab, generator=g).to(device), window=cfg.window,
                       scaling=D ** -0.5, n_kv_heads=HKV, n_q_heads=HQ, head_dim=D)


def attend_gqa(query, keys, values, scaling):
    """The one-token decode attention before the fast path: SDPA with enable_gqa over (B, Hq, 1, d)."""
    out = F.scaled_dot_product_attention(query, keys, values, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


class LayerStep:
    """One decoder layer's decode step for one method: append the new token's K/V, then the attention hook.

    With ``compile`` (an ``RCRConfig.compile`` value) the resident layer is the static-shape buffer of a compiled decode
    (``RCRConfig.compile``) and the whole layer-step, append, decision, merge and attention, is one
    ``torch.compile(fullgraph=True)`` region, so Inductor can fuse the decision's passes over the detector logits.
    """

    def __init__(self, label: str, prefix: PrefixStore, cfg: RCRConfig, steps: int, compile: str | None = None):
        self.gqa = label == "full(gqa)"
        self.static = compile is not None and not self.gqa  # full(gqa) is the eager reference
        self.method = method_for(label, cfg)
        self.cache = build_cache(self.method, prefix, steps + 8, static=self.static)
        self.tel = Telemetry(1, 1, steps + 8, prefix.valid.device, False, False)
        self.session = DecodeSession(self.method, prefix, self.cache, self.method.init_state(prefix), self.tel,
                                     masked=self.static)
        self.module = SimpleNamespace(layer_idx=0)
        self.prefix = prefix
        self.t = 0
        self.step = self._step
        if self.static:
            self.session.step = torch.zeros(1, dtype=torch.long, device=prefix.valid.device)
            self.step = torch.compile(self._step, fullgraph=True, **compile_options(compile))

    def _step(self, q, k, v):
        keys, values = self.cache.layers[0].update(k, v)
        if self.gqa:
            return attend_gqa(q, keys, values, self.prefix.scaling)
        return self.session(self.module, q, keys, values, None, scaling=self.prefix.scaling)[0]

    def __call__(self, q, k, v):
        if self.static:
            self.session.step.fill_(self.t)
            self.step(q, k, v)
            self.cache.layers[0].advance(1)  # the host-side counters, outside the compiled region
        else:
            self.session.step = self.t
            self.step(q, k, v)
        self.t += 1


def layer_mode(args, device, dtype, sync) -> None:
    cfg = RCRConfig(compile=args.compile)  # checks the --compile value, as model mode does
    methods = selected_methods(LAYER_METHODS, args.methods, device)
    clock = Clock(device)
    rates = machine(clock, device, dtype)
    print(f"layer mode: {HQ} q heads, {HKV} KV heads, head dim {D}; device {device}, {dtype}; selected "
          f"{cfg.selected} + window {cfg.window}, candidates {RCR().candidates}, rank {RCR().rank}; "
          f"{args.settle} settle + {args.steps} timed layer-steps per method" +
          (f"; every method but full(gqa) compiled whole (mode {args.compile})" if args.compile else ""))
    print(f"{'Np':>6} {'method':>10} {'cpu us':>8} {'wall us':>8} {'floor us':>8} {'x floor':>7} {'x full':>6} "
          f"{'x bacon':>7} {'slots':>6} {'r':>5} {'reads':>6} {'model 160r':>10} {'dots':>6} {'Np/16':>6}")
    elt = torch.tensor([], dtype=dtype).element_size()
    for n in args.lengths:
        prefix = random_prefix(1, n + cfg.window, cfg, device, dtype)
        np_ = prefix.n_prefix
        total = args.settle + args.steps
        runners = {m: LayerStep(m, prefix, cfg, total, cfg.compile) for m in methods}
        cpu, wall, slots = ({m: [] for m in methods} for _ in range(3))
        g = torch.Generator(device="cpu").manual_seed(0)
        with torch.no_grad():
            for i in range(total):
                q, k, v = (torch.randn(1, h, 1, D, generator=g).to(device, dtype) for h in (HQ, HKV, HKV))
                for m in shuffled(methods, i):  # interleaved: same inputs, same moment, same number of steps
                    c, w = clock(runners[m], q, k, v)
                    if i >= args.settle:
                        cpu[m].append(c)
                        wall[m].append(w)
                        slots[m].append(runners[m].cache.layers[0].n_stored)  # after the step's own token
        med = {m: statistics.median(cpu[m]) for m in methods}
        for m in methods:
            tel, s = runners[m].tel, slice(args.settle, total)
            r = float(tel.trigger[0, 0, s].mean())
            keys, vals = float(tel.keys_read[0, 0, s].mean()), float(tel.values_read[0, 0, s].mean())
            dots = float(tel.detector_dots[0, 0, s].mean())
            n_slots = statistics.mean(slots[m])
            floor = floor_s(rates, "wall" if clock.cuda else "cpu", n_slots, keys, vals, dots, elt)
            model = f"{160 * r:.1f}" if m.startswith("rcr") else "-"
            xb = f"{med[m] / med['bacon']:7.2f}" if "bacon" in med else f"{'-':>7}"
            print(f"{np_:>6} {m:>10} {med[m] * 1e6:>8.0f} {statistics.median(wall[m]) * 1e6:>8.0f} {floor * 1e6:>8.0f} "
                  f"{med[m] / floor:>7.2f} {med[m] / med['full']:>6.3f} {xb} {n_slots:>6.0f} {r:>5.2f} "
                  f"{keys + vals:>6.1f} {model:>10} {dots:>6.0f} {np_ / 16:>6.0f}", flush=True)
        ratios = [f"{a} / {b} = {med[a] / med[b]:.3f}" for a, b in (("rcr", "bacon"), ("rcr", "full"),
                                                                     ("full", "full(gqa)")) if a in med and b in med]
        if ratios:
            print(f"{np_:>6} in CPU time: " + "; ".join(ratios), flush=True)


# ---------------------------------------------------------------------------------------------- model mode

def embedded_model(args, device, dtype):
    from PIL import Image

    from pipeline.data import synthetic as S
    from pipeline.tasks import TASKS

    model, processor = rcr.models.load(args.model, device=device, dtype=dtype)
    frames, _ = S.render("detailcaps", S.HELDOUT_SEED, 0)
    inputs = rcr.models.build_inputs(processor, [TASKS["detailcaps"].prompt], [[Image.fromarray(frames[0])]])
    return model, inputs


def stack_7b(n_layers: int, vocab: int, device, dtype):
    """A Qwen2-VL of ``n_layers`` random-weight text layers at the 7B geometry (tiny vision tower, small vocab)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    cfg = Qwen2VLConfig(
        text_config=dict(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=n_layers,
                         num_attention_heads=HQ, num_key_value_heads=HKV, vocab_size=vocab,
                         max_position_embeddings=65536, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24])),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=HIDDEN, num_heads=2, in_channels=3, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(cfg).to(device, dtype).eval()
    return model


def time_methods(model, prefix, methods, cfg, n_tokens, rounds, settle, sync) -> dict[str, float]:
    """Median tokens/s per method over ``rounds`` interleaved stretches of ``n_tokens`` decode steps. Each method
    has one decoder from the same prefix store, and first runs ``settle`` untimed steps (tau settles; a compiled
    decode compiles and, with CUDA graphs, records)."""
    decs = {m: rcr.Decoder(model, prefix, method_for(m, cfg), settle + rounds * n_tokens + 1, eos_token_id=[])
            for m in methods}
    tps = {m: [] for m in methods}
    with torch.no_grad(), contextlib.ExitStack() as stack:
        for m in methods:
            stack.enter_context(decs[m].enabled())
            for _ in range(settle):
                decs[m].step()
        for r in range(rounds):
            for m in shuffled(methods, r):  # interleaved: every method sees the machine at about the same moment
                sync()
                t0 = time.perf_counter()
                for _ in range(n_tokens):
                    decs[m].step()
                sync()
                tps[m].append(n_tokens / (time.perf_counter() - t0))
    return {m: statistics.median(v) for m, v in tps.items()}


def print_tps(name: str, tps: dict[str, float]) -> None:
    for m, v in tps.items():
        print(f"{name:<28} {m:>10} {v:>9.1f} {v / tps['full']:>7.2f}", flush=True)


def model_mode(args, device, dtype, sync) -> None:
    cfg = RCRConfig(**({"compile": args.compile} if args.compile else {}))
    methods = selected_methods(MODEL_METHODS, args.methods, device)
    print(f"model mode: device {device}, {dtype}; median of {args.rounds} interleaved stretches of {args.tokens} "
          f"decode steps per method, after {args.settle} untimed steps" +
          (f"; compile={args.compile}" if args.compile else ""))
    print(f"{'model':<28} {'method':>10} {'tokens/s':>9} {'x full':>7}")
    if "embedded" in args.models:
        model, inputs = embedded_model(args, device, dtype)
        with torch.no_grad():
            prefix = rcr.prefill(model, inputs, cfg)
        name = f"embedded (Np={prefix.n_prefix})"
        print_tps(name, time_methods(model, prefix, methods, cfg, args.tokens, args.rounds, args.settle, sync))
    if "7b" in args.models:
        vocab = 1024
        model = stack_7b(args.stack_layers, vocab, device, dtype)
        for n in args.lengths:
            prefix = random_prefix(args.stack_layers, n + cfg.window, cfg, device, dtype, vocab=vocab)
            name = f"7B x{args.stack_layers} layers (Np={prefix.n_prefix})"
            print_tps(name, time_methods(model, prefix, methods, cfg, args.tokens, args.rounds, args.settle, sync))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["layer", "model"], default="layer")
    ap.add_argument("--lengths", type=int, nargs="+", default=None,
                    help="prefix lengths Np (default: 1024 4096 16384 in layer mode, 1024 16384 in model mode)")
    ap.add_argument("--methods", default=",".join(m for m in MODEL_METHODS if m not in VARIANTS),
                    help="comma-separated; full is always included, and each method's variants with it")
    ap.add_argument("--steps", type=int, default=40, help="layer mode: timed layer-steps per method and length")
    ap.add_argument("--settle", type=int, default=None,
                    help="untimed steps every method runs first, so tau reaches its steady state "
                         "(default: 150 layer-steps in layer mode, 8 tokens in model mode)")
    ap.add_argument("--tokens", type=int, default=32, help="model mode: decode steps per timed stretch")
    ap.add_argument("--rounds", type=int, default=3, help="model mode: interleaved timed stretches per method")
    ap.add_argument("--models", default="embedded,7b", help="model mode: comma-separated of embedded, 7b")
    ap.add_argument("--model", default=str(model_dir()))
    ap.add_argument("--stack-layers", type=int, default=2, help="model mode: layers of the 7B-geometry stack")
    ap.add_argument("--compile", default=None,
                    help="an RCRConfig.compile value (default, reduce-overhead, eager, ...): model mode sets it for "
                         "every method; layer mode compiles each method's whole layer-step (not full(gqa))")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args()
    args.methods = sorted({"full", *args.methods.split(",")})
    args.models = args.models.split(",")
    if args.lengths is None:
        args.lengths = [1024, 4096, 16384] if args.mode == "layer" else [1024, 16384]
    if args.settle is None:
        args.settle = 150 if args.mode == "layer" else 8
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    print(load_line())
    (layer_mode if args.mode == "layer" else model_mode)(args, device, dtype, sync)
    print(load_line())


if __name__ == "__main__":
    main()
