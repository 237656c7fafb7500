"""The lean rcr decision makes exactly the decisions of a plain composed statement of it.

``reference_decide`` and ``reference_refresh`` below state the decision and the masked merge the way the
implementation did before the fast path (full-length masked copies, a separate log-sum-exp, ``torch.gather`` with
an index expanded over d, out-of-place merge), with the ranking of docs/algorithms.md, "rcr": kept entries by their
exact logits, each query head's probability under its context (``kept_logits`` and ``prob_norm`` select the
ablations). At every layer-step of real decodes, with and without left padding, for ``rcr``, ``fixed`` and
``rcr_layer``, the current ``decide`` and the reference run on the same state: triggers, selections, taus, keys and
values must be identical, and the drift equal to rounding. End to end, a decode with the reference decision and
merge gives identical tokens, triggers, taus and resident caches. (tests/rcr/test_rcr_reference.py holds the
step to a loop-by-loop reference on random inputs.)
"""

import copy
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

import rcr
import rcr.fused
from rcr.methods import Decision
from rcr.methods.knobs import knob_fields
from tests import tiny_models
from tests.methods import Scale

NEG_INF = float("-inf")
SMALL = Scale(rcr.RCRConfig(selected=8, window=8), candidates=32, tau0=0.3)


# ------------------------------------------------------------------------ frozen reference implementation

def _gather_heads(x, idx):
    return torch.gather(x, 2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))


def _logits(qg, keys, scaling):
    return torch.einsum("bhgd,bhmd->bhgm", qg.float(), keys.float()) * scaling


def _reduce_heads(lg, valid, how, norm=None):
    mask = valid.unsqueeze(2)
    lg = lg.masked_fill(~mask, NEG_INF)
    if how == "mean_prob":
        p = torch.softmax(lg, dim=-1) if norm is None else torch.exp(lg - norm.unsqueeze(-1))
        scores = p.nan_to_num(0.0).mean(dim=2)
    else:
        scores = lg.max(dim=2).values
    return scores.masked_fill(~valid.expand_as(scores), NEG_INF)


def _top_sorted(scores, k):
    return torch.topk(scores, k, dim=-1).indices.sort(dim=-1).values


def _masked_lse(lg, valid):
    return torch.logsumexp(lg.masked_fill(~valid.unsqueeze(2), NEG_INF), dim=-1)


def _evicted_mask(res):
    B, H = res.selection.shape[:2]
    in_sel = torch.zeros(B, H, res.prefix.n_prefix, dtype=torch.bool, device=res.selection.device)
    in_sel.scatter_(2, res.selection, True)
    return res.prefix.prefix_valid.unsqueeze(1) & ~in_sel


def reference_decide(method, ctx) -> Decision:
    p, cfg, st, res = ctx.prefix, method.config, ctx.state, ctx.resident
    det = st.detectors[ctx.layer]
    B, Hq, _, d = ctx.query.shape
    qg = ctx.query.view(B, p.n_kv_heads, Hq // p.n_kv_heads, d)
    valid_p = p.prefix_valid.unsqueeze(1)
    lg_res = _logits(qg, res.resident_keys, p.scaling)
    lse_res = _masked_lse(lg_res, res.resident_valid)
    basis, projected = det.basis, det.projected  # (B, Hkv, d, r), (B, Hkv, Np, r)
    qr = torch.einsum("bhgd,bhdr->bhgr", qg.float(), basis)
    approx = torch.einsum("bhgr,bhnr->bhgn", qr, projected) * p.scaling
    lse_ev = _masked_lse(approx, _evicted_mask(res))
    drift_h = torch.sigmoid(lse_ev - lse_res).mean(-1)
    drift = drift_h.mean(-1)
    tau = method.current_tau(st, ctx.layer).clone()  # (the update is in place now; the values are the same)
    trigger = drift_h > tau.unsqueeze(-1) if method.controller_signal == "heads" else drift > tau
    f = trigger.float().mean(-1) if trigger.dim() == 2 else trigger.float()
    method.update_tau(st, ctx.layer, f)
    n_cand = min(method.candidates, p.n_prefix)
    ranked = approx.clone()  # kept entries by their exact logits (the resident slots [0, S)), evicted approximate
    if method.kept_logits == "exact":
        S = res.n_selected
        ranked.scatter_(3, res.selection.unsqueeze(2).expand(B, p.n_kv_heads, Hq // p.n_kv_heads, S), lg_res[..., :S])
    norm = torch.logaddexp(lse_res, lse_ev) if cfg.prob_norm == "context" else None  # the context's normaliser
    cand = _top_sorted(_reduce_heads(ranked, valid_p, cfg.head_reduction, norm), n_cand)
    k_p, v_p = p.prefix_kv(ctx.layer)
    k_c = _gather_heads(k_p, cand)
    cand_valid = torch.gather(valid_p.expand(*cand.shape[:2], p.n_prefix), 2, cand)
    exact = _reduce_heads(_logits(qg, k_c, p.scaling), cand_valid, cfg.head_reduction, norm)
    top = _top_sorted(exact, res.n_selected)
    sel = torch.gather(cand, 2, top)
    return Decision(trigger=trigger, selection=sel, keys=_gather_heads(k_c, top), values=_gather_heads(v_p, sel),
                    drift=drift, tau=tau)


def snapshot(res) -> dict:
    return {name: getattr(res, name).clone() for name in ("keys", "values", "slot_valid", "selection")}


def restore(res, state: dict) -> None:
    for name, t in state.items():
        getattr(res, name).copy_(t)


def reference_refresh(res, trigger, selection, keys, values) -> None:
    S = res.n_selected
    B, H = selection.shape[:2]
    t = trigger.view(B, -1, 1)
    new_valid = torch.gather(res.prefix.prefix_valid.unsqueeze(1).expand(B, H, -1), 2, selection)
    res.keys[:, :, :S] = torch.where(t.unsqueeze(-1), keys, res.keys[:, :, :S])
    res.values[:, :, :S] = torch.where(t.unsqueeze(-1), values, res.values[:, :, :S])
    res.slot_valid[:, :, :S] = torch.where(t, new_valid, res.slot_valid[:, :, :S])
    res.selection = torch.where(t, selection, res.selection)


# ------------------------------------------------------------------------------------------------- tests

def knobs_of(m) -> dict:
    return {f.name: getattr(m, f.name) for f in knob_fields(type(m)).values()}


def twin(label, scale):
    """The method of ``label`` whose every decision is checked against the reference on the same state."""
    made = scale.method(label)
    base = type(made)

    @dataclass
    class Twin(base):
        checked: int = 0
        fired: int = 0

        def decide(self, ctx):
            st, res = ctx.state, ctx.resident
            assert st.fused is rcr.fused.available()  # on CPU, the fused ops' decisions are the ones checked
            before, tau_before = snapshot(res), st.tau.clone()
            got = super().decide(ctx)
            after, tau_got = snapshot(res), st.tau.clone()
            restore(res, before)  # the reference decides on the state the method saw
            st.tau = tau_before
            want = reference_decide(self, ctx)
            assert torch.equal(st.tau, tau_got), "tau update"
            assert torch.equal(got.trigger, want.trigger), "trigger"
            assert torch.equal(got.tau, want.tau)
            B, H = want.selection.shape[:2]
            rows = want.trigger.view(B, -1).expand(B, H)
            assert torch.equal(got.selection[rows], want.selection[rows]), "selection where fired"
            torch.testing.assert_close(got.drift, want.drift, rtol=1e-5, atol=1e-7)
            if st.fused:
                # on CPU the layer-step is one op (rcr::decide): it re-selects only the rows that fired (the others
                # keep their selection), merges them into the resident layer and records the decision
                assert got.merged and got.recorded and got.keys is None and got.values is None
                assert torch.equal(got.selection[~rows], before["selection"][~rows]), "a row that did not fire"
                reference_refresh(res, want.trigger, want.selection, want.keys, want.values)
                for name, t in after.items():
                    assert torch.equal(getattr(res, name), t), f"merge: {name}"
                tel = copy.copy(ctx.telemetry)  # the record, against Telemetry.record_decision of the same decision
                tel.decisions = torch.zeros_like(tel.decisions)
                tel.record_decision(ctx.layer, ctx.step, replace(got, recorded=False), self.cost_model(ctx.prefix, st))
                at = (slice(None), slice(None), ctx.layer, ctx.step)
                torch.testing.assert_close(ctx.telemetry.decisions[at], tel.decisions[at], rtol=0, atol=0,
                                           equal_nan=True, msg="telemetry")  # bit for bit; NaN where RCR has none
            else:
                assert torch.equal(got.selection, want.selection), "selection"
                assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values), "keys/values"
            self.checked += 1
            self.fired += int(got.trigger.sum())
            return got

    return Twin(config=made.config, label=label, **knobs_of(made))


@dataclass
class ReferenceMixin:
    def decide(self, ctx):
        return reference_decide(self, ctx)

    def merge(self, resident, d):
        reference_refresh(resident, d.trigger, d.selection, d.keys, d.values)


@pytest.fixture(scope="module")
def prefixes():
    model, proc = tiny_models.qwen2_vl()
    padded = tiny_models.batch_inputs(proc, [4, 20, 11], image_size=224)
    single = tiny_models.batch_inputs(proc, [9], image_size=224, seed=3)
    assert not padded["attention_mask"].bool().all() and single["attention_mask"].bool().all()
    out = {}
    for name, inputs in (("padded", padded), ("unpadded", single)):
        prefix = rcr.prefill(model, inputs, SMALL.config)
        probe = rcr.decode(model, prefix, SMALL.method("rcr"), 8, eos_token_id=[])
        # thresholds start at this batch's median drift, so that triggers fire at some layer-steps and not at others
        med = float(np.median(probe.telemetry.drift))
        out[name] = (prefix, SMALL.replace(tau=med, tau0=med))
    return model, out


@pytest.mark.parametrize("batch", ["padded", "unpadded"])
@pytest.mark.parametrize("label", ["rcr", "fixed", "rcr_layer"])
@pytest.mark.parametrize("variant", [{}, {"controller_signal": "heads"}, {"head_reduction": "max_logit"},
                                     {"kept_logits": "approx", "prob_norm": "scored"}],
                         ids=["default", "per_head_trigger", "max_logit", "ablated_ranking"])
def test_every_decision_equals_the_reference(prefixes, batch, label, variant):
    model, (prefix, cfg) = prefixes[0], prefixes[1][batch]
    m = twin(label, cfg.replace(**variant))
    n = 16
    rcr.decode(model, prefix, m, n, eos_token_id=[])
    assert m.checked == (n - 1) * len(prefix.layers)
    total = m.checked * prefix.batch_size * (prefix.n_kv_heads if variant.get("controller_signal") else 1)
    assert 0 < m.fired < total, "triggers must fire at some layer-steps and not at others"


@pytest.mark.parametrize("batch", ["padded", "unpadded"])
@pytest.mark.parametrize("label", ["rcr", "fixed", "rcr_layer"])
def test_decode_equals_the_reference_decode(prefixes, batch, label):
    model, (prefix, cfg) = prefixes[0], prefixes[1][batch]
    made = cfg.method(label)
    ref_cls = dataclass(type("Reference", (ReferenceMixin, type(made)), {}))
    n = 20
    got_dec = rcr.Decoder(model, prefix, made, n, eos_token_id=[])
    ref_dec = rcr.Decoder(model, prefix, ref_cls(config=made.config, label=label, **knobs_of(made)), n, eos_token_id=[])
    assert all(layer.fused_merge is rcr.fused.available() for layer in got_dec.cache.layers)  # rcr::merge_rows
    for dec in (got_dec, ref_dec):
        dec.run()
    assert torch.equal(got_dec.tokens, ref_dec.tokens)
    got, ref = got_dec.tel.to_host(), ref_dec.tel.to_host()
    assert (got.trigger == ref.trigger).all() and (got.tau == ref.tau).all()
    assert 0 < got.trigger.mean() < 1
    for a, b in zip(got_dec.cache.layers, ref_dec.cache.layers):
        assert torch.equal(a.selection, b.selection)
        assert torch.equal(a.resident_keys, b.resident_keys) and torch.equal(a.resident_values, b.resident_values)
        assert torch.equal(a.resident_valid, b.resident_valid)
