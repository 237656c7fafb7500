"""``quest``: query-aware page selection (Tang et al., ICML'24), held to RCR's budget (docs/algorithms.md,
"quest").

Each page of the prefix keeps channel-wise bounds of its post-RoPE keys, M_p = max_k k and m_p = min_k k, on
the device. At every decode layer-step the page score of query head j is Quest's upper bound

    U_p(q_j) = sum_i max(q_ji M_pi, q_ji m_pi)  >=  max_{k in p} q_j . k,

reduced over the G query heads of a KV head (``reduction``: max, which keeps U an upper bound for the whole
group; or mean). The top ceil(S / page_size) pages become the selected slots; if partial pages leave
slots free, the next-ranked page fills them.

Cost per KV head and step: 2 vectors per page on the device (``detector_dots``), S keys and S values read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import PrefixStore
from ..config import is_int
from ..pages import PageLayout, bound_scores, page_bounds, page_order_scores
from ..scoring import group_queries
from .base import StepContext
from .knobs import knob
from .scorer import ScorerMethod


@dataclass
class QuestState:
    layout: PageLayout
    bounds: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (M, m), each (B, Hkv, P, d)
    n_valid_pages: torch.Tensor  # (B,) float, for the detector counter


@dataclass
class Quest(ScorerMethod):
    name = "quest"

    page_size: int = knob(16, "entries per page (pages start at each sample's first valid prefix entry); the top "
                              "ceil(selected / page_size) pages are kept, with no 3-page minimum")
    reduction: str = knob("max", "U over the G query heads of a KV head: 'max' (an upper bound for the whole "
                                 "group) or 'mean'")

    def validate(self) -> None:
        self.need(is_int(self.page_size) and self.page_size >= 1, "page_size", "must be an integer >= 1")
        self.need(self.reduction in ("max", "mean"), "reduction", "must be 'max' or 'mean'")

    def init_state(self, prefix: PrefixStore) -> QuestState:
        layout = PageLayout.build(prefix, self.page_size)
        bounds = [page_bounds(prefix.prefix_kv(layer)[0], layout) for layer in range(len(prefix.layers))]
        return QuestState(layout, bounds, layout.page_valid.sum(-1).float())

    def score(self, ctx: StepContext) -> torch.Tensor:
        st = ctx.state
        hi, lo = st.bounds[ctx.layer]
        u = bound_scores(group_queries(ctx.query, ctx.prefix.n_kv_heads), hi, lo)  # (B, Hkv, G, P)
        u = u.amax(dim=2) if self.reduction == "max" else u.mean(dim=2)
        return page_order_scores(u, st.layout, ctx.prefix.prefix_valid)  # whole pages, best first

    def detector_dots(self, ctx: StepContext) -> torch.Tensor:
        return 2.0 * ctx.state.n_valid_pages
