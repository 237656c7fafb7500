"""One method's decode, layer by layer: the attention hook that runs the method's decision at each layer-step (before
attention, with the current post-RoPE query), merges it, records the telemetry, and attends over the resident slots
(``rcr/generate.py``'s ``Decoder`` installs it for a decode)."""

from __future__ import annotations

import torch

from .attention import attend
from .cache import PrefixStore, ResidentCache, ResidentLayer
from .methods import Method, StepContext
from .offload import ResidentReader
from .scoring import group_queries, logits, masked_lse
from .telemetry import Telemetry


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
        d = None
        if self.decides and window is None:
            d = self.method.decide(StepContext(layer=layer, step=self.step, query=query, resident=res,
                                               prefix=self.method_prefix, state=self.state,
                                               config=self.method.config, reader=self.reader, telemetry=self.tel))
            self.method.merge(res, d)
            if not d.recorded:  # rcr::decide records its own decision (Decision.recorded)
                self.tel.record_decision(layer, self.step, d, self.cost)
        valid = res.resident_valid if self.masked else None
        if window is not None:  # its slots are the whole sequence in order: the last `window` are visible
            valid = res.in_window(window)
        out = attend(query, res.resident_keys, res.resident_values, valid, scaling)  # (B, 1, Hq, d)
        if d is not None and d.attend_full is not None:  # these samples attend to the whole context (RefreshKV)
            out = torch.where(d.attend_full.view(-1, 1, 1, 1), self._attend_whole(layer, query, res, scaling), out)
        return out, None

    def _attend_whole(self, layer: int, query: torch.Tensor, res: ResidentLayer, scaling) -> torch.Tensor:
        """Attention over the whole context: every prefix entry in position order, then the window and the
        generated tokens (the resident slots after the selected ones), the slots ``full`` attends to."""
        p = self.prefix
        k_p, v_p = p.prefix_kv(layer)  # (B, Hkv, Np, d)
        S = res.n_selected
        keys = torch.cat([k_p, res.resident_keys[:, :, S:]], dim=2)  # (B, Hkv, Np + n - S, d)
        values = torch.cat([v_p, res.resident_values[:, :, S:]], dim=2)
        valid = None
        if self.masked:
            B, H = res.selection.shape[:2]
            valid = torch.cat([p.prefix_valid.unsqueeze(1).expand(B, H, -1), res.resident_valid[:, :, S:]], dim=2)
        return attend(query, keys, values, valid, scaling)

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
