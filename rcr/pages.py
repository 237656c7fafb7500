"""Pages of the prefix region, for the page-based methods (``quest``, ``arkvale``; docs/algorithms.md, "Pages").

Pages of ``page_size`` entries start at each sample's first valid prefix entry, so a sample's pages do not
depend on its batch; the last page may be partial. Shapes: B batch, H KV heads, G query heads per KV head,
Np prefix entries, P pages, d head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import PrefixStore
from .scoring import NEG_INF


@dataclass
class PageLayout:
    """Which page each prefix entry belongs to, per sample."""

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


def page_order_scores(page_key: torch.Tensor, layout: PageLayout, prefix_valid: torch.Tensor) -> torch.Tensor:
    """Per-entry scores from a page ranking: page_key (B, H, P), higher is better, -inf for pages to avoid.

    The top-k of the result takes entries whole page by whole page in rank order (ties: lower page first),
    and inside a page in position order. Returns (B, H, Np) float64, -inf at invalid entries."""
    B, H, P = page_key.shape
    key = page_key.masked_fill(~layout.page_valid.view(B, 1, P), NEG_INF)
    rank = key.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)  # (B, H, P): 0 = best page
    rank = torch.cat([rank, rank.new_full((B, H, 1), P)], dim=-1)  # the dummy page of left padding: last
    Np = layout.page_of.shape[1]
    tok_rank = torch.gather(rank, 2, layout.page_of.view(B, 1, Np).expand(B, H, Np))
    tok_key = -(tok_rank * layout.page_size + layout.offset.view(B, 1, Np)).double()
    return tok_key.masked_fill(~prefix_valid.view(B, 1, Np), NEG_INF)


def n_pages_kept(n_slots: int, page_size: int) -> int:
    return -(-n_slots // page_size)
