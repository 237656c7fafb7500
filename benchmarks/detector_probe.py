"""What RCR's rank-r detector keeps of the entries a step reads: the candidate pass, measured on real answer steps.

RCR re-selects from the detector's top-``candidates`` prefix entries (kept and evicted alike; docs/algorithms.md,
"rcr"), re-scored exactly. An entry the rank-r basis does not represent can score low under the detector however
much the step reads it, and then it is never a candidate: a refresh evicts it, and since its approximate logit stays
low the drift does not see it missing. This probe measures that, per layer and KV head, on the greedy answers of a
few held-out synthetic samples.

The model writes its answer; ``rcr.generate.prefill`` over prompt + answer, with the window widened by the answer's
length, then gives the prefix region's post-RoPE keys and every answer step's post-RoPE query, exactly what a
decode sees. Per answer step, ranking as the methods do (``head_reduction``):

* ``recall``: the exact prefix mass of the best ``--selected`` entries chosen from the detector's candidates, as a
  share of the best ``--selected`` chosen from the whole prefix (1.0: the candidate pass loses nothing);
* ``top``: the prefix entry with the most exact mass over the answer (mean over its query heads and steps), its
  ``mass`` and key norm against the median prefix key (``|k|/med``);
* ``in-basis``: the share of that key's norm inside the rank-r basis;
* ``cand``: the share of answer steps on which it is among the candidates.

    python benchmarks/detector_probe.py                       # the embedded model, 3 detailcaps samples
    python benchmarks/detector_probe.py --model DIR --candidates 310   # every entry a candidate: recall 1
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import BatchFeature

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.attention_profile import held_out_answers, sample_args  # noqa: E402
from rcr.config import RCRConfig  # noqa: E402
from rcr.detector import Detector  # noqa: E402
from rcr.generate import prefill  # noqa: E402
from rcr.models import geometry, load, with_answer  # noqa: E402
from rcr.scoring import reduce_heads, top_sorted  # noqa: E402


def head_figures(q: torch.Tensor, k: torch.Tensor, det: Detector, h: int, cfg: RCRConfig, scaling: float) -> dict:
    """q (G, T, d) one KV head's answer queries, k (Np, d) its prefix keys; det the layer's detector (batch 1)."""
    G, T, _ = q.shape
    n = k.shape[0]
    exact_lg = torch.einsum("gtd,nd->tgn", q, k) * scaling  # (T, G, Np)
    approx_lg = torch.einsum("gtr,rn->tgn", q @ det.basis[0, h], det.projected_t[0, h]) * scaling
    valid = torch.ones(1, 1, n, dtype=torch.bool)  # (B, Hkv, Np) with the T steps as the batch: no padding
    exact = reduce_heads(exact_lg.unsqueeze(0), valid, cfg.head_reduction)[0]  # (T, Np)
    approx = reduce_heads(approx_lg.unsqueeze(0), valid, cfg.head_reduction)[0]
    mass = torch.softmax(exact_lg, -1).mean(1)  # (T, Np): the exact prefix mass, mean over the G query heads
    s, c = min(cfg.selected, n), min(cfg.candidates, n)
    best = torch.gather(mass, 1, top_sorted(exact.unsqueeze(0), s)[0]).sum(-1)  # (T,)
    cand = top_sorted(approx.unsqueeze(0), c)[0]  # (T, C)
    from_cand = torch.gather(cand, 1, top_sorted(torch.gather(exact, 1, cand).unsqueeze(0), s)[0])
    kept = torch.gather(mass, 1, from_cand).sum(-1)
    top = int(mass.mean(0).argmax())
    norms = k.norm(dim=-1)
    return {"recall": float((kept / best).mean()), "top": top, "mass": float(mass[:, top].mean()),
            "norm": float(norms[top] / norms.median()),
            "in_basis": float((k[top] @ det.basis[0, h]).norm() / norms[top]),
            "cand": float((cand == top).any(-1).float().mean())}


def probe(model, processor, cfg: RCRConfig, task: str, layout: str, n: int, max_new_tokens: int) -> list[list[dict]]:
    """Per layer, per KV head, the figures of ``head_figures`` averaged over samples (``top`` from the first)."""
    geo = geometry(model)
    G = geo.n_q_heads // geo.n_kv_heads
    rows: list[list[list[dict]]] = []
    for _, inputs, answer in held_out_answers(model, processor, task, layout, n, max_new_tokens):
        with torch.no_grad():
            # prompt + answer, with the window widened by the answer: the prefix region is the decode's (the prompt
            # less its last ``cfg.window`` tokens) and the window's last T queries are the answer steps'
            T = answer.shape[1]
            p = prefill(model, BatchFeature(with_answer(inputs, answer)), RCRConfig(window=cfg.window + T))
        per_layer = []
        for layer in range(geo.n_layers):
            k = p.prefix_kv(layer)[0].float()  # (1, Hkv, Np, d): the prefix region's keys
            q = p.layers[layer].window_queries.float()[0, :, -T:]  # (Hq, T, d): the answer steps' queries
            det = Detector.build(k, p.prefix_valid, cfg.rank)
            per_layer.append([head_figures(q[h * G:(h + 1) * G], k[0, h], det, h, cfg, p.scaling)
                              for h in range(geo.n_kv_heads)])
        rows.append(per_layer)
    out = []
    for layer in range(len(rows[0])):
        heads = []
        for h in range(len(rows[0][layer])):
            xs = [r[layer][h] for r in rows]
            heads.append({key: (xs[0][key] if key == "top" else float(np.mean([x[key] for x in xs])))
                          for key in xs[0]})
        out.append(heads)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sample_args(ap, n=3)
    ap.add_argument("--selected", type=int, default=RCRConfig.selected)
    ap.add_argument("--candidates", type=int, default=RCRConfig.candidates)
    ap.add_argument("--rank", type=int, default=RCRConfig.rank, help="the detector's rank")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = RCRConfig(selected=args.selected, candidates=args.candidates, rank=args.rank)
    model, processor = load(args.model)
    geo = geometry(model)
    cfg.check_model(geo.head_dim)
    layers = probe(model, processor, cfg, args.task, args.layout, args.n, args.max_new_tokens)
    print(f"{args.model} | {args.task}, layout {args.layout}, {args.n} held-out samples | rank {cfg.rank}, "
          f"{cfg.candidates} candidates, {cfg.selected} selected | load average {os.getloadavg()[0]:.2f}")
    print(f"{'layer':>5} {'kv':>3} {'recall':>7} {'top':>5} {'mass':>6} {'|k|/med':>8} {'in-basis':>9} {'cand':>6}")
    for i, heads in enumerate(layers):
        if geo.sliding_windows[i] is not None:
            continue  # a local layer keeps its window; no method re-selects it
        for h, r in enumerate(heads):
            print(f"{i:>5} {h:>3} {r['recall']:7.3f} {r['top']:>5} {r['mass']:6.3f} {r['norm']:8.1f} "
                  f"{r['in_basis']:9.2f} {r['cand']:6.2f}")


if __name__ == "__main__":
    main()
