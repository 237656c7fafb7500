"""One typed configuration for every method, validated before any model work.

Defaults are the RCR paper's values and BACON's released defaults. Where a paper is silent the default is the
project's recorded decision (docs/algorithms.md, "Decisions where the papers are open"), and the alternative is
a field here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# RCRConfig.compile: torch.compile modes, then torch's debugging backends
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "eager", "aot_eager")


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
    # ablations of the re-selection's ranking (rcr, fixed, rcr_layer; prob_norm also exact), docs/algorithms.md:
    # the logits of the kept (selected) prefix entries in the candidate ranking: "exact" (the paper: their exact
    # logits, already computed for the drift) or "approx" (the detector's rank-r logits, as for evicted entries)
    kept_logits: str = "exact"
    # mean_prob's normaliser per query head: "context" = the head's softmax over its whole context (the
    # attention it would give; rcr estimates the normaliser from the drift's two log-sum-exps) or "scored" =
    # the softmax over the entries being ranked (the prefix for the candidates and `exact`, the candidates
    # for rcr's exact re-scoring)
    prob_norm: str = "context"
    # --- BACON initial selection (SnapKV backbone) ---
    bacon_kernel: int = 5
    bacon_trace: int = 4
    bacon_lambda: float = 0.5
    bacon_topk_frac: float = 2.0
    bacon_eps: float = 1e-8
    # --- prefill oracle: average-pool the answer-attention scores like BACON (kernel 5) before top-k ---
    oracle_pool: bool = False
    # --- page-based baselines, Quest and ArkVale (docs/algorithms.md), on the prefix region only ---
    # tokens per page; pages start at each sample's first valid prefix token, the last page may be partial.
    # Pages kept per step = ceil(min(selected, Np) / page_size): 2 at the paper's budget (32 slots), with no
    # 3-page minimum; when partial pages leave slots free, the next-ranked page fills them.
    page_size: int = 16
    # Quest: page bound U_p(q) = sum_i max(q_i M_i, q_i m_i), reduced over the G query heads of a KV head:
    # "max" (default: U stays an upper bound on max q.k over the whole group) or "mean".
    quest_reduction: str = "max"
    # ArkVale's attended pages (docs/algorithms.md, "arkvale"): "topk" (default, ArkVale's paper, §5.1) = the top
    # C = ceil(selected / page_size) pages by digest attend at every step; "recall" (ablation) = the C pages are
    # ArkVale's whole page cache, of which only the top max(1, C // 2) must be resident each step (1 of 2 at the
    # paper's budget): missing ones are recalled, the lowest-ranked cached pages evicted, the others stay.
    arkvale_rule: str = "topk"
    # ArkVale page ranking: "kv" = one ranking per KV head, mean over its G query heads (n_groups = Hkv,
    # default); "layer" = one ranking per layer shared by every head (ArkVale's code default n_groups = 1).
    arkvale_groups: str = "kv"
    # --- InfiniGen (docs/algorithms.md, "infinigen") ---
    # partial columns per KV head = round(ratio * d), so the GPU holds Np * ratio key equivalents (paper: Np/4)
    infinigen_partial_ratio: float = 0.25
    # where the skew matrices and partial columns come from: a directory written by `python -m
    # rcr.calibrate_infinigen` (or shipped with the model), calibrated offline as InfiniGen's authors do; or
    # "per_sample", each sample's own prefill (an advantage the method does not have: an ablation). None, the
    # library default, is "per_sample"; a pipeline job resolves None to an offline calibration (docs/pipeline.md).
    infinigen_calibration: str | None = None
    # layer 0 has no previous layer to speculate from: "exact_query" (default) = score with the current
    # query through the same skewed partial columns; "static" = keep the initial (BACON) selection.
    infinigen_layer0: str = "exact_query"
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
        need(self.kept_logits in ("exact", "approx"), "kept_logits", "must be 'exact' or 'approx'")
        need(self.prob_norm in ("context", "scored"), "prob_norm", "must be 'context' or 'scored'")
        need(isinstance(self.page_size, int) and not isinstance(self.page_size, bool) and self.page_size >= 1,
             "page_size", "must be an integer >= 1")
        need(self.quest_reduction in ("max", "mean"), "quest_reduction", "must be 'max' or 'mean'")
        need(self.arkvale_rule in ("recall", "topk"), "arkvale_rule", "must be 'recall' or 'topk'")
        need(self.arkvale_groups in ("kv", "layer"), "arkvale_groups", "must be 'kv' or 'layer'")
        need(isinstance(self.infinigen_partial_ratio, (int, float)) and 0.0 < self.infinigen_partial_ratio <= 1.0,
             "infinigen_partial_ratio", "must be in (0, 1]")
        need(self.infinigen_calibration is None or (isinstance(self.infinigen_calibration, str)
                                                   and self.infinigen_calibration != ""),
             "infinigen_calibration", "must be None, 'per_sample' or a directory path")
        need(self.infinigen_layer0 in ("exact_query", "static"), "infinigen_layer0",
             "must be 'exact_query' or 'static'")
        need(isinstance(self.offload, bool), "offload", "must be a bool")
        need(isinstance(self.fused_kernel, bool), "fused_kernel", "must be a bool")
        need(self.compile in COMPILE_MODES, "compile", f"must be one of {list(COMPILE_MODES)}")
        need(self.compile is None or not self.offload, "compile",
             "cannot be combined with offload=True: offload mode reads the trigger on the host every layer-step")

    def check_model(self, head_dim: int) -> None:
        """Checks that depend on the model's geometry (called before prefill)."""
        if self.rank > head_dim:
            raise ConfigError(f"RCRConfig.rank={self.rank}: must be <= the model's head dim ({head_dim})")
        if round(self.infinigen_partial_ratio * head_dim) < 1:
            raise ConfigError(f"RCRConfig.infinigen_partial_ratio={self.infinigen_partial_ratio}: gives no partial "
                              f"column at head dim {head_dim}")

    def replace(self, **changes) -> RCRConfig:
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"RCRConfig has no field(s) {sorted(unknown)}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RCRConfig:
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"RCRConfig has no field(s) {sorted(unknown)}")
        return cls(**d)
