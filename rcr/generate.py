"""Prefill once, decode many.

``prefill`` runs the vision tower and the prompt once and keeps the full post-RoPE KV of every layer (the
prefix store) plus the window queries BACON needs. ``decode`` runs one method greedily from that state:
it builds the method's resident cache, then steps the model with a ``ResidentCache`` and the ``"rcr"``
attention function. ``generate`` does both for a list of methods, ``full`` first.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .attention import attend, rcr_attention_enabled
from .cache import PrefixLayer, PrefixStore, ResidentCache, ResidentLayer, tensors_in
from .config import ConfigError, RCRConfig
from .fused import available as fused_kernels_available
from .methods import BuildContext, Full, Method, StepContext, parse_method
from .models import adapter_for, geometry, window_over
from .offload import HostReader, ResidentReader
from .scoring import group_queries, logits, masked_lse
from .telemetry import HostTelemetry, Telemetry

# ----------------------------------------------------------------------------------------------- prefill

class _PrefillRecorder:
    """Attention hook for the prefill: plain SDPA, keeping each layer's last-W post-RoPE queries."""

    def __init__(self, window: int):
        self.window = window
        self.queries: dict[int, torch.Tensor] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        self.queries[module.layer_idx] = query[:, :, -self.window:].clone()  # (B, Hq, W, d)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


@torch.no_grad()
def prefill(model, inputs, config: RCRConfig | None = None) -> PrefixStore:
    config = config or RCRConfig()
    geo = geometry(model)
    config.check_model(geo.head_dim)
    adapter = adapter_for(model)
    inputs = inputs.to(model.device)
    position_ids, next_position = adapter.prefill_positions(model, inputs)
    n = inputs["input_ids"].shape[1]
    window = min(config.window, n)
    recorder = _PrefillRecorder(window)
    cache = DynamicCache()
    with rcr_attention_enabled(model):
        out = model(**inputs, position_ids=position_ids, cache=cache, use_cache=True, rcr_hook=recorder,
                    logits_to_keep=1)
    layers = [PrefixLayer(keys=cache.layers[i].keys, values=cache.layers[i].values,
                          window_queries=recorder.queries[i], sliding_window=geo.sliding_windows[i])
              for i in range(geo.n_layers)]
    return PrefixStore(layers=layers, valid=inputs["attention_mask"].bool(), next_position=next_position,
                       first_logits=out.logits[:, -1].float(), window=window, scaling=geo.scaling,
                       n_kv_heads=geo.n_kv_heads, n_q_heads=geo.n_q_heads, head_dim=geo.head_dim)


# ------------------------------------------------------------------------------------------------ decode

class DecodeSession:
    """Attention hook for decoding one method: decide, merge, record, attend."""

    def __init__(self, method: Method, prefix: PrefixStore, cache: ResidentCache, state, telemetry: Telemetry,
                 masked: bool, reader=None, windows: list[int | None] | None = None):
        self.method, self.prefix, self.cache, self.state, self.tel = method, prefix, cache, state, telemetry
        # per layer, the sliding window over this decode's context (``layer_windows``); None: a global layer
        self.windows = [pl.sliding_window for pl in prefix.layers] if windows is None else windows
        # any invalid slot in the batch (left padding, or static mode's unwritten slots); decided once, at build
        self.masked = masked
        # how the method's reads reach the device; in offload mode the method sees the host-memory store
        self.reader = reader or ResidentReader(prefix)
        self.method_prefix = self.reader.prefix
        self.step = 0  # the decode step: an int, or a (1,) device tensor in a compiled (static) decode
        cfg = method.config
        self.exact_stats = (cfg.exact_drift or telemetry.top_prefix_pos is not None) and prefix.n_prefix > 0
        self.decides = method.reselects and prefix.n_prefix > 0
        self.cost = method.cost_model(prefix, state)  # read once: reads per refresh, for the telemetry

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer = module.layer_idx
        res = self.cache.layers[layer]
        window = self.windows[layer]  # a windowed layer keeps its whole prefix: no decision
        if self.exact_stats and window is None:
            self._record_exact(layer, query, res)
        if self.decides and window is None:
            d = self.method.decide(StepContext(layer=layer, step=self.step, query=query, resident=res,
                                               prefix=self.method_prefix, state=self.state,
                                               config=self.method.config, reader=self.reader, telemetry=self.tel))
            self.method.merge(res, d)
            if not d.recorded:
                self.tel.record_decision(layer, self.step, d, self.cost)
        valid = res.resident_valid if self.masked else None
        if window is not None:  # its slots are the whole sequence in order: the last `window` are visible
            valid = res.in_window(window)
        return attend(query, res.resident_keys, res.resident_values, valid, scaling), None

    def _record_exact(self, layer: int, query: torch.Tensor, res: ResidentLayer) -> None:
        """Exact drift and the most-attended prefix position, w.r.t. the selection in force at step start."""
        p = self.prefix
        k_p, _ = p.prefix_kv(layer)
        qg = group_queries(query, p.n_kv_heads)
        lg_p = logits(qg, k_p, p.scaling)  # (B, Hkv, G, Np)
        lg_res = logits(qg, res.resident_keys, p.scaling)
        if self.tel.drift_exact is not None:
            lse_ev = masked_lse(lg_p, res.evicted_mask())
            lse_res = masked_lse(lg_res, res.resident_valid)
            self.tel.put(self.tel.drift_exact, layer, self.step, torch.sigmoid(lse_ev - lse_res).mean(dim=(1, 2)))
        if self.tel.top_prefix_pos is not None:
            S = res.n_selected  # attention over the full context: the whole prefix + window + generated
            lse_all = torch.logaddexp(masked_lse(lg_p, p.prefix_valid.unsqueeze(1)),
                                      masked_lse(lg_res[..., S:], res.resident_valid[..., S:]))
            probs = torch.exp(lg_p - lse_all.unsqueeze(-1)).mean(dim=(1, 2))  # (B, Np), mean over all heads
            probs = probs.masked_fill(~p.prefix_valid, -1.0)
            self.tel.put(self.tel.top_prefix_pos, layer, self.step, probs.argmax(-1) - p.pad)


@dataclass
class GenerationResult:
    """One method's greedy decode of a batch. Host tensors/arrays only."""

    label: str
    sequences: torch.Tensor  # (B, T) generated token ids, pad after EOS
    lengths: torch.Tensor  # (B,) generated tokens including EOS
    telemetry: HostTelemetry  # (B, L, T-1) per layer-step: decode step t produces token t+1
    prefix_len: np.ndarray  # (B,) valid prefix entries (Np) per sample
    prefill_s: float
    decode_s: float
    cost: dict = field(default_factory=dict)  # reads per KV head per refresh (cost model; a list: per sample)
    offload: bool = False  # decoded in offload mode (prefix store in host memory, reads only on a trigger)

    def sample(self, b: int) -> dict:
        """Sample b's tokens (n,) and telemetry (L, n - 1) trimmed to its length, as numpy arrays; the
        pipeline's output row (``pipeline/schema.py``) summarises them."""
        n = int(self.lengths[b])
        steps = max(n - 1, 0)
        tel = {k: (None if v is None else v[b, :, :steps]) for k, v in vars(self.telemetry).items()}
        return {"tokens": self.sequences[b, :n].numpy(), **tel}


def layer_windows(prefix: PrefixStore, max_new_tokens: int) -> list[int | None]:
    """Per layer, its sliding window over a decode of ``max_new_tokens`` from ``prefix``: None (a global layer,
    re-selected) where it has none or where it cannot exclude any entry. The longest attention of the decode is
    over N + max_new_tokens - 1 entries: the last token is generated but never fed (``window_over``)."""
    return [window_over(pl.sliding_window, prefix.prompt_len + max_new_tokens - 1) for pl in prefix.layers]


def build_cache(method: Method, prefix: PrefixStore, max_new_tokens: int,
                reference_scores: list[torch.Tensor] | None = None, static: bool = False) -> ResidentCache:
    ctx = BuildContext(prefix=prefix, config=method.config, reference_scores=reference_scores)
    whole = Full(config=method.config)  # a windowed layer keeps every prefix entry (docs/models.md)
    # a re-selecting method's merge as row copies on CPU (rcr.fused; built on first use, so only where it is used)
    fused = (method.reselects and method.config.fused_kernel and prefix.valid.device.type == "cpu"
             and fused_kernels_available())
    layers = [ResidentLayer(prefix, i, (method if w is None else whole).initial_selection(ctx, i),
                            max_new_tokens, static, fused)
              for i, w in enumerate(layer_windows(prefix, max_new_tokens))]  # in layer order: BACON's trace
    return ResidentCache(layers)


def _eos_tensor(eos_token_id, device) -> torch.Tensor:
    ids = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    return torch.tensor(ids, dtype=torch.long, device=device)


def compile_options(mode: str) -> dict:
    """torch.compile keyword arguments for an ``RCRConfig.compile`` value: a backend or a mode."""
    return {"backend": mode} if mode in ("eager", "aot_eager") else {"mode": mode}


class Decoder:
    """Greedy decode of one method from a prefix store. ``step`` is one token for the whole batch and never
    reads a device value on the host; ``run`` checks for "all finished" every ``eos_check_every`` steps.

    With ``config.compile`` the resident cache has static shapes and the model forward with every layer's
    decision runs as one ``torch.compile(fullgraph=True)`` graph (CUDA graphs with "reduce-overhead"); the
    step index reaches it as a device tensor, and the host-side counters advance outside it."""

    def __init__(self, model, prefix: PrefixStore, method: Method, max_new_tokens: int, eos_token_id=None,
                 pad_token_id: int = 0, reference_scores=None):
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={max_new_tokens}: must be >= 1")
        self.model, self.prefix, self.method = model, prefix, method
        self.adapter = adapter_for(model)
        self.max_new_tokens = max_new_tokens
        cfg = method.config
        dev = prefix.valid.device
        B, L = prefix.batch_size, len(prefix.layers)
        self.static = cfg.compile is not None
        self.cache = build_cache(method, prefix, max_new_tokens, reference_scores, static=self.static)
        self.state = method.init_state(prefix)  # detectors etc. are built on the device, as after a prefill
        windows = layer_windows(prefix, max_new_tokens)
        # the most-attended prefix position is a property of uncompressed attention: recorded on `full` only
        self.tel = Telemetry(B, L, max(max_new_tokens - 1, 0), dev, cfg.exact_drift,
                             cfg.record_attention and method.uncompressed, reselected=[w is None for w in windows])
        masked = self.static or not bool(prefix.valid.all()) or any(not bool(layer.resident_valid.all())
                                                                    for layer in self.cache.layers)
        # offload mode: from here on the method and its resident layers see only the host-memory store
        self.offload = bool(cfg.offload and method.supports_offload and method.reselects and prefix.n_prefix > 0)
        reader = None
        if self.offload:
            host = prefix.to_host()
            for layer in self.cache.layers:
                layer.prefix = host
            reader = HostReader(host, dev, self.tel.bytes_moved)
        self.session = DecodeSession(method, prefix, self.cache, self.state, self.tel, masked, reader, windows)
        self.eos = _eos_tensor(eos_token_id, dev)
        self.pad = torch.tensor(pad_token_id, device=dev)
        self.tokens = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.long, device=dev)
        first = prefix.first_logits.argmax(-1)
        self.tokens[:, 0] = first
        self.finished = torch.isin(first, self.eos)
        self.t = 0  # decode steps done
        # A 4-D mask is taken as given by transformers, which then builds none: the "rcr" hook attends with the
        # resident slots' own validity and ignores it. (B, 1, 1, 1) bool, never read.
        self.no_mask = torch.ones(B, 1, 1, 1, dtype=torch.bool, device=dev)
        self.forward = self._forward
        if self.static:
            # the step's own inputs live in fixed buffers too: token ids (B, 1), positions ((3,) B, 1), step (1,)
            self.session.step = torch.zeros(1, dtype=torch.long, device=dev)
            self.step_ids = self.tokens[:, :1].clone()
            self.step_positions = self.adapter.positions(prefix.next_position, 1).clone()
            for buf in self.static_tensors():  # CUDA graphs replay on fixed addresses
                torch._dynamo.mark_static_address(buf)
            self.forward = torch.compile(self._forward, fullgraph=True, **compile_options(cfg.compile))

    def static_tensors(self) -> list[torch.Tensor]:
        """Every tensor a compiled step reads or writes but the model's weights (its inputs, resident cache, telemetry,
        prefix store, the method's state and cost model): static addresses, which a CUDA graph replays on."""
        bufs = [self.session.step, self.no_mask, self.step_ids, self.step_positions]
        for layer in self.cache.layers:
            bufs += [layer.keys, layer.values, layer.slot_valid, layer.write_pos, layer.selection]
        bufs += [v for v in vars(self.tel).values() if isinstance(v, torch.Tensor)]
        return bufs + tensors_in(self.prefix) + tensors_in(self.state) + tensors_in(self.session.cost)

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """One decode step of the model, every layer's decision included -> next-token logits (B, V)."""
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=self.no_mask,
                         cache=self.cache, use_cache=True, rcr_hook=self.session, logits_to_keep=1)
        return out.logits[:, -1]

    def step(self) -> None:
        t = self.t
        ids, positions = self.tokens[:, t : t + 1], self.adapter.positions(self.prefix.next_position + t, 1)
        if self.static:
            self.session.step.fill_(t)
            ids, positions = self.step_ids.copy_(ids), self.step_positions.copy_(positions)
        else:
            self.session.step = t
        logits = self.forward(ids, positions)
        if self.static:
            for layer in self.cache.layers:
                layer.advance(1)
        nxt = torch.where(self.finished, self.pad, logits.argmax(-1))
        self.finished = self.finished | torch.isin(nxt, self.eos)
        self.tokens[:, t + 1] = nxt
        self.t = t + 1

    @contextlib.contextmanager
    def enabled(self):
        """The "rcr" attention function and the method's own decode hooks; ``run`` enters it, and a caller that
        drives ``step`` itself must too."""
        with rcr_attention_enabled(self.model), self.method.decode_hooks(self.model, self.state):
            yield self

    @torch.no_grad()
    def run(self) -> None:
        every = self.method.config.eos_check_every
        with self.enabled():
            while self.t < self.max_new_tokens - 1:
                if self.t % every == 0 and bool(self.finished.all()):  # host check, outside the step
                    break
                self.step()

    def result(self, prefill_s: float, decode_s: float) -> GenerationResult:
        tokens = self.tokens.cpu()
        is_eos = torch.isin(tokens, self.eos.cpu())
        first_eos = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, torch.tensor(tokens.shape[1]))
        cost = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in self.session.cost.items()}
        return GenerationResult(label=self.method.label, sequences=tokens, lengths=first_eos,
                                telemetry=self.tel.to_host(), prefix_len=self.prefix.prefix_valid.sum(-1).cpu().numpy(),
                                prefill_s=prefill_s, decode_s=decode_s, cost=cost, offload=self.offload)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def decode(model, prefix: PrefixStore, method: Method, max_new_tokens: int, eos_token_id=None,
           pad_token_id: int = 0, reference_scores=None, prefill_s: float = 0.0) -> GenerationResult:
    t0 = time.perf_counter()
    dec = Decoder(model, prefix, method, max_new_tokens, eos_token_id, pad_token_id, reference_scores)
    dec.run()
    _sync(prefix.valid.device)
    return dec.result(prefill_s, time.perf_counter() - t0)


# ------------------------------------------------------------------------------ prefill-oracle scoring

class _AnswerAttentionRecorder:
    """Attention hook for a teacher-forced pass over the uncompressed answer on top of the full prefix:
    records, per layer, the mean attention of the answer's queries on each prefix entry."""

    def __init__(self, cache: ResidentCache, prefix: PrefixStore, answer_valid: torch.Tensor):
        self.cache, self.prefix = cache, prefix
        self.answer_valid = answer_valid  # (B, T) bool: positions before and at EOS
        self.scores: dict[int, torch.Tensor] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        p, layer = self.prefix, module.layer_idx
        res = self.cache.layers[layer]
        B, Hq, T, d = query.shape
        keys, valid = res.resident_keys, res.resident_valid  # full layout: [prefix | window | answer]
        n = keys.shape[2]
        lg = torch.einsum("bhtd,bhnd->bhtn", query.float(), keys.float().repeat_interleave(Hq // p.n_kv_heads, 1))
        mask = valid.repeat_interleave(Hq // p.n_kv_heads, 1).unsqueeze(2).expand(B, Hq, T, n).clone()
        mask[..., n - T:] &= torch.ones(T, T, dtype=torch.bool, device=query.device).tril()
        probs = torch.softmax((lg * scaling).masked_fill(~mask, float("-inf")), dim=-1)[..., : p.n_prefix]
        w = self.answer_valid.float()[:, None, :, None]  # (B, 1, T, 1)
        per_q = (probs * w).sum(2) / w.sum(2).clamp_min(1.0)  # (B, Hq, Np): mean over answer positions
        self.scores[layer] = per_q.view(B, p.n_kv_heads, Hq // p.n_kv_heads, p.n_prefix).mean(2)  # GQA mean
        return attend(query, keys, res.resident_values, valid, scaling, causal_tail=T,
                      sliding_window=p.layers[layer].sliding_window), None


@torch.no_grad()
def answer_attention_scores(model, prefix: PrefixStore, full: GenerationResult) -> list[torch.Tensor]:
    """Per layer (B, Hkv, Np): attention of the uncompressed answer on the prefix (docs/algorithms.md,
    "prefill_oracle")."""
    dev = prefix.valid.device
    answer = full.sequences.to(dev)
    T = answer.shape[1]
    answer_valid = torch.arange(T, device=dev).unsqueeze(0) < full.lengths.to(dev).unsqueeze(1)
    cache = build_cache(Full(config=RCRConfig()), prefix, T)
    rec = _AnswerAttentionRecorder(cache, prefix, answer_valid)
    with rcr_attention_enabled(model):
        model(input_ids=answer, position_ids=adapter_for(model).positions(prefix.next_position, T), cache=cache,
              use_cache=True, rcr_hook=rec, logits_to_keep=1)
    return [rec.scores[i] for i in range(len(prefix.layers))]


# ---------------------------------------------------------------------------------------------- generate

def _token_ids(model, eos_token_id, pad_token_id):
    gc = model.generation_config
    eos = gc.eos_token_id if eos_token_id is None else eos_token_id
    pad = pad_token_id if pad_token_id is not None else gc.pad_token_id
    if pad is None:
        pad = eos if isinstance(eos, int) else (eos[0] if eos else 0)
    return eos, int(pad)


@torch.no_grad()
def generate(model, inputs, method: str | list[str] = "rcr", max_new_tokens: int = 512,
             config: RCRConfig | None = None, eos_token_id: int | list[int] | None = None,
             pad_token_id: int | None = None, ignore_eos: bool = False):
    """Greedy generation with one method (returns a :class:`GenerationResult`) or several (returns a dict
    label -> result, in the order given). One prefill serves every method; ``full`` is decoded first, and
    always when a method needs the uncompressed answer (``prefill_oracle``).

    ``inputs``: the processor's output for a left-padded batch (``input_ids``, ``attention_mask``, pixel
    values, grids...). Method labels and the config are validated before any model work.
    """
    config = config or RCRConfig()
    labels = [method] if isinstance(method, str) else list(method)
    if not labels:
        raise ConfigError("method=[]: give at least one method")
    if len(set(labels)) != len(labels):
        raise ConfigError(f"method={labels}: duplicate labels")
    methods = {label: parse_method(label, config) for label in labels}
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    eos, pad = _token_ids(model, [] if ignore_eos else eos_token_id, pad_token_id)

    t0 = time.perf_counter()
    prefix = prefill(model, inputs, config)
    _sync(prefix.valid.device)
    prefill_s = time.perf_counter() - t0

    results: dict[str, GenerationResult] = {}
    need_reference = any(m.needs_reference for m in methods.values())
    if "full" in methods or need_reference:
        results["full"] = decode(model, prefix, methods.get("full") or Full(config=config), max_new_tokens, eos, pad,
                                 prefill_s=prefill_s)
    reference = answer_attention_scores(model, prefix, results["full"]) if need_reference else None
    for label, m in methods.items():
        if label != "full":
            results[label] = decode(model, prefix, m, max_new_tokens, eos, pad, reference, prefill_s=prefill_s)
    return results[labels[0]] if isinstance(method, str) else {label: results[label] for label in labels}
