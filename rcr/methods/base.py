"""The method interface. The base class owns the mechanics; a method overrides one or two decisions.

- ``initial_scores``: scores over the prefix region at prefill; the top ``selected`` become resident.
  Default: BACON (spec §2). ``None`` keeps the whole prefix (``full``).
- ``decide``: at every decode layer-step (before attention, with the current post-RoPE query), return a
  :class:`Decision`: a trigger and a candidate selection. The base merges it under the trigger mask
  (``ResidentLayer.refresh``) and records telemetry. Static methods do not override it.

A decision is tensors only: no ``.item()``, no Python ``if`` on a tensor, so a decode step never waits
for the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..cache import PrefixStore, ResidentLayer
from ..config import RCRConfig
from ..scoring import top_sorted


@dataclass
class Decision:
    trigger: torch.Tensor  # (B,) or (B, Hkv) bool: refresh the selected slots of this layer (per KV head)
    selection: torch.Tensor  # (B, Hkv, S) candidate selection, merged where trigger is set
    keys_per_refresh: int  # prefix keys read per KV head by a refresh (cost model accounting)
    values_per_refresh: int  # prefix values read per KV head by a refresh
    drift: torch.Tensor | None = None  # (B,) estimated drift of this layer-step
    tau: torch.Tensor | None = None  # (B,) threshold the trigger was compared against
    detector_dots: torch.Tensor | None = None  # (B,) detector cost in d-dim dot-product equivalents per KV head


@dataclass
class StepContext:
    """What a method sees at one decode layer-step."""

    layer: int
    step: int  # decode step index (0 = the forward that consumes the first generated token)
    query: torch.Tensor  # (B, Hq, 1, d) post-RoPE, at the token's true position
    resident: ResidentLayer
    prefix: PrefixStore
    state: Any  # whatever ``init_state`` returned for this decode
    config: RCRConfig


@dataclass
class BuildContext:
    """What a method sees when its resident cache is built from the prefix store."""

    prefix: PrefixStore
    config: RCRConfig
    reference_scores: list[torch.Tensor] | None = None  # per layer (B, Hkv, Np): answer attention (oracle)
    memo: dict = field(default_factory=dict)  # carried across layers in order 0..L-1 (BACON's trace)


@dataclass
class Method:
    """Base method: BACON initial selection, no decode-time decision (that is the ``bacon`` baseline)."""

    config: RCRConfig
    label: str = ""

    name: ClassVar[str] = "base"
    reselects: ClassVar[bool] = False  # whether ``decide`` runs at decode
    needs_reference: ClassVar[bool] = False  # needs the uncompressed answer (prefill oracle)

    def __post_init__(self):
        self.label = self.label or self.name

    # --- decision 1: which prefix entries are resident after prefill ---
    def initial_scores(self, ctx: BuildContext, layer: int) -> torch.Tensor | None:
        from .bacon import bacon_scores  # the paper's initial selector for every compressed method

        return bacon_scores(ctx, layer)

    def n_selected(self, prefix: PrefixStore) -> int:
        return min(self.config.selected, prefix.n_prefix)

    def initial_selection(self, ctx: BuildContext, layer: int) -> torch.Tensor:
        """(B, Hkv, S) indices into the prefix region, ascending."""
        p = ctx.prefix
        scores = self.initial_scores(ctx, layer)
        if scores is None:
            idx = torch.arange(p.n_prefix, device=p.valid.device)
            return idx.expand(p.batch_size, p.n_kv_heads, p.n_prefix).contiguous()
        return top_sorted(scores, self.n_selected(p))

    # --- decision 2: at decode, whether and how to refresh ---
    def init_state(self, prefix: PrefixStore) -> Any:
        """Per-decode state (detectors, thresholds), built once after prefill."""
        return None

    def decide(self, ctx: StepContext) -> Decision | None:
        return None

    # --- mechanics (not overridden by methods; tests may override ``merge`` with a branching reference) ---
    def merge(self, resident: ResidentLayer, decision: Decision) -> None:
        resident.refresh(decision.trigger, decision.selection)

    def cost_model(self, prefix: PrefixStore) -> dict:
        """Reads per KV head per refresh, for reports (the merge in GPU-only mode issues them every step)."""
        return {"keys_per_refresh": 0, "values_per_refresh": 0}
