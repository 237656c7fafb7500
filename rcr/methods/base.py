"""The method interface. The base class owns the mechanics; a method overrides one or two decisions.

- ``initial_scores``: scores over the prefix region at prefill; the top ``selected`` become resident.
  Default: BACON (``rcr.bacon_score``; docs/algorithms.md, "bacon"). ``None`` keeps the whole prefix (``full``).
- ``decide``: at every decode layer-step (before attention, with the current post-RoPE query), return a
  :class:`Decision`: a trigger and a candidate selection. The base merges it under the trigger mask
  (``ResidentLayer.refresh``) and records telemetry. Static methods do not override it. A decision may also send
  some samples' attention at that layer-step to the whole context (``Decision.attend_full``: RefreshKV's full
  steps).
- ``score``, for a ``ScorerMethod`` (``scorer.py``: top-S re-selection at every layer-step, ``exact``,
  ``quest``, ``arkvale``, ``infinigen``): scores over the prefix; that base turns them into the decision.
- ``cost_model``: prefix reads per KV head per refresh, read once per decode by the decoder and reported as
  ``GenerationResult.cost``. The telemetry counts a layer-step's reads as its refresh fraction times these, for
  every method (docs/algorithms.md, "Cost per decode step").

A decision is tensors only: no ``.item()``, no Python ``if`` on a tensor, so a decode step never waits
for the device.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..bacon_score import bacon_scores
from ..cache import PrefixStore, ResidentLayer
from ..config import RCRConfig, need
from ..offload import ResidentReader
from ..scoring import top_sorted


@dataclass
class Decision:
    trigger: torch.Tensor  # (B,) or (B, Hkv) bool: refresh the selected slots of this layer (per KV head)
    # (B, Hkv, S) candidate selection, merged where trigger is set; a row that did not fire is never merged, and
    # rcr::decide leaves its current selection there. None: nothing to merge (offload mode, when the host saw that
    # no trigger fired and therefore read nothing; a scorer with no score at this layer-step)
    selection: torch.Tensor | None
    drift: torch.Tensor | None = None  # (B,) estimated drift of this layer-step
    tau: torch.Tensor | None = None  # (B,) threshold the trigger was compared against
    # (B,) cost of scoring a device-resident summary of the prefix, in d-dim dot-product equivalents per query
    # vector and KV head (= the summary's size in key equivalents): RCR Np*r/d, Quest/ArkVale 2 per page,
    # InfiniGen Np*partial/d
    detector_dots: torch.Tensor | None = None
    # new contents of the S selected slots (B, Hkv, S, d), already on the device; None = the merge gathers
    # them from the prefix store (GPU-only mode)
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    # (B,) entries per KV head (mean over KV heads) that a method with its own page cache recalled into it at
    # this layer-step (ArkVale): its own traffic, recorded beside the reads of the cost model, never instead
    recalled: torch.Tensor | None = None
    # (B,) bool: the samples whose attention at this layer-step reads the whole context (every prefix entry, the
    # window and the generated tokens) instead of the resident slots (RefreshKV's full steps); None: none does
    attend_full: torch.Tensor | None = None
    # already merged into the resident layer, and recorded in ``StepContext.telemetry``, by the method (rcr::decide)
    merged: bool = False
    recorded: bool = False


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
    # how prefix entries reach the device (``rcr.offload``): a resident gather (GPU-only mode, the default) or
    # host-memory reads issued only where the trigger fired (offload mode)
    reader: Any = None
    # the decode's Telemetry, for a method that records its decision itself (Decision.recorded); None: it does not
    telemetry: Any = None

    def __post_init__(self):
        if self.reader is None:
            self.reader = ResidentReader(self.prefix)


@dataclass
class BuildContext:
    """What a method sees when its resident cache is built from the prefix store."""

    prefix: PrefixStore
    config: RCRConfig
    reference_scores: list[torch.Tensor] | None = None  # per layer (B, Hkv, Np): answer attention (oracle)
    memo: dict = field(default_factory=dict)  # carried across layers in order 0..L-1 (BACON's trace)


@dataclass
class Method:
    """Base method: BACON initial selection, no decode-time decision (that is the ``bacon`` baseline).

    ``config`` is what every method shares; a subclass adds its own knobs as fields (``rcr.methods.knobs.knob``)
    and checks them in ``validate``."""

    config: RCRConfig = field(default_factory=RCRConfig)
    label: str = ""

    name: ClassVar[str] = "base"
    shorthand: ClassVar[str | None] = None  # the knob a bare label value sets (fixed@0.05: tau)
    reselects: ClassVar[bool] = False  # whether ``decide`` runs at decode
    supports_offload: ClassVar[bool] = False  # reads the prefix store only through ``StepContext.reader``
    needs_reference: ClassVar[bool] = False  # needs the uncompressed answer (prefill oracle)
    uncompressed: ClassVar[bool] = False  # every prefix entry resident (``full``): attention statistics come from it

    def __post_init__(self):
        self.label = self.label or self.name
        self.validate()

    # --- the method's knobs and set-up ---
    def validate(self) -> None:
        """Check this method's knobs; a ConfigError names ``<name>.<knob>`` (see :meth:`need`)."""

    def need(self, cond: bool, knob: str, message: str) -> None:
        need(cond, f"{self.name}.{knob}", getattr(self, knob), message)

    def check_model(self, head_dim: int) -> None:
        """Checks that depend on the model's geometry, before prefill."""

    def calibration_samples(self, model_dir: str | None) -> int:
        """How many held-out samples :meth:`prepare` calibrates on for the model in ``model_dir`` (0: none). A
        pipeline job hands it that many input rows it does not evaluate (docs/pipeline.md, "Calibration")."""
        return 0

    def calibration_record(self, model_dir: str | None, heldout: dict | None = None) -> dict | None:
        """What this method is calibrated on, for a job's config (hash, run record, MLflow): None when it needs
        no calibration. ``heldout``: the ``source`` and ``sha256`` of the held-out samples a job hands it."""
        return None

    def prepare(self, model, samples: list | None = None) -> None:
        """Set-up once per model, before any sample (kvpress's ``post_init_from_model``): ``samples`` are the
        processor inputs (batch 1) of :meth:`calibration_samples` held-out samples, or None."""

    # --- decision 1: which prefix entries are resident after prefill ---
    def initial_scores(self, ctx: BuildContext, layer: int) -> torch.Tensor | None:
        return bacon_scores(ctx.prefix, layer, ctx.config, ctx.memo)  # the paper's initial selector

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

    def decode_hooks(self, model, state) -> contextlib.AbstractContextManager:
        """Module hooks a method needs while it decodes (InfiniGen: the previous layer's attention input),
        registered on entry and removed on exit. Default: none."""
        return contextlib.nullcontext()

    # --- mechanics (not overridden by methods; tests may override ``merge`` with a branching reference) ---
    def merge(self, resident: ResidentLayer, decision: Decision) -> None:
        if decision.selection is None or decision.merged:  # offload mode: nothing fired, nothing read; or done
            return
        resident.refresh(decision.trigger, decision.selection, decision.keys, decision.values)

    def cost_model(self, prefix: PrefixStore, state: Any) -> dict:
        """Prefix reads per KV head per refresh (``keys_per_refresh``, ``values_per_refresh``: a number, or a (B,)
        device tensor where they differ by sample; the merge in GPU-only mode issues them every step), plus any
        method-specific entries. ``state``: ``init_state``'s."""
        return {"keys_per_refresh": 0, "values_per_refresh": 0}

