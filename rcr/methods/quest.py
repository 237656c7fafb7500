"""``quest``: query-aware page selection (Tang et al., ICML'24; spec §4.3), held to RCR's budget.

The prefix region is split into pages of ``config.page_size`` (16) tokens, starting at each sample's first
valid prefix token (so a sample's pages do not depend on its batch); the last page may be partial. Each page
keeps channel-wise bounds of its post-RoPE keys, M_p = max_k k and m_p = min_k k, on the device. At every
decode layer-step the page score of query head j is Quest's upper bound

    U_p(q_j) = sum_i max(q_ji M_pi, q_ji m_pi)  >=  max_{k in p} q_j . k,

reduced over the G query heads of a KV head (``config.quest_reduction``: max by default, which keeps U an upper
bound for the whole group; or mean), so each KV head holds S entries (GQA parity, spec §4.3 "Adaptation").
The top ceil(S / page_size) pages (2 at the paper's 32 slots) become the selected slots, in every layer,
every step, with no 3-page minimum and no dense layers 0-1. If partial pages leave slots free, the
next-ranked page fills them; when every page fits (budget >= prefix) every token is selected.

Cost per KV head and step: the bounds are 2 vectors per page on the device (``detector_dots`` = 2 * pages per
query vector); the selected pages' S keys and S values are read from the prefix store.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import PrefixStore
from ..scoring import NEG_INF, group_queries, top_sorted
from .base import Decision, Method, StepContext

# ------------------------------------------------------------------------------------------ page helpers
# Shapes: B batch, H KV heads, G query heads per KV head, Np prefix entries, P pages, d head dim.

@dataclass
class PageLayout:
    """Which page each prefix entry belongs to, per sample (pages start at the sample's first valid entry)."""

    page_size: int
    n_pages: int  # P = ceil(Np / page_size): the most any sample has
    page_of: torch.Tensor  # (B, Np) long, page index of each entry; P (a dummy page) at left padding
    offset: torch.Tensor  # (B, Np) long, position inside its page
    page_len: torch.Tensor  # (B, P) long, valid entries per page (0: the sample has no such page)

    @classmethod
    def build(cls, prefix: PrefixStore, page_size: int) -> PageLayout:
        Np, dev = prefix.n_prefix, prefix.valid.device
        pad = prefix.pad.view(-1, 1)  # (B, 1), device
        rel = torch.arange(Np, device=dev).view(1, -1) - pad  # position in the sample's own coordinates
        P = -(-Np // page_size)
        page_of = torch.where(rel >= 0, rel.div(page_size, rounding_mode="floor"), torch.full_like(rel, P))
        offset = rel.clamp_min(0) % page_size
        n_valid = (Np - pad)  # (B, 1)
        starts = torch.arange(P, device=dev).view(1, -1) * page_size
        page_len = (n_valid - starts).clamp(0, page_size)
        return cls(page_size, P, page_of, offset, page_len)

    @property
    def page_valid(self) -> torch.Tensor:  # (B, P)
        return self.page_len > 0

    def index(self, n_heads: int, d: int) -> torch.Tensor:  # (B, H, Np, d) page index, for scatter_reduce
        B, Np = self.page_of.shape
        return self.page_of.view(B, 1, Np, 1).expand(B, n_heads, Np, d)


def page_bounds(keys: torch.Tensor, layout: PageLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest's channel-wise key bounds per page: keys (B, H, Np, d) -> (M, m), each (B, H, P, d) fp32.
    Entries at left padding go to a dummy page and never shape a real page's bounds; empty pages get 0."""
    B, H, _, d = keys.shape
    P, idx, k = layout.n_pages, layout.index(H, d), keys.float()
    hi = k.new_full((B, H, P + 1, d), NEG_INF).scatter_reduce(2, idx, k, "amax", include_self=True)[:, :, :P]
    lo = k.new_full((B, H, P + 1, d), float("inf")).scatter_reduce(2, idx, k, "amin", include_self=True)[:, :, :P]
    empty = ~layout.page_valid.view(B, 1, P, 1)
    return hi.masked_fill(empty, 0.0), lo.masked_fill(empty, 0.0)


def bound_scores(qg: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """U_p(q) = sum_i max(q_i hi_i, q_i lo_i) for hi >= lo, per query head: qg (B, H, G, d), hi/lo (B, H, P, d)
    -> (B, H, G, P) fp32. max(q hi, q lo) is q hi where q >= 0 and q lo where q < 0 (the sign trick of Quest's
    kernels), so the bound is two matrix products."""
    q = qg.float()
    return (torch.einsum("bhgd,bhpd->bhgp", q.clamp_min(0.0), hi)
            + torch.einsum("bhgd,bhpd->bhgp", q.clamp_max(0.0), lo))


def select_pages(page_key: torch.Tensor, layout: PageLayout, n_slots: int, prefix_valid: torch.Tensor) -> torch.Tensor:
    """Selected slots from a page ranking: page_key (B, H, P), higher is better, -inf for pages to avoid.

    Entries are taken whole page by whole page in rank order (ties: lower page first), and inside a page in
    position order, until ``n_slots`` are filled. Returns (B, H, n_slots) prefix indices, ascending."""
    B, H, P = page_key.shape
    key = page_key.masked_fill(~layout.page_valid.view(B, 1, P), NEG_INF)
    rank = key.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)  # (B, H, P): 0 = best page
    rank = torch.cat([rank, rank.new_full((B, H, 1), P)], dim=-1)  # the dummy page of left padding: last
    Np = layout.page_of.shape[1]
    tok_rank = torch.gather(rank, 2, layout.page_of.view(B, 1, Np).expand(B, H, Np))
    tok_key = -(tok_rank * layout.page_size + layout.offset.view(B, 1, Np)).double()
    tok_key = tok_key.masked_fill(~prefix_valid.view(B, 1, Np), NEG_INF)
    return top_sorted(tok_key, n_slots)


def n_pages_kept(n_slots: int, page_size: int) -> int:
    return -(-n_slots // page_size)


# ----------------------------------------------------------------------------------------------- method

@dataclass
class QuestState:
    layout: PageLayout
    bounds: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (M, m), each (B, Hkv, P, d)
    n_valid_pages: torch.Tensor  # (B,) float, for the detector counter


@dataclass
class Quest(Method):
    name = "quest"
    reselects = True

    def init_state(self, prefix: PrefixStore) -> QuestState:
        layout = PageLayout.build(prefix, self.config.page_size)
        bounds = [page_bounds(prefix.prefix_kv(layer)[0], layout) for layer in range(len(prefix.layers))]
        return QuestState(layout, bounds, layout.page_valid.sum(-1).float())

    def decide(self, ctx: StepContext) -> Decision:
        p, st = ctx.prefix, ctx.state
        hi, lo = st.bounds[ctx.layer]
        u = bound_scores(group_queries(ctx.query, p.n_kv_heads), hi, lo)  # (B, Hkv, G, P)
        u = u.amax(dim=2) if self.config.quest_reduction == "max" else u.mean(dim=2)
        sel = select_pages(u, st.layout, ctx.resident.n_selected, p.prefix_valid)
        trigger = torch.ones(p.batch_size, dtype=torch.bool, device=sel.device)  # stateless: every step
        return Decision(trigger=trigger, selection=sel, detector_dots=2.0 * st.n_valid_pages, **self.cost_model(p))

    def cost_model(self, prefix) -> dict:
        s = self.n_selected(prefix)  # the selected pages' keys and values, every step
        return {"keys_per_refresh": s, "values_per_refresh": s}
