"""What RCR's rank-r detector catches of the entries a step reads: the candidate pass, measured on real answer steps.

RCR re-selects from the top-``candidates`` prefix entries of the detector's logit vector (exact logits for the kept
entries, the rank-r approximation for the evicted ones; docs/algorithms.md, "rcr"), re-scored exactly. An entry
while evicted is seen only through the rank-r basis: one whose key the basis does not represent scores low however
much the step reads it, so it is never a candidate again, and the drift does not see it missing either. This
measures, per layer and KV head, what the detector alone catches, i.e. the candidate pass for entries that are
evicted, on the greedy answers of a few samples.

The model writes its answer; ``rcr.generate.prefill`` over prompt + answer, with the window widened by the answer's
length, then gives the prefix region's post-RoPE keys and every answer step's post-RoPE query, exactly what a
decode sees. Per answer step, ranking as the methods do (``head_reduction``):

* ``recall``: the exact prefix mass of the best ``selected`` entries chosen from the detector's top ``candidates``,
  as a share of the best ``selected`` chosen from the whole prefix (1.0: the candidate pass loses nothing);
* ``top``: the prefix entry with the most exact mass over the answer (mean over its query heads and steps), its
  ``mass`` and key norm against the median prefix key (``norm``): in most models the attention sink;
* ``in_basis``: the share of that key's norm inside the rank-r basis;
* ``cand``: the share of answer steps on which the detector alone would rank it among the candidates (whether a
  refresh could bring it back were it evicted).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import BatchFeature

from rcr.config import RCRConfig
from rcr.detector import Detector
from rcr.generate import prefill
from rcr.methods import RCR
from rcr.models import geometry, with_answer
from rcr.scoring import reduce_heads, top_sorted

from .attention import Answer, Done


def head_figures(q: torch.Tensor, k: torch.Tensor, det: Detector, h: int, method: RCR, scaling: float) -> dict:
    """q (G, T, d) one KV head's answer queries, k (Np, d) its prefix keys; det the layer's detector (batch 1)."""
    cfg = method.config
    G, T, _ = q.shape
    n = k.shape[0]
    exact_lg = torch.einsum("gtd,nd->tgn", q, k) * scaling  # (T, G, Np)
    approx_lg = torch.einsum("gtr,rn->tgn", q @ det.basis[0, h], det.projected_t[0, h]) * scaling
    valid = torch.ones(1, 1, n, dtype=torch.bool)  # (B, Hkv, Np) with the T steps as the batch: no padding
    exact = reduce_heads(exact_lg.unsqueeze(0), valid, cfg.head_reduction)[0]  # (T, Np)
    approx = reduce_heads(approx_lg.unsqueeze(0), valid, cfg.head_reduction)[0]
    mass = torch.softmax(exact_lg, -1).mean(1)  # (T, Np): the exact prefix mass, mean over the G query heads
    s, c = min(cfg.selected, n), min(method.candidates, n)
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


def probe(model, answers: list[Answer], method: RCR, done: Done | None = None) -> list[list[dict]]:
    """Per layer, per KV head, the figures of ``head_figures`` averaged over ``answers`` (``top`` from the first),
    for ``method``'s detector (its rank and candidates) at its budget."""
    cfg = method.config
    geo = geometry(model)
    G = geo.n_q_heads // geo.n_kv_heads
    rows: list[list[list[dict]]] = []
    for a in answers:
        inputs, answer = a.inputs, a.answer
        with torch.no_grad():
            # prompt + answer, with the window widened by the answer: the prefix region is the decode's (the prompt
            # less its last ``cfg.window`` tokens) and the window's last T queries are the answer steps'
            T = answer.shape[1]
            p = prefill(model, BatchFeature(with_answer(inputs, answer)), RCRConfig(window=cfg.window + T))
        per_layer = []
        for layer in range(geo.n_layers):
            k = p.prefix_kv(layer)[0].float()  # (1, Hkv, Np, d): the prefix region's keys
            q = p.layers[layer].window_queries.float()[0, :, -T:]  # (Hq, T, d): the answer steps' queries
            det = Detector.build(k, p.prefix_valid, method.rank)
            per_layer.append([head_figures(q[h * G:(h + 1) * G], k[0, h], det, h, method, p.scaling)
                              for h in range(geo.n_kv_heads)])
        rows.append(per_layer)
        if done:
            done(len(rows))
    out = []
    for layer in range(len(rows[0])):
        heads = []
        for h in range(len(rows[0][layer])):
            xs = [r[layer][h] for r in rows]
            heads.append({key: (xs[0][key] if key == "top" else float(np.mean([x[key] for x in xs])))
                          for key in xs[0]})
        out.append(heads)
    return out
