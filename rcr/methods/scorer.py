"""Top-S re-selection methods as scorers (``exact``, ``quest``, ``arkvale``, ``infinigen``; docs/algorithms.md,
"Methods as scorers"): a method says how it scores the prefix at one decode layer-step; this base builds the
decision from the score, every layer and every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..cache import PrefixStore
from ..scoring import top_sorted
from .base import Decision, Method, StepContext


@dataclass
class ScorerMethod(Method):
    """Top-S re-selection at every decode layer-step, defined by a score over the prefix (kvpress's
    ``ScorerPress`` pattern): a method overrides ``score`` and, where it keeps a device-resident summary of
    the prefix, ``detector_dots``; a method whose scoring has a by-product to record (ArkVale's page cache)
    overrides ``decide`` and builds its decision with ``decision``. The base sets the trigger everywhere, takes
    the top S and reads the selected entries' S keys and S values per refresh."""

    reselects: ClassVar[bool] = True

    def score(self, ctx: StepContext) -> torch.Tensor | None:
        """(B, Hkv, Np) scores over the prefix, higher is better, -inf where an entry must not be selected.
        None: no refresh at this layer-step (the selection in force stays, nothing is read)."""
        raise NotImplementedError

    def detector_dots(self, ctx: StepContext) -> torch.Tensor | None:
        """(B,) cost of ``score`` on a device-resident summary, in d-dim dot products per query vector and KV
        head (see ``Decision.detector_dots``); None: the score reads the prefix itself."""
        return None

    def decide(self, ctx: StepContext) -> Decision:
        return self.decision(ctx, self.score(ctx))

    def decision(self, ctx: StepContext, scores: torch.Tensor | None) -> Decision:
        """The top-S refresh of ``scores`` (B, Hkv, Np) under an all-true trigger; None: no refresh."""
        if scores is None:
            off = torch.zeros(ctx.prefix.batch_size, dtype=torch.bool, device=ctx.resident.selection.device)
            return Decision(trigger=off, selection=None)
        sel = top_sorted(scores, ctx.resident.n_selected)  # (B, Hkv, S) ascending
        on = torch.ones(ctx.prefix.batch_size, dtype=torch.bool, device=sel.device)
        return Decision(trigger=on, selection=sel, detector_dots=self.detector_dots(ctx))

    def cost_model(self, prefix: PrefixStore, state: Any) -> dict:
        s = self.n_selected(prefix)  # the selected entries' keys and values, every step
        return {"keys_per_refresh": s, "values_per_refresh": s}
