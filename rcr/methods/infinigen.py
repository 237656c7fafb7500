"""``infinigen``: speculative selection with skewed partial keys (Lee et al., OSDI'24; spec §4.5), held to RCR's
budget.

Offline, per layer and KV head h: a skew matrix A_h, from the SVD of calibration queries. With Q_h the
post-RoPE queries of h's G query heads stacked (n*G x d) and K_h its post-RoPE keys, Q_h = U S_q V_q^T and
s = s_q * s_k (s_k the singular values of K_h); A_h = V_q with its columns ordered by s, descending. A_h is
orthogonal, so (qA)(kA)^T = q k^T: skewing changes no score, it only concentrates the score on few columns.
Partial columns: c = round(ratio * d) columns (``config.infinigen_partial_ratio`` = 1/4, so the device holds
Np/4 key equivalents per KV head, as the paper states for InfiniGen), chosen by InfiniGen's rule, the union of
the top columns of sum_tokens |Q A| and of sum_tokens |K A|, grown one rank at a time until it has c columns.

At decode, layer l >= 1: the query is speculated from layer l-1's normalised attention input x at the current
step, through layer l's own projection: q^ = RoPE(q_norm(W_q x + b_q)) (Qwen2-VL's q bias and Qwen3-VL's
q_norm come from calling the module's own ``q_proj``/``q_norm``; RoPE is the module's own, at the current
true position). Scores: (q^ A)[:, cols] . (K A)[:, cols] over the prefix, reduced over the G query heads like
every other ranking (``config.head_reduction``), and a fixed top-S (32) each step replaces the α-count rule.
Layer 0 has no previous layer (``config.infinigen_layer0``): "exact_query" (default) scores the current query
through the same partial columns; "static" keeps the initial selection.

Calibration: ``python -m rcr.calibrate_infinigen --model PATH --out DIR`` runs the model on its own prompts
(synthetic scenes by default, or a directory of images) and writes the skew matrices and partial columns with
the command that made them; ``config.infinigen_calibration = DIR`` loads them. With no directory, each sample is
calibrated from its own prefill: its window queries (the last W prompt positions) and its prefix keys. The
result's ``cost["calibration"]`` records which.

Cost per KV head and step: Np*c/d detector dot-product equivalents, S keys and S values read.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass, field

import torch

from ..cache import PrefixStore
from ..config import ConfigError
from ..scoring import group_queries, reduce_heads, top_sorted
from .base import Decision, Method, StepContext

CALIBRATION_TENSORS = "infinigen.safetensors"
CALIBRATION_META = "calibration.json"
ORTHO_TOL = 1e-4


# ------------------------------------------------------------------------------------------- skew and columns

def skew_from_grams(gram_q: torch.Tensor, gram_k: torch.Tensor) -> torch.Tensor:
    """A from the Gram matrices Q^T Q and K^T K (..., d, d): the right singular vectors of Q (eigenvectors of
    Q^T Q, singular values sqrt of its eigenvalues) ordered by s_q * s_k, descending. Computed in fp64."""
    eq, vq = torch.linalg.eigh(gram_q.double())  # ascending
    ek = torch.linalg.eigvalsh(gram_k.double())
    s_q = eq.clamp_min(0).sqrt().flip(-1)  # descending, with the matching vectors
    vq = vq.flip(-1)
    s_k = ek.clamp_min(0).sqrt().flip(-1)
    order = (s_q * s_k).argsort(dim=-1, descending=True, stable=True)
    return torch.gather(vq, -1, order.unsqueeze(-2).expand_as(vq)).float()


def check_orthogonal(a: torch.Tensor, what: str = "skew matrix") -> None:
    """Raises when A^T A is not the identity (then skewing would change q.k). Runs at load/build, not per step."""
    eye = torch.eye(a.shape[-1], dtype=torch.float64, device=a.device)
    err = float((a.double().transpose(-1, -2) @ a.double() - eye).abs().max()) if a.numel() else 0.0
    if not err <= ORTHO_TOL:
        raise ValueError(f"InfiniGen {what} is not orthogonal: max |A^T A - I| = {err:.2e} > {ORTHO_TOL}")


def partial_columns(abs_q: torch.Tensor, abs_k: torch.Tensor, c: int) -> torch.Tensor:
    """InfiniGen's column rule at an exact size: abs_q, abs_k (..., d) = sum over tokens of |QA|, |KA|. A column
    enters the union at rank min(rank_q, rank_k); the first c to enter are kept (ties: the other rank, then
    the column index). Returns (..., c) column indices, ascending."""
    d = abs_q.shape[-1]
    rq = abs_q.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    rk = abs_k.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    key = torch.minimum(rq, rk) * d * d + torch.maximum(rq, rk) * d + torch.arange(d, device=abs_q.device)
    return key.argsort(dim=-1)[..., :c].sort(dim=-1).values


def n_partial(config, head_dim: int) -> int:
    return max(1, round(config.infinigen_partial_ratio * head_dim))


# ------------------------------------------------------------------------------------------ calibration files

def save_calibration(out_dir: str, skews: list[torch.Tensor], cols: list[torch.Tensor], meta: dict) -> None:
    """skews[l] (Hkv, d, d) fp32, cols[l] (Hkv, c) long. Writes infinigen.safetensors and calibration.json."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for layer, (a, c) in enumerate(zip(skews, cols)):
        check_orthogonal(a, f"skew matrix of layer {layer}")
        tensors[f"skew.{layer}"] = a.float().contiguous().cpu()
        tensors[f"cols.{layer}"] = c.long().contiguous().cpu()
    tmp = os.path.join(out_dir, CALIBRATION_TENSORS + ".tmp")
    save_file(tensors, tmp)
    os.replace(tmp, os.path.join(out_dir, CALIBRATION_TENSORS))
    with open(os.path.join(out_dir, CALIBRATION_META + ".tmp"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    os.replace(os.path.join(out_dir, CALIBRATION_META + ".tmp"), os.path.join(out_dir, CALIBRATION_META))


def load_calibration(path: str) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """(skews, cols, meta) from a directory written by ``save_calibration``; checks orthogonality."""
    from safetensors.torch import load_file

    f = os.path.join(path, CALIBRATION_TENSORS)
    if not os.path.isfile(f):
        raise ConfigError(f"RCRConfig.infinigen_calibration={path!r}: no {CALIBRATION_TENSORS} there; "
                          "write one with `python -m rcr.calibrate_infinigen --model PATH --out DIR`")
    t = load_file(f)
    n = len([k for k in t if k.startswith("skew.")])
    skews = [t[f"skew.{i}"] for i in range(n)]
    cols = [t[f"cols.{i}"] for i in range(n)]
    for i, a in enumerate(skews):
        check_orthogonal(a, f"skew matrix of layer {i} in {f}")
    meta_f = os.path.join(path, CALIBRATION_META)
    meta = {}
    if os.path.isfile(meta_f):
        with open(meta_f) as fh:
            meta = json.load(fh)
    return skews, cols, meta


# ------------------------------------------------------------------------------------------ speculation

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


# ----------------------------------------------------------------------------------------------- method

@dataclass
class InfiniGenState:
    skew_cols: list[torch.Tensor]  # per layer (B or 1, Hkv, d, c): the partial columns of A
    partial_keys: list[torch.Tensor]  # per layer (B, Hkv, Np, c): (K A)[:, cols], the device-resident part
    n_valid_prefix: torch.Tensor  # (B,) float
    calibration: str  # "prefill" or the calibration directory
    attn: dict = field(default_factory=dict)  # layer -> attention module (set while decode hooks are active)
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
class InfiniGen(Method):
    name = "infinigen"
    reselects = True

    def init_state(self, prefix: PrefixStore) -> InfiniGenState:
        cfg, L, d = self.config, len(prefix.layers), prefix.head_dim
        skews, cols, source = None, None, "prefill"
        if cfg.infinigen_calibration is not None:
            skews, cols, _ = load_calibration(cfg.infinigen_calibration)
            source = cfg.infinigen_calibration
            if len(skews) != L or tuple(skews[0].shape) != (prefix.n_kv_heads, d, d):
                raise ConfigError(f"RCRConfig.infinigen_calibration={source!r}: calibrated for {len(skews)} layers "
                                  f"x {tuple(skews[0].shape)}, the model has {L} x ({prefix.n_kv_heads}, {d}, {d})")
        c = n_partial(cfg, d)
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
        self._calibration = source
        self._n_cols = skew_cols[0].shape[-1] if skew_cols else c
        return InfiniGenState(skew_cols, partial_keys, prefix.prefix_valid.sum(-1).float(), source)

    @contextlib.contextmanager
    def decode_hooks(self, model, state: InfiniGenState):
        """Forward pre-hooks on every text layer's self-attention: keep its normalised input and the position
        embeddings of the current step. Removed on exit; nothing is kept at module level."""
        from ..models import _text_layers

        handles = []
        for i, layer in enumerate(_text_layers(model)):
            state.attn[i] = layer.self_attn

            def capture(module, args, kwargs, i=i):
                state.inputs[i] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                state.position_embeddings = kwargs.get("position_embeddings")

            handles.append(layer.self_attn.register_forward_pre_hook(capture, with_kwargs=True))
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
            return ctx.query if self.config.infinigen_layer0 == "exact_query" else None
        if layer - 1 not in st.inputs or st.position_embeddings is None:
            raise RuntimeError("infinigen needs its decode hooks: decode through rcr.decode/generate, or drive "
                               "Decoder.step inside `with decoder.enabled():`")
        return project_query(st.attn[layer], st.inputs[layer - 1], st.position_embeddings)

    def decide(self, ctx: StepContext) -> Decision:
        p, st, res = ctx.prefix, ctx.state, ctx.resident
        dots = st.n_valid_prefix * (st.skew_cols[ctx.layer].shape[-1] / p.head_dim)
        q = self.speculated_query(ctx)
        if q is None:  # layer 0, "static": keep the initial selection, read nothing
            off = torch.zeros(p.batch_size, dtype=torch.bool, device=res.selection.device)
            return Decision(trigger=off, selection=res.selection, detector_dots=dots * 0, **self._reads(p))
        qg = group_queries(q, p.n_kv_heads).float() @ st.skew_cols[ctx.layer]  # (B, Hkv, G, c)
        approx = torch.einsum("bhgc,bhnc->bhgn", qg, st.partial_keys[ctx.layer]) * p.scaling
        scores = reduce_heads(approx, p.prefix_valid.unsqueeze(1), self.config.head_reduction)
        sel = top_sorted(scores, res.n_selected)  # fixed top-S, every step
        trigger = torch.ones(p.batch_size, dtype=torch.bool, device=sel.device)
        return Decision(trigger=trigger, selection=sel, detector_dots=dots, **self._reads(p))

    def _reads(self, prefix) -> dict:
        s = self.n_selected(prefix)  # the selected entries' keys and values, every step
        return {"keys_per_refresh": s, "values_per_refresh": s}

    def cost_model(self, prefix) -> dict:
        return {**self._reads(prefix),
                "partial_columns": getattr(self, "_n_cols", n_partial(self.config, prefix.head_dim)),
                "calibration": getattr(self, "_calibration", "prefill")}
