"""``infinigen``: speculative selection with skewed partial keys (Lee et al., OSDI'24), held to RCR's budget
(docs/algorithms.md, "infinigen").

Per layer and KV head, an orthogonal skew matrix A concentrates q.k on few columns, and the device holds the
partial keys (K A)[:, cols] (c = round(ratio * d) columns: Np/4 key equivalents at the default ratio). At
decode, layer l >= 1 speculates its query from layer l-1's normalised attention input at the current step,
through layer l's own ``q_proj``/``q_norm`` and RoPE; the partial scores (q^ A)[:, cols] . (K A)[:, cols],
reduced over the G query heads like every ranking (``config.head_reduction``), pick a fixed top-S each step.
Layer 0 (``layer0``): "exact_query" scores the current query through the same columns; "static" keeps the
initial selection.

Calibration (``calibration``): a directory written by ``python -m rcr.calibrate_infinigen`` (skews and columns
from ``rcr.skewing``, calibrated offline as InfiniGen's authors do); "per_sample": each sample is calibrated from
its own prefill (its window queries and prefix keys), an ablation; or None, the default: offline once
:meth:`InfiniGen.prepare` has run (a pipeline job runs it: the calibration shipped with the checkpoint, in its
``infinigen_calibration/`` directory, or one made from held-out samples), else per sample.
``GenerationResult.cost`` records which: ``calibration`` (the calibration's description, else its path; or
"per_sample") and ``calibration_sha256`` (the digest of its tensor file; None per sample).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field

import torch

from ..cache import PrefixStore
from ..config import ConfigError, is_number
from ..models import _text_layers
from ..scoring import group_queries, reduce_heads
from ..skewing import (
    PER_SAMPLE,
    calibration_meta,
    check_orthogonal,
    load_calibration,
    n_partial,
    partial_columns,
    shipped_calibration,
    skew_from_grams,
    tensors_digest,
)
from .base import StepContext
from .knobs import knob
from .scorer import ScorerMethod

N_CALIBRATION = 8  # held-out samples an offline calibration is made from when none ships with the model: ~3k
# prompt tokens on the embedded model, the scale of InfiniGen's 2048-token PG-19 calibration text


def project_query(attn, x: torch.Tensor, position_embeddings) -> torch.Tensor:
    """Layer ``attn``'s post-RoPE query for attention input x (B, q, hidden): (B, Hq, q, d). Uses the module's
    own q_proj (with Qwen2's bias), q_norm (Qwen3) and its family's ``apply_rotary_pos_emb`` (M-RoPE already
    folded into cos/sin by the model's rotary embedding)."""
    B, n, _ = x.shape
    q = attn.q_proj(x).view(B, n, -1, attn.head_dim)
    q_norm = getattr(attn, "q_norm", None)
    if q_norm is not None:
        q = q_norm(q)
    q = q.transpose(1, 2)
    cos, sin = position_embeddings
    rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    q, _ = rope(q, q, cos, sin)
    return q


@dataclass
class InfiniGenState:
    skew_cols: list[torch.Tensor]  # per layer (B or 1, Hkv, d, c): the partial columns of A
    partial_keys: list[torch.Tensor]  # per layer (B, Hkv, Np, c): (K A)[:, cols], the device-resident part
    n_valid_prefix: torch.Tensor  # (B,) float
    calibration: str  # where A and the columns came from: "per_sample" or the calibration's description
    calibration_sha256: str | None  # the calibration file's digest (None per sample)
    # set by the decode hooks while a decode runs
    attn: dict = field(default_factory=dict)  # layer -> attention module
    inputs: dict = field(default_factory=dict)  # layer -> normalised attention input at the current step
    position_embeddings: tuple | None = None  # (cos, sin) at the current step


def _prefill_grams(prefix: PrefixStore, layer: int) -> tuple[torch.Tensor, ...]:
    """Per-sample calibration data of one layer: (Q^T Q, K^T K, Q, K) with padded rows zeroed."""
    pl = prefix.layers[layer]
    B, Hq, W, d = pl.window_queries.shape
    H = prefix.n_kv_heads
    wv = prefix.valid[:, prefix.prompt_len - W:].view(B, 1, W, 1)
    q = (pl.window_queries.float() * wv).view(B, H, Hq // H, W, d).reshape(B, H, -1, d)  # (B, H, G*W, d)
    k = prefix.prefix_kv(layer)[0].float() * prefix.prefix_valid.view(B, 1, -1, 1)
    return q.transpose(-1, -2) @ q, k.transpose(-1, -2) @ k, q, k


@dataclass
class InfiniGen(ScorerMethod):
    name = "infinigen"

    partial_ratio: float = knob(0.25, "partial key columns per KV head = round(ratio * d): the device holds Np * "
                                      "ratio key equivalents (the RCR paper: Np/4)")
    calibration: str | None = knob(None, "a calibration directory (python -m rcr.calibrate_infinigen); "
                                         "'per_sample' (an ablation); or none: offline once prepared (a job does), "
                                         "else per sample")
    layer0: str = knob("exact_query", "layer 0 has no previous layer to speculate from: 'exact_query' scores the "
                                      "current query through the same columns; 'static' keeps the initial selection")
    # set by prepare(): (skews, cols, meta) of an offline calibration made in memory, or the shipped directory
    prepared: tuple | str | None = field(default=None, init=False, repr=False, compare=False)

    def validate(self) -> None:
        self.need(is_number(self.partial_ratio) and 0.0 < self.partial_ratio <= 1.0, "partial_ratio",
                  "must be in (0, 1]")
        self.need(self.calibration is None or (isinstance(self.calibration, str) and self.calibration != ""),
                  "calibration", "must be none, 'per_sample' or a directory path")
        self.need(self.layer0 in ("exact_query", "static"), "layer0", "must be 'exact_query' or 'static'")

    def check_model(self, head_dim: int) -> None:
        self.need(round(self.partial_ratio * head_dim) >= 1, "partial_ratio",
                  f"gives no partial column at head dim {head_dim}")

    # --- offline calibration (kvpress's post_init_from_model): once per model, before any sample ---
    def calibration_samples(self, model_dir: str | None) -> int:
        if self.calibration is not None or shipped_calibration(model_dir, self.name) is not None:
            return 0
        return N_CALIBRATION

    def calibration_record(self, model_dir: str | None, heldout: dict | None = None) -> dict | None:
        if self.calibration == PER_SAMPLE:
            return {"kind": "per_sample", "source": "per_sample: each sample's own prefill (ablation)", "sha256": ""}
        if self.calibration is not None:
            meta = calibration_meta(self.calibration, self.name)
            return {"kind": "dir", "source": str(meta.get("description") or self.calibration), "sha256": meta["sha256"]}
        shipped = shipped_calibration(model_dir, self.name)
        if shipped is not None:
            meta = calibration_meta(shipped, self.name)
            return {"kind": "shipped", "source": meta.get("description") or "the calibration shipped with the model",
                    "sha256": meta["sha256"]}
        if heldout is None:
            raise ConfigError(f"{self.name}.calibration", self._no_calibration())
        return {"kind": "heldout", **heldout}

    def _no_calibration(self) -> str:
        return ("InfiniGen is calibrated offline, on samples that are not evaluated, and none are available: a "
                "pipeline job hands it the input rows after the evaluated ones (pass --limit below the input "
                "size); or give a calibration directory (`python -m rcr.calibrate_infinigen --model M --out DIR`, "
                f"then {self.name}@calibration=DIR), or {self.name}@calibration=per_sample (the ablation)")

    def prepare(self, model, samples: list | None = None, source: str | None = None) -> None:
        """With no ``calibration`` set: the calibration shipped with the model, else one made from ``samples``
        (processor inputs of held-out samples, batch 1; ``source`` describes them), kept in memory."""
        if self.calibration is not None:
            return
        shipped = shipped_calibration(getattr(model, "name_or_path", None), self.name)
        if shipped is not None:
            self.prepared = shipped
        elif samples:
            from ..calibrate_infinigen import calibrate  # the offline pass: imported only where it runs

            skews, cols, stats = calibrate(model, samples, self.partial_ratio, self.config.window)
            meta = {"description": source or f"offline: {len(samples)} held-out samples", **stats,
                    "sha256": tensors_digest(skews, cols)}
            self.prepared = (skews, cols, meta)

    def _offline(self) -> tuple[list, list, dict, str] | None:
        """(skews, cols, meta, where) of the offline calibration in force, or None (per sample)."""
        if isinstance(self.prepared, tuple):
            return (*self.prepared, "held-out samples")
        where = self.prepared if self.calibration is None else self.calibration
        if where is None or where == PER_SAMPLE:
            return None
        return (*load_calibration(where), where)

    def init_state(self, prefix: PrefixStore) -> InfiniGenState:
        L, d = len(prefix.layers), prefix.head_dim
        c = n_partial(self.partial_ratio, d)
        skews, cols, source, digest = None, None, PER_SAMPLE, None
        offline = self._offline()
        if offline is not None:
            skews, cols, meta, where = offline
            source, digest = str(meta.get("description") or where), meta["sha256"]
            if len(skews) != L or tuple(skews[0].shape) != (prefix.n_kv_heads, d, d) or cols[0].shape[-1] != c:
                raise ConfigError(f"{self.name}.calibration", f"{where} was calibrated for {len(skews)} layers x "
                                  f"{tuple(skews[0].shape)} with {cols[0].shape[-1]} partial columns; the model has "
                                  f"{L} x ({prefix.n_kv_heads}, {d}, {d}) and partial_ratio {self.partial_ratio} "
                                  f"gives {c}")
        skew_cols, partial_keys = [], []
        for layer in range(L):
            k_p = prefix.prefix_kv(layer)[0].float()
            if skews is None:  # per sample, from its own prefill
                gq, gk, q, k = _prefill_grams(prefix, layer)
                a = skew_from_grams(gq, gk)  # (B, H, d, d)
                check_orthogonal(a)
                col = partial_columns((q @ a).abs().sum(-2), (k @ a).abs().sum(-2), c)  # (B, H, c)
            else:
                dev = k_p.device
                a, col = skews[layer].to(dev).unsqueeze(0), cols[layer].to(dev).unsqueeze(0)  # (1, H, d, d/c)
            a_c = torch.gather(a, -1, col.unsqueeze(-2).expand(*col.shape[:-1], d, col.shape[-1]))  # (., H, d, c)
            skew_cols.append(a_c)
            partial_keys.append(k_p @ a_c)
        return InfiniGenState(skew_cols, partial_keys, prefix.prefix_valid.sum(-1).float(), source, digest)

    @contextlib.contextmanager
    def decode_hooks(self, model, state: InfiniGenState):
        """Forward pre-hooks on every text layer's self-attention: keep its normalised input and the position
        embeddings of the current step; a forward hook on the last layer forgets them, so every step starts from
        the same (empty) state, which a compiled step can rely on. Removed on exit; nothing is kept at module
        level."""
        handles = []
        layers = _text_layers(model)
        for i, layer in enumerate(layers):
            state.attn[i] = layer.self_attn

            def capture(module, args, kwargs, i=i):
                state.inputs[i] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                state.position_embeddings = kwargs.get("position_embeddings")

            handles.append(layer.self_attn.register_forward_pre_hook(capture, with_kwargs=True))

        def forget(module, args, output):
            state.inputs.clear()
            state.position_embeddings = None

        handles.append(layers[-1].register_forward_hook(forget))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            state.inputs.clear()
            state.attn.clear()
            state.position_embeddings = None

    def speculated_query(self, ctx: StepContext) -> torch.Tensor | None:
        """(B, Hq, 1, d): layer l's query from layer l-1's input; layer 0 per ``infinigen_layer0``."""
        st, layer = ctx.state, ctx.layer
        if layer == 0:
            return ctx.query if self.layer0 == "exact_query" else None
        if layer - 1 not in st.inputs or st.position_embeddings is None:
            raise RuntimeError("infinigen needs its decode hooks: decode through rcr.decode/generate, or drive "
                               "Decoder.step inside `with decoder.enabled():`")
        return project_query(st.attn[layer], st.inputs[layer - 1], st.position_embeddings)

    def score(self, ctx: StepContext) -> torch.Tensor | None:
        p, st = ctx.prefix, ctx.state
        q = self.speculated_query(ctx)
        if q is None:  # layer 0, "static": keep the initial selection, read nothing
            return None
        qg = group_queries(q, p.n_kv_heads).float() @ st.skew_cols[ctx.layer]  # (B, Hkv, G, c)
        approx = torch.einsum("bhgc,bhnc->bhgn", qg, st.partial_keys[ctx.layer]) * p.scaling
        return reduce_heads(approx, p.prefix_valid.unsqueeze(1), self.config.head_reduction)

    def detector_dots(self, ctx: StepContext) -> torch.Tensor:
        return ctx.state.n_valid_prefix * (ctx.state.skew_cols[ctx.layer].shape[-1] / ctx.prefix.head_dim)

    def cost_model(self, prefix: PrefixStore, state: InfiniGenState) -> dict:
        return {**super().cost_model(prefix, state), "partial_columns": state.skew_cols[0].shape[-1],
                "calibration": state.calibration, "calibration_sha256": state.calibration_sha256}
