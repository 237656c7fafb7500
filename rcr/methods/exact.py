"""``exact``: exact top-S re-selection over the whole prefix at every layer and step (docs/algorithms.md,
"exact").

The upper bound for re-selection; its cost is a full prefix scan (Np key reads per KV head per step, Np the
sample's own valid prefix entries).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scoring import group_queries, logits, masked_lse, reduce_heads
from .base import StepContext
from .scorer import ScorerMethod


@dataclass
class Exact(ScorerMethod):
    name = "exact"

    def score(self, ctx: StepContext):
        p, cfg, res = ctx.prefix, self.config, ctx.resident
        k_p, _ = p.prefix_kv(ctx.layer)
        qg = group_queries(ctx.query, p.n_kv_heads)  # (B, Hkv, G, d)
        lg = logits(qg, k_p, p.scaling)  # (B, Hkv, G, Np)
        valid = p.prefix_valid.unsqueeze(1)  # (B, 1, Np)
        norm = None
        if cfg.head_reduction == "mean_prob" and cfg.prob_norm == "context":
            # each query head's log-normaliser over its whole context, exactly: the prefix, and the resident slots
            # after the selected ones (window and generated tokens)
            S = res.n_selected
            lg_rest = logits(qg, res.resident_keys[:, :, S:], p.scaling)  # (B, Hkv, G, n - S)
            norm = torch.logaddexp(masked_lse(lg, valid), masked_lse(lg_rest, res.resident_valid[:, :, S:]))
        return reduce_heads(lg, valid, cfg.head_reduction, norm)

    def cost_model(self, prefix, state) -> dict:
        # the scan reads each sample's own valid prefix entries, (B,) on the device: not its batch's padded length
        return {"keys_per_refresh": prefix.prefix_valid.sum(-1).float(), "values_per_refresh": self.n_selected(prefix)}
