"""``arkvale``: page recall by digest (Chen et al., NeurIPS'24; spec §4.4), held to RCR's budget.

Pages of ``config.page_size`` (16) prefix tokens, laid out as for Quest (``quest.PageLayout``). Each page's
digest is ArkVale's "cuboid-mean" box (``InferState._summarize_keys``):

    c = (max_k k + min_k k) / 2,   r = mean_k |c - k|,   b_max = c + r,   b_min = c - r,

and a page's importance for query head j is I_p = sum_i max(q_ji b_max,i, q_ji b_min,i) (the Quest form on a
shrunken box), averaged over the G query heads of a KV head (``config.arkvale_groups="kv"``, n_groups = Hkv:
pages are recalled per KV head) or over all query heads of the layer ("layer", ArkVale's n_groups = 1).

The resident part is a paged cache of capacity C = ceil(S / page_size) pages (2 at the paper's budget).
Decision rule, ``config.arkvale_rule``:
- ``"recall"`` (default, ArkVale's mechanism): each step the top C//2 pages by digest (at least 1: "topk=1" at
  the paper's budget) must be resident. Missing ones are recalled from the prefix store and the
  lowest-ranked resident pages are evicted; the other resident pages stay. The paged cache starts empty at
  decode step 0 (BACON's token selection is not page-aligned), so step 0 recalls the top C pages.
- ``"topk"``: keep the top C pages by digest each step (Quest's rule with ArkVale's digest).

Every layer, every step. Reads are counted as ArkVale pays them: only the entries of recalled pages (keys and
values), so ``keys_read`` is data dependent and at most S; the trigger records, per KV head, whether anything
was recalled. Digest storage: 2 vectors per page (``detector_dots`` = 2 * pages per query vector).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import PrefixStore
from ..scoring import NEG_INF, group_queries
from .base import Decision, Method, StepContext
from .quest import PageLayout, bound_scores, n_pages_kept, page_bounds, select_pages


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
class ArkVale(Method):
    name = "arkvale"
    reselects = True

    def init_state(self, prefix: PrefixStore) -> ArkValeState:
        layout = PageLayout.build(prefix, self.config.page_size)
        digests = [cuboid_mean_digest(prefix.prefix_kv(layer)[0], layout) for layer in range(len(prefix.layers))]
        return ArkValeState(layout, digests, [None] * len(prefix.layers), layout.page_valid.sum(-1).float())

    def page_scores(self, ctx: StepContext) -> torch.Tensor:
        """(B, Hkv, P) digest importance, -inf for pages a sample does not have."""
        p, st = ctx.prefix, ctx.state
        hi, lo = st.digests[ctx.layer]
        s = bound_scores(group_queries(ctx.query, p.n_kv_heads), hi, lo)  # (B, Hkv, G, P)
        s = s.mean(dim=2) if self.config.arkvale_groups == "kv" else s.mean(dim=(1, 2)).unsqueeze(1).expand_as(s[:, :, 0])
        return s.masked_fill(~st.layout.page_valid.unsqueeze(1), NEG_INF)

    def decide(self, ctx: StepContext) -> Decision:
        p, st, res = ctx.prefix, ctx.state, ctx.resident
        layout, S = st.layout, res.n_selected
        score = self.page_scores(ctx)
        B, H, P = score.shape
        cap = n_pages_kept(S, layout.page_size)
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
        sel = select_pages(key, layout, S, p.prefix_valid)

        # recalls: selected entries that were not resident before this step (the only prefix reads)
        Np = p.n_prefix
        was_in = torch.zeros(B, H, Np, dtype=torch.bool, device=sel.device).scatter_(2, res.selection, True)
        tok_valid = torch.gather(p.prefix_valid.unsqueeze(1).expand(B, H, Np), 2, sel)
        recalled = (tok_valid & ~torch.gather(was_in, 2, sel)).sum(-1)  # (B, Hkv)
        reads = recalled.float().mean(-1)  # (B,) per KV head
        return Decision(trigger=recalled > 0, selection=sel, keys_read=reads, values_read=reads,
                        detector_dots=2.0 * st.n_valid_pages, **self.cost_model(p))

    def cost_model(self, prefix) -> dict:
        s = self.n_selected(prefix)  # upper bound per step: a full recall of the capacity
        return {"keys_per_refresh": s, "values_per_refresh": s}
