"""``arkvale``: page recall by digest (Chen et al., NeurIPS'24), held to RCR's budget (docs/algorithms.md,
"arkvale").

Each page's digest is ArkVale's "cuboid-mean" box (``InferState._summarize_keys``):

    c = (max_k k + min_k k) / 2,   r = mean_k |c - k|,   b_max = c + r,   b_min = c - r,

and a page's importance for query head j is I_p = sum_i max(q_ji b_max,i, q_ji b_min,i), averaged over the G
query heads of a KV head (``config.arkvale_groups="kv"``) or over all query heads of the layer ("layer").

The resident part is a paged cache of C = ceil(S / page_size) pages. ``config.arkvale_rule``: "recall" (each
step the top max(1, C//2) pages must be resident: missing ones are recalled, the lowest-ranked resident pages
evicted, the others stay; the paged cache starts empty at step 0) or "topk" (the top C pages each step).
Reads are what ArkVale pays, the entries of recalled pages, so ``keys_read`` is measured (at most S), and the
trigger records, per KV head, whether anything was recalled. Digests: 2 vectors per page on the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..cache import PrefixStore
from ..pages import PageLayout, bound_scores, n_pages_kept, page_bounds, page_order_scores
from ..scoring import NEG_INF, group_queries
from .base import Decision, StepContext
from .scorer import ScorerMethod


def cuboid_mean_digest(keys: torch.Tensor, layout: PageLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """ArkVale's cuboid-mean page digest: keys (B, H, Np, d) -> (b_max, b_min), each (B, H, P, d) fp32."""
    B, H, _, d = keys.shape
    P = layout.n_pages
    hi, lo = page_bounds(keys, layout)
    c = (hi + lo) / 2
    c_tok = torch.gather(torch.cat([c, c.new_zeros(B, H, 1, d)], 2), 2, layout.index(H, d))  # (B, H, Np, d)
    dev = (c_tok - keys.float()).abs()
    r = c.new_zeros(B, H, P + 1, d).scatter_add(2, layout.index(H, d), dev)[:, :, :P]
    r = r / layout.page_len.clamp_min(1).view(B, 1, P, 1).float()
    return c + r, c - r


@dataclass
class ArkValeState:
    layout: PageLayout
    digests: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (b_max, b_min), each (B, Hkv, P, d)
    resident: list[torch.Tensor | None]  # per layer (B, Hkv, P) bool: pages in the paged cache
    n_valid_pages: torch.Tensor  # (B,) float


@dataclass
class ArkVale(ScorerMethod):
    name = "arkvale"

    def init_state(self, prefix: PrefixStore) -> ArkValeState:
        layout = PageLayout.build(prefix, self.config.page_size)
        digests = [cuboid_mean_digest(prefix.prefix_kv(layer)[0], layout) for layer in range(len(prefix.layers))]
        return ArkValeState(layout, digests, [None] * len(prefix.layers), layout.page_valid.sum(-1).float())

    def page_scores(self, ctx: StepContext) -> torch.Tensor:
        """(B, Hkv, P) digest importance, -inf for pages a sample does not have."""
        p, st = ctx.prefix, ctx.state
        hi, lo = st.digests[ctx.layer]
        s = bound_scores(group_queries(ctx.query, p.n_kv_heads), hi, lo)  # (B, Hkv, G, P)
        if self.config.arkvale_groups == "kv":
            s = s.mean(dim=2)  # one ranking per KV head
        else:
            s = s.mean(dim=(1, 2)).unsqueeze(1).expand_as(s[:, :, 0])  # one ranking per layer, shared
        return s.masked_fill(~st.layout.page_valid.unsqueeze(1), NEG_INF)

    def score(self, ctx: StepContext) -> torch.Tensor:
        """Entries of the pages the paged cache holds after this step, best page first; records them."""
        st = ctx.state
        layout = st.layout
        score = self.page_scores(ctx)
        B, H, P = score.shape
        cap = n_pages_kept(ctx.resident.n_selected, layout.page_size)
        valid = layout.page_valid.unsqueeze(1).expand(B, H, P)
        if self.config.arkvale_rule == "recall":
            # lexicographic priority: pages that must be resident, then pages already resident, then the rest;
            # by digest score inside each tier
            rank = score.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
            forced = (rank < max(1, cap // 2)) & valid
            was = st.resident[ctx.layer]
            kept = forced if was is None else forced | was
            tier = forced.double() * 2 + (kept & ~forced).double()
            key = tier * (P + 1) + (P - rank).double()
            key = key.masked_fill(~valid, NEG_INF)
        else:
            key = score.double()
        order = key.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        st.resident[ctx.layer] = (order < cap) & valid
        return page_order_scores(key, layout, ctx.prefix.prefix_valid)

    def detector_dots(self, ctx: StepContext) -> torch.Tensor:
        return 2.0 * ctx.state.n_valid_pages

    def decide(self, ctx: StepContext) -> Decision:
        """The base's top-S decision, with ArkVale's accounting: only recalled entries are read, and the
        trigger (per KV head) says whether anything was recalled."""
        p, res = ctx.prefix, ctx.resident
        d = super().decide(ctx)
        sel = d.selection
        B, H, Np = *sel.shape[:2], p.n_prefix
        # recalls: selected entries that were not resident before this step (the only prefix reads)
        was_in = torch.zeros(B, H, Np, dtype=torch.bool, device=sel.device).scatter_(2, res.selection, True)
        tok_valid = torch.gather(p.prefix_valid.unsqueeze(1).expand(B, H, Np), 2, sel)
        recalled = (tok_valid & ~torch.gather(was_in, 2, sel)).sum(-1)  # (B, Hkv)
        reads = recalled.float().mean(-1)  # (B,) per KV head
        return dataclasses.replace(d, trigger=recalled > 0, keys_read=reads, values_read=reads)
