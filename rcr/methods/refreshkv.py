"""``refreshkv``: RefreshKV (Xu, Goyal and Choi, ACL 2025, arXiv 2411.05787) at the shared budget
(docs/algorithms.md, "refreshkv").

Decoding alternates between *full steps*, whose attention reads the whole context (every prefix entry, the window
and the generated tokens), and *partial steps*, which attend to the resident slots (S selected + W window +
generated). A full step rebuilds the small cache from its own attention over the whole context: per KV head, each
prefix entry's attention probability (each query head's softmax over its whole context), the max over the KV
head's G query heads, max-pooled over neighbouring positions (kernel 7, stride 1); the top S become the selected
slots (ties of the pooled score: the higher own probability, then the earlier position). A partial step changes
nothing.

When a full step comes (``rule``), with decode steps counted from 1 (step index ``t`` is step t + 1):
- ``stride``: every ``stride``-th decode step, at every layer and for every sample;
- ``similarity``: at every ``qc_stride``-th decode step, per layer and sample, when the cosine similarity between
  the current query averaged over the layer's query heads and the averaged query of that layer's most recent full
  step (at first the prefill's last prompt token) is not above ``threshold``.

Reads (the cost model): a full step reads every valid prefix key and value of its layer, Np + Np per KV head; a
partial step reads none, and the similarity check only the query. With ``full_attention`` (the paper's Algorithm
1) the full step's own output attends to the whole context (``Decision.attend_full``); without it (the paper's
"w/o full attention" ablation) the step attends to the small cache it has just rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cache import PrefixStore
from ..config import is_int, is_number
from ..scoring import NEG_INF, group_queries, logits, masked_lse
from .base import Decision, Method, StepContext
from .knobs import knob

POOL_KERNEL = 7  # the paper's max-pooling kernel over the full step's attention (its SnapKV setting)


@dataclass
class RefreshKVState:
    # (L, B, d) fp32: per layer, the query of its most recent full step averaged over the layer's query heads
    # (``similarity`` only; None under ``stride``). Updated in place: a compiled step sees one address
    reference: torch.Tensor | None


def is_due(step, every: int):
    """Whether decode step index ``step`` (0-based) is an ``every``-th step (1-based: ``every``, 2 ``every``, ...):
    a Python bool for an eager decode's int, a (1,) bool tensor for a compiled decode's device counter."""
    return (step + 1) % every == 0


def top_pooled(pooled: torch.Tensor, own: torch.Tensor, k: int) -> torch.Tensor:
    """(B, H, M) pooled scores and each entry's own score -> (B, H, k) indices of the top k by the pooled score, ties
    broken by the own score and then by position (earlier first), in ascending position order. Max pooling makes
    plateaus of equal pooled scores, on which ``torch.topk`` may choose either way; two stable sorts do not."""
    by_own = torch.sort(own, dim=-1, descending=True, stable=True).indices
    order = torch.sort(torch.gather(pooled, -1, by_own), dim=-1, descending=True, stable=True).indices
    return torch.gather(by_own, -1, order[..., :k]).sort(dim=-1).values


@dataclass
class RefreshKV(Method):
    name = "refreshkv"
    reselects = True

    rule: str = knob("stride", "when a full step comes: 'stride' (every `stride`-th decode step) or 'similarity' "
                               "(at every `qc_stride`-th step, where the layer's mean query's cosine to its last full "
                               "step's is <= `threshold`)")
    stride: int = knob(10, "rule=stride: a full step every `stride` decode steps, at every layer")
    qc_stride: int = knob(5, "rule=similarity: the query similarity is checked every `qc_stride` decode steps")
    threshold: float = knob(0.95, "rule=similarity: a full step where the cosine similarity is not above it (the "
                                  "paper's value for Qwen2-7B)")
    full_attention: bool = knob(True, "a full step's own output attends to the whole context (the paper); false: "
                                      "to the small cache it has just rebuilt (the paper's 'w/o full attention')")

    def validate(self) -> None:
        self.need(self.rule in ("stride", "similarity"), "rule", "must be 'stride' or 'similarity'")
        self.need(is_int(self.stride) and self.stride >= 1, "stride", "must be an integer >= 1")
        self.need(is_int(self.qc_stride) and self.qc_stride >= 1, "qc_stride", "must be an integer >= 1")
        self.need(is_number(self.threshold) and -1.0 <= self.threshold <= 1.0, "threshold",
                  "must be a cosine similarity in [-1, 1]")
        self.need(isinstance(self.full_attention, bool), "full_attention", "must be a bool")

    def init_state(self, prefix: PrefixStore) -> RefreshKVState:
        if self.rule != "similarity":
            return RefreshKVState(reference=None)
        # the prefill is the first full step: its last prompt token's query, averaged over the query heads
        last = [pl.window_queries[:, :, -1].float().mean(dim=1) for pl in prefix.layers]  # L x (B, d)
        return RefreshKVState(reference=torch.stack(last))

    def full_steps(self, ctx: StepContext) -> torch.Tensor | None:
        """(B,) bool: the samples for which this layer-step is a full step; None where none can be (known on the
        host from the step index in an eager decode)."""
        B, dev = ctx.prefix.batch_size, ctx.resident.selection.device
        due = is_due(ctx.step, self.stride if self.rule == "stride" else self.qc_stride)
        if due is False:
            return None
        if self.rule == "stride":
            return torch.ones(B, dtype=torch.bool, device=dev) if due is True else due.expand(B)
        ref = ctx.state.reference[ctx.layer]  # (B, d)
        q = ctx.query.float().mean(dim=1).squeeze(1)  # (B, Hq, 1, d) -> (B, d)
        # "If the similarity is higher than a threshold s, we decode with the partial cache"
        full = ~(F.cosine_similarity(q, ref, dim=-1) > self.threshold) & due  # (B,)
        ref.copy_(torch.where(full.unsqueeze(-1), q, ref))
        return full

    def full_attention_top(self, ctx: StepContext) -> torch.Tensor:
        """(B, Hkv, S) the top S prefix entries of this step's attention over the whole context, ascending."""
        p, res = ctx.prefix, ctx.resident
        k_p, _ = p.prefix_kv(ctx.layer)
        qg = group_queries(ctx.query, p.n_kv_heads)  # (B, Hkv, G, d)
        lg = logits(qg, k_p, p.scaling)  # (B, Hkv, G, Np)
        S = res.n_selected
        lg_rest = logits(qg, res.resident_keys[:, :, S:], p.scaling)  # window and generated slots
        valid = p.prefix_valid.unsqueeze(1)  # (B, 1, Np)
        lse = torch.logaddexp(masked_lse(lg, valid), masked_lse(lg_rest, res.resident_valid[:, :, S:]))  # (B, Hkv, G)
        prob = torch.exp(lg - lse.unsqueeze(-1)).amax(dim=2)  # (B, Hkv, Np): max over the KV head's query heads
        prob = prob.masked_fill(~valid, 0.0)  # left padding attends nowhere
        B, H, Np = prob.shape
        pooled = F.max_pool1d(prob.reshape(B * H, 1, Np), POOL_KERNEL, stride=1, padding=POOL_KERNEL // 2)
        pooled = pooled.view(B, H, Np).masked_fill(~valid, NEG_INF)
        return top_pooled(pooled, prob.masked_fill(~valid, NEG_INF), S)

    def decide(self, ctx: StepContext) -> Decision:
        full = self.full_steps(ctx)
        if full is None:  # a partial step everywhere: nothing changes, nothing is read
            off = torch.zeros(ctx.prefix.batch_size, dtype=torch.bool, device=ctx.resident.selection.device)
            return Decision(trigger=off, selection=None)
        return Decision(trigger=full, selection=self.full_attention_top(ctx),
                        attend_full=full if self.full_attention else None)

    def cost_model(self, prefix: PrefixStore, state) -> dict:
        # a full step reads every valid prefix key and value of its layer: each sample's own Np, (B,) on the device
        return {"keys_per_refresh": prefix.prefix_valid.sum(-1).float(),
                "values_per_refresh": prefix.prefix_valid.sum(-1).float()}
