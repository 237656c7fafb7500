"""``arkvale``: page recall by digest (Chen et al., NeurIPS'24), held to RCR's budget (docs/algorithms.md,
"arkvale").

Each page's digest is ArkVale's "cuboid-mean" box (``InferState._summarize_keys``):

    c = (max_k k + min_k k) / 2,   r = mean_k |c - k|,   b_max = c + r,   b_min = c - r,

and a page's importance for query head j is I_p = sum_i max(q_ji b_max,i, q_ji b_min,i), averaged over the G
query heads of a KV head (``groups="kv"``) or over all query heads of the layer ("layer").

Every step attends to C = ceil(S / page_size) pages, the S entries every method attends to. ArkVale keeps a page
cache of c pages, of which the top k by digest must be resident each step: missing ones are recalled, the
lowest-ranked cached pages evicted, the others stay. ``rule``:

- "topk" (default; the paper, §5.1: "The top-k pages ... must engage in attention computation"): the top k = C
  pages attend, from a cache of c = 2C pages (k = c/2, its code's ``page_topks = budget // 2``);
- "recall" (ablation): the C attended pages are the whole cache (c = C), of which only the top k = max(1, C//2)
  must be resident; the others are whatever stayed.

Reads are the cost model's, S keys and S values every step (what the RCR paper charges ArkVale). The entries of
pages recalled into the cache, ArkVale's own traffic, are recorded apart (``Decision.recalled``). The cache
starts empty at the first decode step (BACON's selection is not page aligned), which therefore fills it. No sink
pages. Digests: 2 vectors per page on the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..cache import PrefixStore
from ..config import is_int
from ..pages import PageLayout, bound_scores, n_pages_kept, page_bounds, page_order_scores
from ..scoring import NEG_INF, group_queries
from .base import Decision, StepContext
from .knobs import knob
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
    # per layer (B, Hkv, P) bool: the pages in ArkVale's page cache. Allocated here, empty, and rewritten in place,
    # so a compiled step sees one tensor at one address from the first step on
    cached: list[torch.Tensor]
    n_valid_pages: torch.Tensor  # (B,) float


@dataclass
class ArkVale(ScorerMethod):
    name = "arkvale"

    page_size: int = knob(16, "entries per page (pages start at each sample's first valid prefix entry)")
    rule: str = knob("topk", "'topk' (ArkVale's paper, §5.1): the top ceil(selected / page_size) pages by digest "
                             "attend at every step; 'recall' (ablation): they are the whole page cache, of which "
                             "only the top half must be resident")
    groups: str = knob("kv", "the page ranking: 'kv', one per KV head (mean over its G query heads); 'layer', one "
                             "per layer (ArkVale's code default n_groups = 1)")

    def validate(self) -> None:
        self.need(is_int(self.page_size) and self.page_size >= 1, "page_size", "must be an integer >= 1")
        self.need(self.rule in ("topk", "recall"), "rule", "must be 'topk' or 'recall'")
        self.need(self.groups in ("kv", "layer"), "groups", "must be 'kv' or 'layer'")

    def init_state(self, prefix: PrefixStore) -> ArkValeState:
        layout = PageLayout.build(prefix, self.page_size)
        L = len(prefix.layers)
        digests = [cuboid_mean_digest(prefix.prefix_kv(layer)[0], layout) for layer in range(L)]
        shape = (prefix.batch_size, prefix.n_kv_heads, layout.n_pages)
        cached = [torch.zeros(shape, dtype=torch.bool, device=prefix.valid.device) for _ in range(L)]
        return ArkValeState(layout, digests, cached, layout.page_valid.sum(-1).float())

    def cache_pages(self, n_selected: int) -> tuple[int, int]:
        """(c, k): pages in ArkVale's page cache, and how many of them must be the top pages by digest."""
        C = n_pages_kept(n_selected, self.page_size)  # attended pages
        return (2 * C, C) if self.rule == "topk" else (C, max(1, C // 2))

    def page_scores(self, ctx: StepContext) -> torch.Tensor:
        """(B, Hkv, P) digest importance, -inf for pages a sample does not have."""
        p, st = ctx.prefix, ctx.state
        hi, lo = st.digests[ctx.layer]
        s = bound_scores(group_queries(ctx.query, p.n_kv_heads), hi, lo)  # (B, Hkv, G, P)
        # one ranking per KV head ("kv"), or one per layer shared by every head ("layer")
        s = s.mean(dim=2) if self.groups == "kv" else s.mean(dim=(1, 2)).unsqueeze(1).expand_as(s[:, :, 0])
        return s.masked_fill(~st.layout.page_valid.unsqueeze(1), NEG_INF)

    def decide(self, ctx: StepContext) -> Decision:
        """Updates the page cache; the attended entries (whole pages, best first) become the selection."""
        st = ctx.state
        layout = st.layout
        score = self.page_scores(ctx)
        B, H, P = score.shape
        c, k = self.cache_pages(ctx.resident.n_selected)
        valid = layout.page_valid.unsqueeze(1).expand(B, H, P)
        rank = score.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)  # (B, H, P): 0 = best page
        must = (rank < k) & valid
        was = st.cached[ctx.layer]
        # lexicographic priority: pages that must be resident, then pages already cached, then the rest (they fill
        # an empty cache); by digest inside each tier. The cache keeps the first c.
        tier = must.double() * 2 + (was & ~must).double()
        key = (tier * (P + 1) + (P - rank).double()).masked_fill(~valid, NEG_INF)
        now = (key.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1) < c) & valid
        entered = (now & ~was).float()  # (B, H, P) pages recalled into the cache at this step
        recalled = (entered * layout.page_len.unsqueeze(1).float()).sum(-1).mean(-1)  # (B,) entries per KV head
        was.copy_(now)
        attended = score if self.rule == "topk" else key  # the top C pages, or the cache
        d = self.decision(ctx, page_order_scores(attended, layout, ctx.prefix.prefix_valid))
        return dataclasses.replace(d, recalled=recalled)

    def detector_dots(self, ctx: StepContext) -> torch.Tensor:
        return 2.0 * ctx.state.n_valid_pages
