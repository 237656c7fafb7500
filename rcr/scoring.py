"""Small tensor helpers shared by the methods: exact logits, reduction over the query heads of a KV head,
and top-k selection. Shapes: B batch, Hkv KV heads, G query heads per KV head, M scored entries, d head dim.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def group_queries(query: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """(B, Hq, 1, d) post-RoPE decode query -> (B, Hkv, G, d). Query head j belongs to KV head j // G
    (transformers' ``repeat_kv`` convention)."""
    B, Hq, q, d = query.shape
    assert q == 1, "decode-time scoring expects one query position"
    return query.view(B, n_kv_heads, Hq // n_kv_heads, d)


def logits(qg: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """qg (B, Hkv, G, d), keys (B, Hkv, M, d) -> (B, Hkv, G, M) in fp32."""
    return torch.einsum("bhgd,bhmd->bhgm", qg.float(), keys.float()) * scaling


def reduce_heads(lg: torch.Tensor, valid: torch.Tensor | None, how: str,
                 norm: torch.Tensor | None = None) -> torch.Tensor:
    """Rank entries for one KV head from its G query heads' logits.

    lg (B, Hkv, G, M), valid (B, Hkv or 1, M) or None (every entry valid) -> scores (B, Hkv, M), -inf where invalid.
    ``mean_prob``: the mean over G of each head's probabilities (BACON's GQA mean): its softmax over the M entries,
    or with ``norm`` (B, Hkv, G), a log-normaliser per head over a larger set (its whole context), exp(lg - norm).
    ``max_logit``: max over G.
    """
    if valid is not None:
        lg = lg.masked_fill(~valid.unsqueeze(2), NEG_INF)
    if how == "mean_prob":
        p = torch.softmax(lg, dim=-1) if norm is None else torch.exp(lg - norm.unsqueeze(-1))
        if valid is not None:  # an all-invalid row gives NaN (as does -inf - -inf); score it 0
            p = p.nan_to_num(0.0)
        scores = p.mean(dim=2)
    else:
        scores = lg.amax(dim=2)
    return scores if valid is None else scores.masked_fill(~valid.expand_as(scores), NEG_INF)


def top_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(B, H, M) -> (B, H, k) indices of the top-k entries, in ascending position order.

    Position order keeps a budget >= M selection identical to the original layout (so the equivalence
    test is bitwise); within the selected slots order is otherwise irrelevant because keys carry RoPE.
    """
    return torch.topk(scores, k, dim=-1).indices.sort(dim=-1).values


def masked_lse(lg: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim of lg (B, Hkv, G, M) restricted to valid (B, Hkv, M); -inf if empty."""
    return torch.logsumexp(lg.masked_fill(~valid.unsqueeze(2), NEG_INF), dim=-1)
