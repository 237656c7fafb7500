"""RCR mechanics: masked merge vs a branching reference, refresh layout, controller, counters,
drift estimate quality, BACON against an independent float64 reference, config validation."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

import rcr
from rcr.bacon_score import bacon_layer_scores
from rcr.controller import RateController
from rcr.generate import build_cache
from rcr.methods import RCR, parse_method
from rcr.methods.exact import Exact
from tests import tiny_models
from tests.methods import Scale

# Every method test runs over the registry: a method added to it is covered automatically.
ALL_METHODS = list(rcr.METHODS)
SMALL = Scale(rcr.RCRConfig(selected=8, window=8), candidates=32, tau0=0.3)


@pytest.fixture(scope="module")
def qwen_prefix():
    """A left-padded batch of 2 on the tiny Qwen2-VL with 64 visual tokens per image."""
    model, proc = tiny_models.qwen2_vl()
    inputs = tiny_models.batch_inputs(proc, [4, 20], image_size=224)
    return model, inputs, rcr.prefill(model, inputs, SMALL.config)


@dataclass
class BranchingRCR(RCR):
    """Reference merge that branches in Python per sample (host syncs), written independently of
    ResidentLayer.refresh."""

    def merge(self, resident, d):
        S = resident.n_selected
        k_p, v_p = resident.prefix.prefix_kv(resident.layer_idx)
        valid = resident.prefix.prefix_valid
        for b in range(d.trigger.shape[0]):
            if bool(d.trigger[b]):
                for h in range(k_p.shape[1]):
                    idx = d.selection[b, h]
                    resident.keys[b, h, :S] = k_p[b, h, idx]
                    resident.values[b, h, :S] = v_p[b, h, idx]
                    resident.slot_valid[b, h, :S] = valid[b, idx]
                    resident.selection[b, h] = idx


def test_masked_merge_equals_python_branching_reference(qwen_prefix):
    model, inputs, prefix = qwen_prefix
    n = 24
    ref = rcr.decode(model, prefix, BranchingRCR(config=SMALL.config, candidates=32, tau0=0.3), n, eos_token_id=[])
    got = rcr.generate(model, inputs, method=SMALL.method("rcr"), max_new_tokens=n, ignore_eos=True)
    trig = got.telemetry.trigger
    assert 0.05 < trig.mean() < 0.95, "the sample must trigger at some layer-steps and not at others"
    assert torch.equal(got.sequences, ref.sequences)
    np.testing.assert_array_equal(trig, ref.telemetry.trigger)
    np.testing.assert_array_equal(got.telemetry.tau, ref.telemetry.tau)


@dataclass
class CheckingRCR(RCR):
    """Asserts, at every real refresh, that only the selected slots change."""

    refreshes: int = 0

    def merge(self, resident, d):
        S = resident.n_selected
        before_k = resident.resident_keys.clone()
        before_v = resident.resident_values.clone()
        super().merge(resident, d)
        assert torch.equal(resident.resident_keys[:, :, S:], before_k[:, :, S:])  # window + generated: bitwise
        assert torch.equal(resident.resident_values[:, :, S:], before_v[:, :, S:])
        k_p, v_p = resident.prefix.prefix_kv(resident.layer_idx)
        for b in range(d.trigger.shape[0]):
            if bool(d.trigger[b]):
                self.refreshes += 1
                sel = d.selection[b]
                expect = torch.stack([k_p[b, h, sel[h]] for h in range(sel.shape[0])])
                assert torch.equal(resident.keys[b, :, :S], expect)  # copied as stored: no re-RoPE
            else:
                assert torch.equal(resident.keys[b, :, :S], before_k[b, :, :S])


def test_refresh_rewrites_only_selected_slots(qwen_prefix):
    model, _, prefix = qwen_prefix
    m = CheckingRCR(config=SMALL.config, candidates=32, tau0=0.3)
    rcr.decode(model, prefix, m, 12, eos_token_id=[])
    assert m.refreshes > 0


@dataclass
class RecordingExact(Exact):
    """Exact re-selection that keeps what each decision saw and chose."""

    def __post_init__(self):
        super().__post_init__()
        self.seen = []

    def decide(self, ctx):
        d = super().decide(ctx)
        res, S = ctx.resident, ctx.resident.n_selected  # the window and generated slots, after the selected ones
        self.seen.append((ctx.layer, ctx.query.detach().double().clone(), d.selection.clone(),
                          res.resident_keys[:, :, S:].double().clone(), res.resident_valid[:, :, S:].clone()))
        return d


@pytest.mark.parametrize("norm", ["context", "scored"])
def test_exact_selects_the_top_entries_of_the_current_attention(qwen_prefix, norm):
    """`exact`'s selection at every layer-step == the top-S prefix entries by the step's own attention,
    recomputed here in float64: exp(q.k / sqrt(d)) per query head, normalised over its whole context (the valid
    prefix, window and generated tokens; ``scored``: over the valid prefix), averaged over the query heads that share
    the KV head (the default head_reduction, mean_prob)."""
    model, _, prefix = qwen_prefix
    m = RecordingExact(config=SMALL.config.replace(prob_norm=norm))
    rcr.decode(model, prefix, m, 6, eos_token_id=[])
    assert len(m.seen) == 5 * len(prefix.layers)  # the first of the 6 tokens comes from the prefill
    valid = prefix.prefix_valid.cpu().numpy()  # (B, Np)
    S = SMALL.config.selected
    for layer, q, sel, rest, rest_valid in m.seen:
        k = prefix.prefix_kv(layer)[0].double().cpu().numpy()  # (B, Hkv, Np, d)
        B, Hkv, Np, d = k.shape
        q = q.cpu().numpy()[:, :, 0]  # (B, Hq, d)
        G = q.shape[1] // Hkv
        for b in range(B):
            for h in range(Hkv):
                qh = q[b, h * G:(h + 1) * G]
                logit = qh @ k[b, h].T / np.sqrt(d)  # (G, Np)
                logit[:, ~valid[b]] = -np.inf
                context = logit
                if norm == "context":
                    lr = qh @ rest[b, h].numpy().T / np.sqrt(d)  # (G, n - S)
                    context = np.concatenate([logit, np.where(rest_valid[b, h].numpy(), lr, -np.inf)], 1)
                m_ = context.max(1, keepdims=True)
                prob = (np.exp(logit - m_) / np.exp(context - m_).sum(1, keepdims=True)).mean(0)
                want = set(np.argsort(-prob, kind="stable")[:S].tolist())
                assert set(sel[b, h].tolist()) == want, (layer, b, h)


def test_rate_controller_tracks_quantile():
    rng = np.random.default_rng(0)
    ctl = RateController(tau0=0.03, step=0.05, rho=0.4)
    drift = torch.tensor(rng.beta(2.0, 40.0, size=2000), dtype=torch.float32)  # realistic drift scale
    q = float(np.quantile(rng.beta(2.0, 40.0, size=1_000_000), 1 - ctl.rho))
    tau = ctl.init((1,), "cpu")
    taus, trig = [], []
    for d in drift:
        f = d > tau
        trig.append(float(f))
        taus.append(float(tau))
        tau = ctl.update(tau, f)
    assert abs(np.mean(trig) - ctl.rho) <= 0.02
    settled = np.exp(np.mean(np.log(taus[1000:])))
    assert abs(settled / q - 1) < 0.1, (settled, q)


def test_rcr_tau_follows_controller_in_layer_order(qwen_prefix):
    """tau is one value per sample, carried layer to layer and step to step."""
    model, _, prefix = qwen_prefix
    rcr_ = SMALL.method("rcr")
    r = rcr.decode(model, prefix, rcr_, 10, eos_token_id=[])
    tau = r.telemetry.tau[0].T.ravel()  # (steps * layers) in execution order
    trig = r.telemetry.trigger[0].T.ravel()
    expect = tau[:-1] * np.exp(rcr_.step * (trig[:-1] - rcr_.rho))
    np.testing.assert_allclose(tau[1:], expect, rtol=1e-5)
    assert tau[0] == pytest.approx(rcr_.tau0)


def test_counters_and_detector_storage():
    model, proc = tiny_models.qwen2_vl()
    inputs = tiny_models.batch_inputs(proc, [4], image_size=448)  # 256 visual tokens: Np > 128
    cfg = rcr.RCRConfig()  # paper sizes: 32 selected, 32 window, 128 candidates, rank 8
    prefix = rcr.prefill(model, inputs, cfg)
    probe = rcr.decode(model, prefix, parse_method("rcr", cfg), 8, eos_token_id=[])
    assert prefix.n_prefix > 128
    method = RCR(config=cfg, tau0=float(np.median(probe.telemetry.drift)))  # start at this sample's drift scale
    state = method.init_state(prefix)
    for det in state.detectors:  # detector storage: Np x rank per KV head (plus the d x rank basis)
        assert det.projected.shape == (1, prefix.n_kv_heads, prefix.n_prefix, 8)
    r = rcr.decode(model, prefix, method, 8, eos_token_id=[])
    tel = r.telemetry
    fired = tel.trigger == 1
    assert fired.any() and (~fired).any()
    assert (tel.keys_read[fired] == 128).all() and (tel.values_read[fired] == 32).all()
    assert (tel.keys_read[~fired] == 0).all() and (tel.values_read[~fired] == 0).all()
    np.testing.assert_allclose(tel.detector_dots, prefix.n_prefix * 8 / prefix.head_dim)
    assert r.cost == {"keys_per_refresh": 128, "values_per_refresh": 32}


def test_estimated_drift_tracks_exact_drift(qwen_prefix):
    model, _, prefix = qwen_prefix
    r = rcr.decode(model, prefix, SMALL.replace(exact_drift=True).method("rcr"), 24, eos_token_id=[])
    est, exact = r.telemetry.drift.ravel(), r.telemetry.drift_exact.ravel()
    assert np.isfinite(est).all() and np.isfinite(exact).all()
    assert spearmanr(est, exact).statistic >= 0.8


# ----------------------------------------------------------------------------- BACON vs a float64 reference

def _pool_ref(x, k=5):
    pad = k // 2
    xp = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)])
    return np.stack([xp[..., i:i + k].sum(-1) / k for i in range(x.shape[-1])], -1)


def bacon_reference(qs, ks, capacity, w):
    """BACON (docs/algorithms.md, "bacon") written directly in numpy float64, layer by layer. Returns the
    top-`capacity` index set per layer and KV head."""
    out, E_hist = [], []
    for q, k in zip(qs, ks):
        hq, _, d = q.shape
        hkv, n, _ = k.shape
        g, t = hq // hkv, n - w
        kr = np.repeat(k, g, axis=0)
        a = np.einsum("hwd,hnd->hwn", q, kr) / np.sqrt(d)
        for i in range(w):  # causal inside the last w x w block
            a[:, i, t + i + 1:] = -np.inf
        a = np.exp(a - a.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        B = _pool_ref(a[:, :, :t].mean(1).reshape(hkv, g, t).mean(1))
        Q = _pool_ref(a[:, -1, :t].reshape(hkv, g, t).mean(1))
        E = np.maximum(Q - B, 0)
        L = _pool_ref(E)
        prev = [e for e in E_hist[-4:] if e.shape == E.shape]
        T = np.mean(prev, 0) if prev else 0.0
        V = E + L + T
        kk = min(2 * capacity, t)
        tb, tv = -np.sort(-B, -1)[:, :kk], -np.sort(-V, -1)[:, :kk]
        lam = 0.5 * tb.std(-1) / (tv.std(-1) + 1e-8)
        lam = lam * np.clip(tv.mean(-1) / (tb.mean(-1) + 1e-8), 0, 1)
        S = B + lam[:, None] * V
        out.append([set(np.argsort(-S[h])[:capacity].tolist()) for h in range(hkv)])
        E_hist.append(E)
    return out


def test_bacon_matches_float64_reference():
    rng = np.random.default_rng(1)
    hq, hkv, d, n, w, cap = 4, 2, 16, 60, 8, 6
    qs = [rng.normal(size=(hq, w, d)) * 2 for _ in range(7)]
    ks = [rng.normal(size=(hkv, n, d)) * 2 for _ in range(7)]
    ref = bacon_reference(qs, ks, cap, w)
    trace = []
    for layer, (q, k) in enumerate(zip(qs, ks)):
        s, e = bacon_layer_scores(torch.tensor(q), torch.tensor(k), d ** -0.5, cap, trace, rcr.RCRConfig())
        trace.append(e)
        got = [set(torch.topk(s[h], cap).indices.tolist()) for h in range(hkv)]
        assert got == ref[layer], f"layer {layer}"


def test_bacon_selection_of_a_sample_does_not_depend_on_its_batch():
    model, proc = tiny_models.qwen2_vl()
    words = [3, 30, 12]
    batch = tiny_models.batch_inputs(proc, words, image_size=224)
    pb = rcr.prefill(model, batch, SMALL.config)
    sel_b = build_cache(SMALL.method("bacon"), pb, 1)
    for i, nw in enumerate(words):
        alone = tiny_models.batch_inputs(proc, [nw], image_size=224, seed=i)
        pa = rcr.prefill(model, alone, SMALL.config)
        sel_a = build_cache(SMALL.method("bacon"), pa, 1)
        pad = int(pb.pad[i])
        for lb, la in zip(sel_b.layers, sel_a.layers):
            assert torch.equal(lb.selection[i] - pad, la.selection[0])


# ------------------------------------------------------------------------------------- config validation

@pytest.mark.parametrize("field,value", [
    ("selected", -1), ("window", -2), ("bacon_kernel", 4), ("head_reduction", "sum"), ("prob_norm", "prefix"),
    ("eos_check_every", 0), ("offload", "yes"),
])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(rcr.ConfigError) as e:
        rcr.RCRConfig(**{field: value})
    assert e.value.field == f"RCRConfig.{field}" and f"field 'RCRConfig.{field}'" in str(e.value)


@pytest.mark.parametrize("label,field", [
    ("rcr@rho=0.0", "rcr.rho"), ("rcr@rho=1.0", "rcr.rho"), ("rcr_layer@rho=1.5", "rcr_layer.rho"),
    ("rcr@candidates=16", "rcr.candidates"), ("fixed@rank=0", "fixed.rank"), ("rcr@tau0=0.0", "rcr.tau0"),
    ("rcr@step=-0.1", "rcr.step"), ("fixed@controller_signal=mean", "fixed.controller_signal"),
    ("rcr@kept_logits=exact_all", "rcr.kept_logits"), ("fixed@-0.1", "fixed.tau"),
])
def test_bad_knob_names_the_method_and_field(label, field):
    """A method's own knob is checked by the method, and the error names ``<method>.<knob>``."""
    with pytest.raises(rcr.ConfigError) as e:
        parse_method(label)
    assert e.value.field == field


@pytest.mark.parametrize("label,says", [
    ("rcr@nope=1", "rcr has no field 'nope'; its fields: candidates"), ("fixed@x", "fixed.tau must be float"),
    ("quest@0.5", "expected FIELD=VALUE"), ("rcr@", "nothing after '@'"), ("rcr@rho=0.3,rho=0.2", "given twice"),
    ("nosuch@rho=1", "unknown method"),
])
def test_a_bad_label_is_one_line_naming_it(label, says):
    with pytest.raises(rcr.ConfigError) as e:
        parse_method(label)
    assert e.value.field == "method" and label in str(e.value) and says in str(e.value)
    assert "\n" not in str(e.value)


def test_a_label_sets_its_methods_knobs_and_nothing_else():
    m = parse_method("rcr@rho=0.3,step=0.1,kept_logits=approx,controller_signal=heads")
    assert (m.rho, m.step, m.kept_logits, m.controller_signal, m.label) == (
        0.3, 0.1, "approx", "heads", "rcr@rho=0.3,step=0.1,kept_logits=approx,controller_signal=heads")
    assert (m.tau0, m.candidates, m.rank) == (0.03, 128, 8)  # the paper's defaults
    assert parse_method("fixed@0.05").tau == parse_method("fixed@tau=0.05").tau == 0.05
    assert parse_method("infinigen@calibration=none").calibration is None
    assert parse_method("prefill_oracle@pool=true").pool is True
    assert parse_method("rcr@rho=0.3", rcr.RCRConfig(selected=16)).config.selected == 16


def test_compile_field_is_validated():
    with pytest.raises(rcr.ConfigError, match="compile"):
        rcr.RCRConfig(compile="fast")
    with pytest.raises(rcr.ConfigError, match="compile"):
        rcr.RCRConfig(compile="reduce-overhead", offload=True)


def test_unknown_method_and_rank_over_head_dim_fail_before_model_work(monkeypatch):
    model, proc = tiny_models.qwen2_vl()
    inputs = tiny_models.batch_inputs(proc, [4])
    calls = []
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(rcr.ConfigError, match="nosuch"):
        rcr.generate(model, inputs, method=["rcr", "nosuch"])
    with pytest.raises(rcr.ConfigError, match="rank"):
        rcr.generate(model, inputs, method="rcr@rank=64")  # head_dim is 32
    with pytest.raises(rcr.ConfigError, match="fixed@x"):
        rcr.generate(model, inputs, method="fixed@x")
    assert not calls


# ---------------------------------------------------------------------------------- prefill once, decode many

def test_one_prefill_serves_every_method_and_no_method_alters_the_prefix_store():
    model, proc = tiny_models.qwen2_vl()
    inputs = tiny_models.batch_inputs(proc, [4, 9], image_size=224)
    vision_calls = []
    handle = model.model.visual.register_forward_hook(lambda *a: vision_calls.append(1))
    try:
        res = rcr.generate(model, inputs, method=SMALL.methods(ALL_METHODS), max_new_tokens=6, ignore_eos=True)
    finally:
        handle.remove()
    assert len(vision_calls) == 1, "the vision tower must run once for all methods"
    assert set(res) == set(ALL_METHODS)

    prefix = rcr.prefill(model, inputs, SMALL.config)
    snap = [(pl.keys.clone(), pl.values.clone(), pl.window_queries.clone()) for pl in prefix.layers]
    full = rcr.decode(model, prefix, SMALL.method("full"), 6, eos_token_id=[])
    ref = rcr.answer_attention_scores(model, prefix, full)
    for label in ALL_METHODS:
        rcr.decode(model, prefix, SMALL.method(label), 6, eos_token_id=[], reference_scores=ref)
    for (k, v, q), pl in zip(snap, prefix.layers):
        assert torch.equal(k, pl.keys) and torch.equal(v, pl.values) and torch.equal(q, pl.window_queries)


def test_record_attention_gives_most_attended_position_on_full_only(qwen_prefix):
    model, inputs, _ = qwen_prefix
    cfg = SMALL.replace(record_attention=True)
    res = rcr.generate(model, inputs, method=cfg.methods(["full", "rcr"]), max_new_tokens=6, ignore_eos=True)
    assert res["rcr"].telemetry.top_prefix_pos is None
    pos = res["full"].telemetry.top_prefix_pos  # (B, L, T), in each sample's own coordinates
    for b in range(pos.shape[0]):
        n_b = res["full"].prefix_len[b]
        assert (pos[b] >= 0).all() and (pos[b] < n_b).all()
