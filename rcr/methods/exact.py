"""``exact``: exact top-S re-selection over the whole prefix at every layer and step (docs/algorithms.md,
"exact").

The upper bound for re-selection; its cost is a full prefix scan (Np key reads per KV head per step).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..scoring import group_queries, logits, reduce_heads
from .base import StepContext
from .scorer import ScorerMethod


@dataclass
class Exact(ScorerMethod):
    name = "exact"

    def score(self, ctx: StepContext):
        p = ctx.prefix
        k_p, _ = p.prefix_kv(ctx.layer)
        qg = group_queries(ctx.query, p.n_kv_heads)  # (B, Hkv, G, d)
        return reduce_heads(logits(qg, k_p, p.scaling), p.prefix_valid.unsqueeze(1), self.config.head_reduction)

    def cost_model(self, prefix, state) -> dict:
        return {"keys_per_refresh": prefix.n_prefix, "values_per_refresh": self.n_selected(prefix)}
