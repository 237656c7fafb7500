"""``exact``: exact top-S re-selection over the whole prefix at every layer and step (spec §4.2).

The upper bound for re-selection; its cost is a full prefix scan (Np key reads per KV head per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scoring import group_queries, logits, reduce_heads, top_sorted
from .base import Decision, Method, StepContext


@dataclass
class Exact(Method):
    name = "exact"
    reselects = True

    def decide(self, ctx: StepContext) -> Decision:
        p = ctx.prefix
        k_p, _ = p.prefix_kv(ctx.layer)
        qg = group_queries(ctx.query, p.n_kv_heads)
        scores = reduce_heads(logits(qg, k_p, p.scaling), p.prefix_valid.unsqueeze(1), self.config.head_reduction)
        sel = top_sorted(scores, ctx.resident.n_selected)
        trigger = torch.ones(p.batch_size, dtype=torch.bool, device=sel.device)
        return Decision(trigger=trigger, selection=sel, **self.cost_model(p))

    def cost_model(self, prefix) -> dict:
        return {"keys_per_refresh": prefix.n_prefix, "values_per_refresh": self.n_selected(prefix)}
