"""``rcr``: Rate-Controlled Refresh, and ``fixed``, the same with a constant threshold (docs/algorithms.md,
"rcr" and "fixed").

Per decode layer-step, before attention, with the current post-RoPE query q:
1. drift = attention mass on evicted prefix entries, with approximate logits (rank-r detector) for the
   evicted and exact logits for the resident entries: sigmoid(LSE(z~_evicted) - LSE(z_resident)),
   averaged over the G query heads and the KV heads of the layer. The one pass over the detector logits
   (``Detector.evicted_lse_and_scores``) also gives the candidate scores; on CPU it is a fused C++ kernel, and an
   eager layer-step runs steps 1-4 as one C++ op (``rcr.fused``, ``_decide_op``).
2. trigger = drift > tau.
3. Candidates, computed in every layer (by the eager CPU op only in the rows that fired, the only ones merged):
   the top C of the whole prefix ranked by the kept entries' exact logits (the resident slots') and the evicted
   entries' approximate ones, re-scored exactly with their keys; the top S are the new selection (C key + S value
   reads). ``mean_prob`` takes each query head's probability under its
   whole context's softmax, normalised by logaddexp(LSE(z_resident), LSE(z~_evicted)), the drift's two terms.
   ``kept_logits="approx"`` and ``prob_norm="scored"`` are the ablations (docs/algorithms.md, "rcr").
4. The base merges under the trigger with torch.where (on CPU, eagerly: row copies where it fired, by the op
   itself for these methods); tau is updated by the rate controller.

Prefix keys and values are read only through ``ctx.reader`` (``rcr.offload``): in GPU-only mode the reads are
issued every layer-step and the merge is masked; in offload mode (``config.offload``) the host sees the
trigger and reads only the rows that fired, or nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import gather_heads
from ..config import is_int, is_number
from ..controller import RateController
from ..detector import Detector
from ..fused import available as fused_kernel_available
from ..scoring import group_queries, logits, masked_lse, reduce_heads, top_sorted
from .base import Decision, Method, StepContext
from .knobs import knob


@dataclass
class RCRState:
    detectors: list[Detector]  # one per layer
    tau: torch.Tensor  # (B,) shared by all layers of a sample, or (B, L) per layer
    detector_dots: torch.Tensor  # (B,) the detector's cost per layer-step: valid prefix entries x rank / head dim
    fused: bool = False  # the detector pass runs as rcr.fused's CPU kernel
    # (Hkv + 1, B): the threshold's factor when k of the Hkv KV heads refreshed (RCR.tau_factors); None: fixed
    tau_factors: torch.Tensor | None = None


@dataclass
class DriftRefresh(Method):
    """What ``rcr``, ``fixed`` and ``rcr_layer`` share: the detector, the drift, the candidates and the merge. A
    subclass says where the threshold comes from (``initial_tau``, ``current_tau``, ``update_tau``, and
    ``tau_factors`` for the fused op)."""

    reselects = True
    supports_offload = True

    candidates: int = knob(128, "the detector's top-k whose keys are fetched and scored exactly (the paper's 4c)")
    rank: int = knob(8, "rank of the per-(layer, KV head) SVD detector")
    controller_signal: str = knob("layer", "'layer': one trigger per layer (f = the layer's refresh); 'heads': one "
                                           "per KV head (f = the fraction of KV heads that refreshed)")
    kept_logits: str = knob("exact", "the kept entries' logits in the candidate ranking: 'exact' (the paper) or "
                                     "'approx' (the detector's, an ablation)")

    def validate(self) -> None:
        self.need(is_int(self.rank) and self.rank >= 1, "rank", "must be an integer >= 1")
        self.need(is_int(self.candidates) and self.candidates >= self.config.selected, "candidates",
                  f"must be an integer >= RCRConfig.selected ({self.config.selected}): candidates are re-scored "
                  "exactly and the top `selected` kept")
        self.need(self.controller_signal in ("layer", "heads"), "controller_signal", "must be 'layer' or 'heads'")
        self.need(self.kept_logits in ("exact", "approx"), "kept_logits", "must be 'exact' or 'approx'")

    def check_model(self, head_dim: int) -> None:
        self.need(self.rank <= head_dim, "rank", f"must be <= the model's head dim ({head_dim})")

    def tau_shape(self, prefix) -> tuple[int, ...]:
        return (prefix.batch_size,)

    def init_state(self, prefix) -> RCRState:
        dets = []
        for layer in range(len(prefix.layers)):
            k_p, _ = prefix.prefix_kv(layer)
            dets.append(Detector.build(k_p, prefix.prefix_valid, self.rank))
        # decided here, outside the (possibly compiled) decode step
        fused = self.config.fused_kernel and prefix.valid.device.type == "cpu" and fused_kernel_available()
        dots = prefix.prefix_valid.sum(-1).float() * (dets[0].rank / prefix.head_dim)
        return RCRState(detectors=dets, tau=self.initial_tau(prefix), detector_dots=dots, fused=fused,
                        tau_factors=self.tau_factors(prefix) if fused else None)

    # the threshold of this layer, and its update: the only differences between rcr, fixed and rcr_layer
    def initial_tau(self, prefix) -> torch.Tensor:
        raise NotImplementedError

    def current_tau(self, state: RCRState, layer: int) -> torch.Tensor:
        return state.tau

    def update_tau(self, state: RCRState, layer: int, f: torch.Tensor) -> None:
        raise NotImplementedError

    def tau_factors(self, prefix) -> torch.Tensor | None:
        """(Hkv + 1, B): row k is the factor ``update_tau`` applies when k of the Hkv KV heads refreshed (f = k / Hkv;
        per layer, 0 or 1), for the fused op (``_decide_op``), which multiplies tau by it. None: the threshold does
        not move."""
        raise NotImplementedError

    def decide(self, ctx: StepContext) -> Decision:
        p, cfg, st, res = ctx.prefix, self.config, ctx.state, ctx.resident
        kept_exact = self.kept_logits == "exact"
        context = cfg.head_reduction == "mean_prob" and cfg.prob_norm == "context"
        if st.fused and res.fused_merge and not ctx.reader.offload and not torch.compiler.is_compiling():
            return self._decide_op(ctx, kept_exact, context)
        det = st.detectors[ctx.layer]
        qg = group_queries(ctx.query, p.n_kv_heads)  # (B, Hkv, G, d)
        padded = res.padded  # masks only where the batch has left padding: otherwise every entry is valid

        # 1. estimated drift: exact on resident slots, approximate on evicted prefix entries. The resident slots'
        # exact logits also rank the kept entries (slots [0, S) hold the selection), and with lse_ev give each query
        # head's normaliser over its whole context
        lg_res = logits(qg, res.resident_keys, p.scaling)  # (B, Hkv, G, n)
        lse_res = masked_lse(lg_res, res.resident_valid) if res.slots_masked else torch.logsumexp(lg_res, dim=-1)
        lse_ev, scores = det.evicted_lse_and_scores(
            qg, res.selection, p.prefix_valid if padded else None, p.scaling, cfg.head_reduction, st.fused,
            kept=lg_res[..., : res.n_selected] if kept_exact else None, lse_res=lse_res if context else None)
        drift_h = torch.sigmoid(lse_ev - lse_res).mean(-1)  # (B, Hkv)
        drift = drift_h.mean(-1)  # (B,)

        # 2. trigger against this sample's threshold
        tau = self.current_tau(st, ctx.layer).clone()  # the threshold of this step: update_tau works in place
        # "heads": (B, Hkv), a refresh per KV head; otherwise (B,), one decision per layer
        trigger = drift_h > tau.unsqueeze(-1) if self.controller_signal == "heads" else drift > tau

        # controller: f is the layer's realised refresh (fraction of KV heads in "heads" mode)
        f = trigger.float().mean(-1) if trigger.dim() == 2 else trigger.float()
        self.update_tau(st, ctx.layer, f)
        common = dict(trigger=trigger, drift=drift, tau=tau, detector_dots=st.detector_dots)

        # 3. candidates: the top C of the prefix ranking (kept entries exact, evicted approximate), exact
        # re-scoring, keep top S
        n_cand = min(self.candidates, p.n_prefix)
        cand = top_sorted(scores, n_cand)  # (B, Hkv, C)
        rows = ctx.reader.fired(trigger, cand)  # offload: host view of the trigger; GPU-only: None
        if rows is not None and not bool(rows.any()):
            return Decision(selection=None, **common)  # offload mode: nothing fired, nothing read
        k_c = ctx.reader.gather(ctx.layer, ctx.step, "keys", cand, rows)  # C key reads
        lg_c = logits(qg, k_c, p.scaling)  # (B, Hkv, G, C)
        cand_valid = None
        if padded:
            cand_valid = torch.gather(p.prefix_valid.unsqueeze(1).expand(*cand.shape[:2], p.n_prefix), 2, cand)
        norm = torch.logaddexp(lse_res, lse_ev) if context else None  # (B, Hkv, G)
        exact = reduce_heads(lg_c, cand_valid, cfg.head_reduction, norm)  # (B, Hkv, C)
        top = top_sorted(exact, res.n_selected)  # positions within the candidates, ascending
        sel = torch.gather(cand, 2, top)  # back to prefix indices, ascending
        keys = gather_heads(k_c, top)  # the selected keys are among the candidates: no second key read
        values = ctx.reader.gather(ctx.layer, ctx.step, "values", sel, rows)  # S value reads
        return Decision(selection=sel, keys=keys, values=values, **common)

    def _decide_op(self, ctx: StepContext, kept_exact: bool, context: bool) -> Decision:
        """The layer-step as one op (rcr/csrc/decide.cpp): steps 1-4 of ``decide`` in plain loops, without the ~100
        torch calls, the candidates only for the rows that fired. In place: the threshold (by ``tau_factors``), the
        merge into the resident layer and, with ``ctx.telemetry``, the telemetry record. The selection of a row that
        did not fire is its current one."""
        p, cfg, st, res = ctx.prefix, self.config, ctx.state, ctx.resident
        det = st.detectors[ctx.layer]
        k_p, v_p = p.prefix_kv(ctx.layer)
        tel = ctx.telemetry
        trigger, drift, tau, sel = torch.ops.rcr.decide(
            ctx.query, det.basis, det.projected_t, res.keys, res.values, res.slot_valid, res.selection, res.n_stored,
            res.slots_masked, p.prefix_valid if res.padded else None, k_p, v_p, self.current_tau(st, ctx.layer),
            st.tau_factors, p.scaling, cfg.head_reduction == "mean_prob",
            self.controller_signal == "heads", self.candidates, kept_exact, context,
            None if tel is None else tel.decisions, ctx.layer, ctx.step, st.detector_dots)
        return Decision(selection=sel, trigger=trigger, drift=drift, tau=tau, detector_dots=st.detector_dots,
                        merged=True, recorded=tel is not None)

    def cost_model(self, prefix, state) -> dict:
        return {"keys_per_refresh": min(self.candidates, prefix.n_prefix),
                "values_per_refresh": self.n_selected(prefix)}


@dataclass
class RCR(DriftRefresh):
    """One threshold per sample, shared by its layers, moved toward the target refresh fraction after every layer
    (``rcr.controller``)."""

    name = "rcr"

    tau0: float = knob(0.03, "the threshold at the start of every sample's decode")
    step: float = knob(0.05, "the controller's step: tau <- tau * exp(step * (f - rho))")
    rho: float = knob(0.4, "the target refresh fraction")

    def validate(self) -> None:
        super().validate()
        self.need(is_number(self.tau0) and self.tau0 > 0.0, "tau0", "must be > 0 (the controller is multiplicative)")
        self.need(is_number(self.step) and self.step > 0.0, "step", "must be > 0")
        self.need(is_number(self.rho) and 0.0 < self.rho < 1.0, "rho", "target refresh fraction must be in (0, 1)")

    @property
    def controller(self) -> RateController:
        return RateController(tau0=self.tau0, step=self.step, rho=self.rho)

    def initial_tau(self, prefix) -> torch.Tensor:
        return self.controller.init(self.tau_shape(prefix), prefix.valid.device)

    def update_tau(self, state: RCRState, layer: int, f: torch.Tensor) -> None:
        state.tau.copy_(self.controller.update(state.tau, f))  # in place: a fixed address (CUDA graphs)

    def tau_factors(self, prefix) -> torch.Tensor:
        """Each row by the controller's own ops on a (B,) tensor, as ``update_tau`` computes it: tau times row k is
        the torch path's tau to the bit (tau * exp(step * (f - rho)), and 1 * exp(...) is exp(...) exactly). Per
        layer thresholds (``rcr_layer``) move by the same law, so they share these factors."""
        B, H, dev = prefix.batch_size, prefix.n_kv_heads, prefix.valid.device
        f = torch.arange(H + 1, dtype=torch.float32) / H  # = the mean over KV heads of the float trigger
        return torch.stack([self.controller.update(torch.ones(B, device=dev), torch.full((B,), float(fk), device=dev))
                            for fk in f])


@dataclass
class Fixed(DriftRefresh):
    """Drift-triggered refresh with a constant threshold (the sweep label ``fixed@0.05`` sets it)."""

    name = "fixed"
    shorthand = "tau"

    tau: float = knob(0.03, "the constant threshold (the paper's tercile analysis uses 0.03)")

    def validate(self) -> None:
        super().validate()
        self.need(is_number(self.tau) and self.tau >= 0.0, "tau", "must be a number >= 0")

    def initial_tau(self, prefix) -> torch.Tensor:
        return torch.full(self.tau_shape(prefix), float(self.tau), device=prefix.valid.device)

    def update_tau(self, state, layer, f) -> None:
        pass

    def tau_factors(self, prefix) -> None:
        return None  # the threshold does not move
