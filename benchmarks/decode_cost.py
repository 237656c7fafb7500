"""Per-layer decode-step cost of full, bacon, exact and rcr at a real 7B attention geometry.

Qwen2-VL-7B attention: 28 query heads, 4 KV heads, head dim 128. For each prefix length, one layer's
prefix store is filled with random post-RoPE keys/values, and the real decode machinery (ResidentLayer +
DecodeSession: decide, masked merge, SDPA over resident slots) is timed one layer-step at a time. Methods
are interleaved round-robin in the same run, so the printed ratios to `full` share the machine's noise.

It also prints the counted reads per KV head per layer-step next to the paper's cost model:
about Np/16 detector dot products (rank 8 / head dim 128) + 160 * r vector reads for rcr, where r is the
realised refresh fraction.

    python benchmarks/decode_cost.py                  # 1k, 4k, 16k on CPU (fp32)
    python benchmarks/decode_cost.py --device cuda    # bf16 on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from rcr import RCRConfig
from rcr.cache import PrefixLayer, PrefixStore
from rcr.generate import DecodeSession, build_cache
from rcr.methods import parse_method
from rcr.telemetry import Telemetry

HQ, HKV, D = 28, 4, 128
METHODS = ["full", "bacon", "exact", "rcr"]


def make_prefix(n_prompt: int, cfg: RCRConfig, device, dtype) -> PrefixStore:
    g = torch.Generator(device="cpu").manual_seed(n_prompt)
    keys = torch.randn(1, HKV, n_prompt, D, generator=g).to(device, dtype)
    values = torch.randn(1, HKV, n_prompt, D, generator=g).to(device, dtype)
    qwin = torch.randn(1, HQ, cfg.window, D, generator=g).to(device, dtype)
    return PrefixStore(layers=[PrefixLayer(keys, values, qwin)], valid=torch.ones(1, n_prompt, dtype=torch.bool,
                       device=device), next_position=torch.tensor([n_prompt], device=device),
                       first_logits=torch.zeros(1, 8, device=device), window=cfg.window, scaling=D ** -0.5,
                       n_kv_heads=HKV, n_q_heads=HQ, head_dim=D)


class LayerStep:
    """One decoder layer's decode step for one method: append the new token's K/V, then the attention hook."""

    def __init__(self, label: str, prefix: PrefixStore, cfg: RCRConfig, steps: int):
        self.method = parse_method(label, cfg)
        self.cache = build_cache(self.method, prefix, steps + 8)
        self.tel = Telemetry(1, 1, steps + 8, prefix.valid.device, False, False)
        self.session = DecodeSession(self.method, prefix, self.cache, self.method.init_state(prefix), self.tel,
                                     masked=False)
        self.module = SimpleNamespace(layer_idx=0)
        self.prefix = prefix
        self.t = 0

    def __call__(self, q, k, v):
        self.session.step = self.t
        keys, values = self.cache.layers[0].update(k, v)
        self.session(self.module, q, keys, values, None, scaling=self.prefix.scaling)
        self.t += 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--steps", type=int, default=40, help="timed layer-steps per method and length")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--settle", type=int, default=150,
                    help="untimed rcr layer-steps first, so tau reaches its steady state (tau0=0.03 is far below "
                         "the drift of random keys)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = RCRConfig()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"geometry: {HQ} q heads, {HKV} KV heads, head dim {D}; device {device}, {dtype}; "
          f"selected {cfg.selected} + window {cfg.window}, candidates {cfg.candidates}, rank {cfg.rank}")
    print(f"{'Np':>7} {'method':>7} {'ms/layer-step':>14} {'x full':>7} {'refresh r':>9} "
          f"{'keys+vals read':>15} {'detector dots':>14} {'model: Np/16 + 160r':>20}")
    for n in args.lengths:
        prefix = make_prefix(n + cfg.window, cfg, device, dtype)
        np_ = prefix.n_prefix
        total = args.warmup + args.steps
        runners = {m: LayerStep(m, prefix, cfg, total + args.settle) for m in METHODS}
        times = {m: [] for m in METHODS}
        g = torch.Generator(device="cpu").manual_seed(0)
        with torch.no_grad():
            for _ in range(args.settle):
                q, k, v = (torch.randn(1, h, 1, D, generator=g).to(device, dtype) for h in (HQ, HKV, HKV))
                runners["rcr"](q, k, v)
            for i in range(total):
                q = torch.randn(1, HQ, 1, D, generator=g).to(device, dtype)
                k = torch.randn(1, HKV, 1, D, generator=g).to(device, dtype)
                v = torch.randn(1, HKV, 1, D, generator=g).to(device, dtype)
                for m in METHODS:  # interleaved: same inputs, same moment
                    sync()
                    t0 = time.perf_counter()
                    runners[m](q, k, v)
                    sync()
                    if i >= args.warmup:
                        times[m].append(time.perf_counter() - t0)
        base = statistics.median(times["full"])
        for m in METHODS:
            med = statistics.median(times[m])
            tel = runners[m].tel
            first = runners[m].t - args.steps  # the timed layer-steps
            s = slice(first, runners[m].t)
            r = float(tel.trigger[0, 0, s].mean())
            reads = float((tel.keys_read[0, 0, s] + tel.values_read[0, 0, s]).mean())
            dots = float(tel.detector_dots[0, 0, s].mean())
            model = f"{np_ / 16:.0f} + {160 * r:.1f}" if m == "rcr" else "-"
            print(f"{np_:>7} {m:>7} {med * 1e3:>14.3f} {med / base:>7.2f} {r:>9.2f} {reads:>15.1f} "
                  f"{dots:>14.1f} {model:>20}")


if __name__ == "__main__":
    main()
