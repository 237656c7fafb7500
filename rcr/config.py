"""One typed configuration for every method, validated before any model work.

Defaults are the paper's values (seed/rcr-paper-summary.txt) and BACON's released defaults
(spec/algorithms.md §2). Where the paper is silent the default is the project's recorded decision
(DESIGN.md, "Decisions"), and the alternative is a field here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field."""


@dataclass(frozen=True)
class RCRConfig:
    # --- resident layout per (layer, KV head): [selected | window | generated] ---
    selected: int = 32  # selected prefix slots, rewritten by a refresh
    window: int = 32  # last prompt tokens, always resident
    # --- RCR detector and candidate re-selection ---
    candidates: int = 128  # detector top-k whose keys are fetched and scored exactly ("4c")
    rank: int = 8  # rank of the per-(layer, KV head) SVD detector
    # --- rate controller: tau <- tau * exp(step * (f - rho)) after every layer ---
    tau0: float = 0.03
    step: float = 0.05
    rho: float = 0.4
    # f in the controller: "layer" = per-layer refresh indicator (one trigger per layer, default);
    # "heads" = fraction of KV heads whose own drift exceeded tau (per-head triggers).
    controller_signal: str = "layer"
    # constant threshold of the `fixed` baseline (the paper's tercile analysis uses 0.03)
    fixed_tau: float = 0.03
    # reduction over the G query heads of a KV head when ranking entries:
    # "mean_prob" = mean of softmax probabilities (BACON's GQA mean, default); "max_logit" = max logit.
    head_reduction: str = "mean_prob"
    # --- BACON initial selection (SnapKV backbone) ---
    bacon_kernel: int = 5
    bacon_trace: int = 4
    bacon_lambda: float = 0.5
    bacon_topk_frac: float = 2.0
    bacon_eps: float = 1e-8
    # --- prefill oracle: average-pool the answer-attention scores like BACON (kernel 5) before top-k ---
    oracle_pool: bool = False
    # --- telemetry ---
    exact_drift: bool = False  # also compute the exact drift (a full prefix scan) at every layer-step
    record_attention: bool = False  # record the most-attended prefix position per layer-step
    # --- decoding ---
    eos_check_every: int = 8  # decode steps between host checks for "every sample finished"
    extra: dict = field(default_factory=dict, compare=False)  # free-form notes, logged with the config

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, name: str, msg: str):
            if not cond:
                raise ConfigError(f"RCRConfig.{name}={getattr(self, name)!r}: {msg}")

        for name in ("selected", "window", "candidates", "rank", "bacon_kernel", "bacon_trace", "eos_check_every"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool), name, "must be an integer")
        for name in ("selected", "window", "candidates", "bacon_trace"):
            need(getattr(self, name) >= 0, name, "must be >= 0")
        need(self.rank >= 1, "rank", "must be >= 1")
        need(self.eos_check_every >= 1, "eos_check_every", "must be >= 1")
        need(self.candidates >= self.selected, "candidates",
             f"must be >= selected ({self.selected}): candidates are re-scored exactly and the top `selected` kept")
        need(self.bacon_kernel >= 1 and self.bacon_kernel % 2 == 1, "bacon_kernel", "must be a positive odd integer")
        need(0.0 < self.rho < 1.0, "rho", "target refresh fraction must be in (0, 1)")
        need(self.tau0 > 0.0, "tau0", "must be > 0 (the controller is multiplicative)")
        need(self.step > 0.0, "step", "must be > 0")
        need(self.fixed_tau >= 0.0, "fixed_tau", "must be >= 0")
        need(self.bacon_lambda >= 0.0, "bacon_lambda", "must be >= 0")
        need(self.bacon_topk_frac > 0.0, "bacon_topk_frac", "must be > 0")
        need(self.bacon_eps > 0.0, "bacon_eps", "must be > 0")
        need(self.controller_signal in ("layer", "heads"), "controller_signal", "must be 'layer' or 'heads'")
        need(self.head_reduction in ("mean_prob", "max_logit"), "head_reduction",
             "must be 'mean_prob' or 'max_logit'")

    def check_model(self, head_dim: int) -> None:
        """Checks that depend on the model's geometry (called before prefill)."""
        if self.rank > head_dim:
            raise ConfigError(f"RCRConfig.rank={self.rank}: must be <= the model's head dim ({head_dim})")

    def replace(self, **changes) -> "RCRConfig":
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"RCRConfig has no field(s) {sorted(unknown)}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RCRConfig":
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"RCRConfig has no field(s) {sorted(unknown)}")
        return cls(**d)

    def hash(self) -> str:
        """Short stable hash of every field, for keying outputs."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:12]
