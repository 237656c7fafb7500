"""The configuration every method shares, validated before any model work, and the one error class of the
project's configurations.

A method's own knobs (RCR's controller, Quest's reduction, ArkVale's rule, ...) are fields of the method's
dataclass (``rcr/methods/``), set through its label (``rcr@rho=0.3``); :class:`RCRConfig` holds what all methods
share: the resident budget, the initial (BACON) selection, the ranking over a KV head's query heads, and how a
decode runs (offload, compile, the fused kernels, telemetry).

Defaults are the RCR paper's values and BACON's released defaults. Where a paper is silent the default is the
project's recorded decision (docs/algorithms.md, "Decisions where the papers are open"), and the alternative is
a value of the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# RCRConfig.compile: torch.compile modes, then torch's debugging backends
# Qwen-family processors size an image dynamically: Qwen2-VL's published max_pixels (12,845,056) lets one image take
# 16,384 visual tokens, and its vision tower attends over 4x as many patches. 1280 is the cap Qwen's model cards
# suggest (max_pixels=1280*28*28): DetailCaps' 640x480 to 1024x768 images keep their resolution (<= 1,003 tokens), a
# larger one is downscaled (rcr.models.limit_image_tokens; docs/models.md). The pipeline's --max-image-tokens and the
# lmms-eval model's max_image_tokens default to it, so both see the same prompts.
MAX_IMAGE_TOKENS = 1280
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "eager", "aot_eager")


class ConfigError(ValueError):
    """A configuration value is invalid: ``field`` names it (``RCRConfig.rho``, ``quest.reduction``, or a job's
    ``max_new_tokens``), ``message`` says what is wrong. One class for the library, the pipeline and the trainer."""

    def __init__(self, field: str, message: str):
        self.field, self.message = field, message
        super().__init__(f"config error: field '{field}': {message}")


def need(cond: bool, field: str, value: Any, message: str) -> None:
    """Raise ``ConfigError(field, "<message>, got <value>")`` unless ``cond``."""
    if not cond:
        raise ConfigError(field, f"{message}, got {value!r}")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class RCRConfig:
    # --- resident layout per (layer, KV head): [selected | window | generated] ---
    selected: int = 32  # selected prefix slots, rewritten by a refresh
    window: int = 32  # last prompt tokens, always resident
    # reduction over the G query heads of a KV head when ranking entries:
    # "mean_prob" = mean of softmax probabilities (BACON's GQA mean, default); "max_logit" = max logit.
    head_reduction: str = "mean_prob"
    # mean_prob's normaliser per query head (exact, rcr, fixed, rcr_layer): "context" = the head's softmax over its
    # whole context (the attention it would give; rcr estimates the normaliser from the drift's two log-sum-exps)
    # or "scored" = the softmax over the entries being ranked (the prefix for the candidates and `exact`, the
    # candidates for rcr's exact re-scoring)
    prob_norm: str = "context"
    # --- BACON initial selection (SnapKV backbone) ---
    bacon_kernel: int = 5
    bacon_trace: int = 4
    bacon_lambda: float = 0.5
    bacon_topk_frac: float = 2.0
    bacon_eps: float = 1e-8
    # --- deployment mode (re-selecting drift methods: rcr, fixed, rcr_layer; others run resident) ---
    # The prefix store lives in host memory (pinned when CUDA is present); the detector and resident slots
    # stay on the device. The trigger is read on the host each layer-step and prefix keys/values are copied
    # only for layers (KV heads) whose trigger fired. Costs one host sync per layer-step.
    offload: bool = False
    # --- telemetry ---
    exact_drift: bool = False  # also compute the exact drift (a full prefix scan) at every layer-step
    record_attention: bool = False  # `full` decodes record the most-attended prefix position per layer-step
    # --- decoding ---
    eos_check_every: int = 8  # decode steps between host checks for "every sample finished"
    # compile the whole decode step (model forward + the method's per-layer decision) with
    # torch.compile(fullgraph=True) over a static-shape resident cache: None = eager; a torch.compile mode,
    # "default", "reduce-overhead" (CUDA graphs on a GPU) or "max-autotune"; or "eager" / "aot_eager",
    # torch's debugging backends (trace and check the graph, no code generation).
    compile: str | None = None
    # On CPU (rcr/fused.py, built on first use): RCR's pass over the detector logits (rcr, fixed, rcr_layer) as one
    # C++ kernel, an eager layer-step's whole decision as one C++ op, and a re-selecting method's merge as row
    # copies. False = the composed torch ops, which other devices always use. The same decisions either way.
    fused_kernel: bool = True
    extra: dict = field(default_factory=dict, compare=False)  # free-form notes, logged with the config

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        def check(cond: bool, name: str, message: str):
            need(cond, f"RCRConfig.{name}", getattr(self, name), message)

        for name in ("selected", "window", "bacon_kernel", "bacon_trace", "eos_check_every"):
            check(is_int(getattr(self, name)), name, "must be an integer")
        for name in ("selected", "window", "bacon_trace"):
            check(getattr(self, name) >= 0, name, "must be >= 0")
        check(self.eos_check_every >= 1, "eos_check_every", "must be >= 1")
        check(self.bacon_kernel >= 1 and self.bacon_kernel % 2 == 1, "bacon_kernel", "must be a positive odd integer")
        check(is_number(self.bacon_lambda) and self.bacon_lambda >= 0.0, "bacon_lambda", "must be >= 0")
        check(is_number(self.bacon_topk_frac) and self.bacon_topk_frac > 0.0, "bacon_topk_frac", "must be > 0")
        check(is_number(self.bacon_eps) and self.bacon_eps > 0.0, "bacon_eps", "must be > 0")
        check(self.head_reduction in ("mean_prob", "max_logit"), "head_reduction", "must be 'mean_prob' or 'max_logit'")
        check(self.prob_norm in ("context", "scored"), "prob_norm", "must be 'context' or 'scored'")
        for name in ("offload", "exact_drift", "record_attention", "fused_kernel"):
            check(isinstance(getattr(self, name), bool), name, "must be a bool")
        check(self.compile in COMPILE_MODES, "compile", f"must be one of {list(COMPILE_MODES)}")
        check(self.compile is None or not self.offload, "compile",
              "cannot be combined with offload=True: offload mode reads the trigger on the host every layer-step")

    def replace(self, **changes) -> RCRConfig:
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError("RCRConfig", f"has no field(s) {sorted(unknown)}; a method's own knobs go in its "
                                           "label (e.g. rcr@rho=0.3), see rcr.methods.describe()")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RCRConfig:
        return cls().replace(**d)
