"""The BACON score (Boundary Attention CalibratiON, SnapKV backbone; docs/algorithms.md, "bacon").

Computed once at prefill from the window queries. It ranks the prefix for the ``bacon`` baseline and gives
the initial selection of every compressed method (``Method.initial_scores``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cache import PrefixStore
from .config import RCRConfig
from .scoring import NEG_INF


def pool(x: torch.Tensor, k: int) -> torch.Tensor:
    """avg_pool1d over the last dim, stride 1, zero padding counted (PyTorch default); keeps the length."""
    return F.avg_pool1d(x, kernel_size=k, padding=k // 2, stride=1)[..., : x.shape[-1]]


def bacon_layer_scores(q_win: torch.Tensor, keys: torch.Tensor, scaling: float, capacity: int,
                       trace: list[torch.Tensor], cfg: RCRConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """BACON scores of one layer for one unpadded sample.

    q_win (Hq, w, d) post-RoPE window queries; keys (Hkv, N, d) post-RoPE; ``trace`` holds E of earlier
    layers (most recent last). Returns (S (Hkv, T), E (Hkv, T)) with T = N - w.
    """
    Hq, w, d = q_win.shape
    Hkv, N, _ = keys.shape
    T, G = N - w, Hq // Hkv
    k = keys.repeat_interleave(G, dim=0)  # (Hq, N, d), repeat_kv
    att = torch.einsum("hwd,hnd->hwn", q_win.float(), k.float()) * scaling  # (Hq, w, N)
    causal = torch.ones(w, w, dtype=torch.bool, device=keys.device).tril()
    att[:, :, T:] = att[:, :, T:].masked_fill(~causal, NEG_INF)
    att = torch.softmax(att, dim=-1).to(keys.dtype).float()  # fp32 softmax, cast to the model dtype

    def gqa_pool(x):  # (Hq, T) -> (Hkv, T): GQA mean over the group, then avg-pool
        return pool(x.view(Hkv, G, T).mean(1), cfg.bacon_kernel)

    B = gqa_pool(att[:, :, :T].mean(1))  # window-mean score (SnapKV)
    Q = gqa_pool(att[:, -1, :T])  # last-query score
    E = torch.relu(Q - B)  # boundary evidence
    local = pool(E, cfg.bacon_kernel)  # intra-layer coherence
    prev = [e for e in trace[-cfg.bacon_trace:] if e.shape == E.shape] if cfg.bacon_trace else []
    t_trace = torch.stack(prev).mean(0) if prev else torch.zeros_like(E)  # inter-layer persistence
    V = E + local + t_trace
    kk = min(int(cfg.bacon_topk_frac * capacity), T)
    tb, tv = torch.topk(B, kk, dim=-1).values, torch.topk(V, kk, dim=-1).values
    lam = cfg.bacon_lambda * tb.std(-1, correction=0) / (tv.std(-1, correction=0) + cfg.bacon_eps)
    gate = (tv.mean(-1) / (tb.mean(-1) + cfg.bacon_eps)).clamp(0.0, 1.0)  # content gate ("elt" mode)
    return B + (lam * gate).unsqueeze(-1) * V, E


def bacon_scores(prefix: PrefixStore, layer: int, cfg: RCRConfig, memo: dict) -> torch.Tensor:
    """(B, Hkv, Np) BACON scores in padded coordinates, -inf at left padding.

    Each sample is scored on its own unpadded prompt, so a sample's selection does not depend on what
    it was batched with. Must be called for layers 0..L-1 in order with the same ``memo`` (the trace uses
    earlier layers).
    """
    p = prefix
    pl = p.layers[layer]
    traces = memo.setdefault("bacon_trace", [[] for _ in range(p.batch_size)])
    pads = memo.setdefault("pads", p.pad.tolist())  # prefill-time host read, once per batch
    out = torch.full((p.batch_size, p.n_kv_heads, p.n_prefix), NEG_INF, device=pl.keys.device)
    capacity = min(cfg.selected, p.n_prefix)
    for b, pad in enumerate(pads):
        if p.n_prefix - pad <= 0:
            continue
        s, e = bacon_layer_scores(pl.window_queries[b], pl.keys[b, :, pad:], p.scaling, capacity, traces[b], cfg)
        out[b, :, pad:] = s
        traces[b].append(e)
    return out
