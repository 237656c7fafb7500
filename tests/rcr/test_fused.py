"""rcr.fused: RCR's pass over the detector logits as one C++ kernel on CPU gives what the composed torch ops
give (the path of every other device), and both give the textbook definition: the log-sum-exp of the approximate
logits over the evicted valid entries, and the candidate scores over the prefix ranked with the kept entries' exact
logits (or all approximate, the ablation), normalised by the context's estimate (or the prefix's softmax). The merge
as row copies equals the masked torch merge. End to end, a decode with the ops (the kernel, the whole-decision op
and the merge) makes the same decisions as one without them; tests/rcr/test_rcr_reference.py and
tests/rcr/test_rcr_decision.py check every decision against references."""

import copy
import warnings

import pytest
import torch

import rcr
import rcr.fused as F
from rcr.cache import ResidentLayer
from rcr.detector import Detector
from rcr.methods import parse_method
from tests import tiny_models
from tests.methods import Scale

NEG_INF = float("-inf")


def definition(qg, det, selection, valid, scaling, how, kept=None, lse_res=None):
    approx = det.approx_logits(qg, scaling)  # (B, H, G, Np)
    B, H, G, Np = approx.shape
    v = torch.ones(B, Np, dtype=torch.bool) if valid is None else valid
    evicted = v[:, None, :].expand(B, H, Np).clone()
    evicted.scatter_(2, selection, False)
    lse_ev = torch.logsumexp(approx.masked_fill(~evicted[:, :, None], NEG_INF), -1)
    lg = approx.clone()
    if kept is not None:  # the kept entries by their exact logits
        for b in range(B):
            for h in range(H):
                lg[b, h][:, selection[b, h]] = kept[b, h]
    lg = lg.masked_fill(~v[:, None, None], NEG_INF)
    if how == "max_logit":
        scores = lg.amax(2)
    elif lse_res is None:
        scores = torch.softmax(lg, -1).nan_to_num(0.0).mean(2)
    else:  # each head's probability under its context's normaliser
        scores = torch.exp(lg - torch.logaddexp(lse_res, lse_ev).unsqueeze(-1)).nan_to_num(0.0).mean(2)
    return lse_ev, scores.masked_fill(~v[:, None], NEG_INF)


def case(n_prefix, padded, seed=0, B=3, H=2, G=5, d=16, r=4, S=6, all_resident=False):
    """Random post-RoPE-like keys and queries; with ``padded``: sample 1 has 10 left-padding entries and sample 2
    none valid (a batch row with no prefix)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, n_prefix, d, generator=g) * 2.0
    qg = torch.randn(B, H, G, d, generator=g)
    valid = torch.ones(B, n_prefix, dtype=torch.bool)
    if padded:
        valid[1, :10] = False
        valid[2] = False
    det = Detector.build(keys, valid, r)
    if all_resident:
        selection = torch.arange(n_prefix).expand(B, H, n_prefix).contiguous()
    else:  # S distinct valid entries per (sample, head)
        selection = torch.stack([torch.stack([torch.randperm(n_prefix - 10, generator=g)[:S] + 10 for _ in range(H)])
                                 for _ in range(B)]).sort(-1).values
    return qg, det, selection, (valid if padded else None)


def ranking_inputs(qg, det, selection, scaling, ranking):
    """kept (B, H, G, S) and lse_res (B, H, G) for a ranking variant: "paper" (kept exact, context normaliser),
    "kept_exact" (the prefix's softmax), "approx" (neither). The kept logits differ from the approximate ones by a
    few units, as exact logits do; lse_res covers them and more, as the resident slots' log-sum-exp does."""
    if ranking == "approx":
        return None, None
    g = torch.Generator().manual_seed(1)
    approx = det.approx_logits(qg, scaling)
    kept = torch.gather(approx, 3, selection.unsqueeze(2).expand(*selection.shape[:2], approx.shape[2], -1))
    kept = kept + 3.0 * torch.randn(kept.shape, generator=g)
    lse_res = torch.logaddexp(torch.logsumexp(kept, -1), 2.0 * torch.randn(kept.shape[:3], generator=g))
    return kept, (lse_res if ranking == "paper" else None)


@pytest.mark.skipif(not F.available(), reason="the fused kernel could not be built here")
@pytest.mark.parametrize("ranking", ["paper", "kept_exact", "approx"])
@pytest.mark.parametrize("how", ["mean_prob", "max_logit"])
@pytest.mark.parametrize("n_prefix,padded,all_resident", [(37, True, False), (37, False, False), (1000, True, False),
                                                          (1000, False, False), (24, True, True)],
                         ids=["odd-padded", "odd", "1k-padded", "1k", "all-resident"])
def test_kernel_equals_the_torch_ops_and_the_definition(how, n_prefix, padded, all_resident, ranking):
    qg, det, selection, valid = case(n_prefix, padded, all_resident=all_resident)
    scaling = 16 ** -0.5
    kept, lse_res = ranking_inputs(qg, det, selection, scaling, ranking)
    fused = det.evicted_lse_and_scores(qg, selection, valid, scaling, how, True, kept, lse_res)
    composed = det.evicted_lse_and_scores(qg, selection, valid, scaling, how, False, kept, lse_res)
    want = definition(qg, det, selection, valid, scaling, how, kept, lse_res)
    for got in (fused, composed):
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == torch.float32
            assert torch.equal(torch.isinf(a), torch.isinf(b))  # -inf exactly where nothing is evicted / padding
            torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-7)
    # the decisions taken from them: the candidate top-k
    k = min(8, n_prefix)
    assert torch.equal(fused[1].topk(k, -1).indices.sort(-1).values, want[1].topk(k, -1).indices.sort(-1).values)
    if kept is not None and not all_resident:  # the kept logits moved the ranking
        plain = definition(qg, det, selection, valid, scaling, how)[1]
        assert not torch.equal(want[1].topk(k, -1).indices.sort(-1).values, plain.topk(k, -1).indices.sort(-1).values)
    if all_resident:
        assert torch.isinf(fused[0]).all()
    if padded:
        assert torch.isinf(fused[0][2]).all() and torch.isinf(fused[1][2]).all()  # the sample with no prefix
        assert torch.isinf(fused[1][1, :, :10]).all() and torch.isfinite(fused[1][1, :, 10:]).all()


@pytest.mark.skipif(not F.available(), reason="the fused kernel could not be built here")
def test_kernel_takes_bfloat16_queries_and_rejects_bad_inputs():
    qg, det, selection, valid = case(50, True)
    want = det.evicted_lse_and_scores(qg.bfloat16(), selection, valid, 0.25, "mean_prob", fused=False)
    got = det.evicted_lse_and_scores(qg.bfloat16(), selection, valid, 0.25, "mean_prob", fused=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-7)
    qr = torch.zeros(3, 2, 5, 4)
    kept, lse_res = torch.zeros(3, 2, 5, 6), torch.zeros(3, 2, 5)
    op = torch.ops.rcr.detector_pass
    with pytest.raises(RuntimeError, match="selection must be int64"):
        op(qr, det.projected_t, selection.int(), valid, None, None, 0.25, True)
    with pytest.raises(RuntimeError, match="projected_t must be"):
        op(qr, det.projected_t[:, :1], selection, valid, None, None, 0.25, True)
    with pytest.raises(RuntimeError, match="valid must be bool"):
        op(qr, det.projected_t, selection, valid[:, :3], None, None, 0.25, True)
    with pytest.raises(RuntimeError, match="selection index 50 outside the prefix"):
        op(qr, det.projected_t, selection.clamp_min(50), valid, None, None, 0.25, True)
    with pytest.raises(RuntimeError, match="kept must be float32"):
        op(qr, det.projected_t, selection, valid, kept[..., :5], lse_res, 0.25, True)
    with pytest.raises(RuntimeError, match="lse_res must be float32"):
        op(qr, det.projected_t, selection, valid, kept, lse_res.double(), 0.25, True)


@pytest.mark.skipif(not F.available(), reason="the fused kernel could not be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("label", ["rcr", "fixed"])
def test_decode_with_the_kernel_makes_the_same_decisions(label, dtype):
    """rcr::decide and rcr::merge_rows (an eager CPU decode) against the torch path, in fp32 and in bf16 keys."""
    model, proc = tiny_models.qwen2_vl()
    model = copy.deepcopy(model).to(dtype)  # a copy: the cached tiny model is shared with other tests
    cfg = Scale(rcr.RCRConfig(selected=8, window=8), candidates=32, tau0=0.3)
    prefix = rcr.prefill(model, tiny_models.batch_inputs(proc, [4, 20], image_size=224), cfg.config)
    med = float(torch.tensor(rcr.decode(model, prefix, cfg.method("rcr"), 6, eos_token_id=[])
                             .telemetry.drift).nanmedian())
    cfg = cfg.replace(tau0=med, tau=med)
    runs = {}
    for fused in (True, False):
        dec = rcr.Decoder(model, prefix, cfg.replace(fused_kernel=fused).method(label), 16, eos_token_id=[])
        assert dec.state.fused is fused and all(layer.fused_merge is fused for layer in dec.cache.layers)
        dec.run()
        runs[fused] = dec
    a, b = runs[True], runs[False]
    assert torch.equal(a.tokens, b.tokens)
    ta, tb = a.tel.to_host(), b.tel.to_host()
    assert (ta.trigger == tb.trigger).all() and (ta.tau == tb.tau).all() and 0 < ta.trigger.mean() < 1
    torch.testing.assert_close(torch.from_numpy(ta.drift), torch.from_numpy(tb.drift), rtol=1e-5, atol=1e-7,
                               equal_nan=True)
    for la, lb in zip(a.cache.layers, b.cache.layers):
        assert torch.equal(la.selection, lb.selection) and torch.equal(la.resident_keys, lb.resident_keys)
        assert torch.equal(la.resident_values, lb.resident_values) and torch.equal(la.resident_valid, lb.resident_valid)


@pytest.mark.skipif(not F.available(), reason="the fused kernel could not be built here")
@pytest.mark.parametrize("per_head", [False, True], ids=["per_layer", "per_head"])
def test_merge_rows_equals_the_masked_torch_merge(per_head):
    """ResidentLayer.refresh as row copies (rcr::merge_rows) against its torch.where merge, on a left-padded batch
    whose new selections include padding entries; rows that did not fire are left as they were."""
    model, proc = tiny_models.qwen2_vl()
    prefix = rcr.prefill(model, tiny_models.batch_inputs(proc, [4, 20], image_size=112), rcr.RCRConfig(window=4))
    g = torch.Generator().manual_seed(0)
    B, H, Np = prefix.batch_size, prefix.n_kv_heads, prefix.n_prefix
    assert not prefix.prefix_valid.all()
    layers = {}
    for fused in (True, False):
        initial = torch.arange(6).expand(B, H, 6).contiguous()
        layers[fused] = ResidentLayer(prefix, 0, initial, 4, fused=fused)
        assert layers[fused].fused_merge is fused and layers[fused].padded
    for _ in range(3):
        trigger = torch.rand((B, H) if per_head else (B,), generator=g) > 0.4
        sel = torch.stack([torch.randperm(Np, generator=g)[:6].sort().values for _ in range(B * H)]).view(B, H, 6)
        for layer in layers.values():
            layer.refresh(trigger, sel)
    a, b = layers[True], layers[False]
    for name in ("keys", "values", "slot_valid", "selection"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not torch.equal(a.selection, torch.arange(6).expand(B, H, 6))  # something was merged


@pytest.mark.skipif(not F.available(), reason="the fused kernel could not be built here")
def test_decide_and_merge_rows_reject_bad_inputs():
    qg, det, selection, valid = case(50, True)
    B, H, _, d = qg.shape
    keys = torch.randn(B, H, 50, d)
    res = torch.randn(B, H, 20, d)
    args = dict(query=qg.reshape(B, -1, 1, d), basis=det.basis, projected_t=det.projected_t, keys=res,
                values=res.clone(), slot_valid=torch.ones(B, H, 20, dtype=torch.bool), selection=selection.clone(),
                n_stored=12, slots_masked=False, valid=valid, prefix_keys=keys, prefix_values=keys.clone(),
                tau=torch.zeros(B), tau_factors=torch.ones(H + 1, B), scaling=0.25, mean_prob=True, per_head=False,
                n_candidates=16, kept_exact=True, context_norm=True, decisions=None, layer=0, t=0,
                detector_dots=torch.zeros(B))
    trigger, drift, tau, sel = torch.ops.rcr.decide(**args)
    assert trigger.shape == drift.shape == tau.shape == (B,) and sel.shape == (B, H, 6) and sel.dtype == torch.long
    assert (sel.diff(dim=-1) > 0).all()  # ascending positions
    bad = {"prefix_keys must be": dict(prefix_keys=keys[:, :, :40]), "tau must be": dict(tau=torch.zeros(B + 1)),
           "basis must be": dict(basis=det.basis.double()), "S <= the candidates": dict(n_candidates=5),
           "of prefix_keys' dtype": dict(keys=res.double()), "must hold the S kept entries": dict(n_stored=4),
           "decisions must be": dict(decisions=torch.zeros(5, B, 1, 1)),
           "tau_factors must be": dict(tau_factors=torch.ones(H, B)),
           "selection index 50 outside": dict(selection=selection.clamp_min(50))}
    for msg, change in bad.items():
        with pytest.raises(RuntimeError, match=msg):
            torch.ops.rcr.decide(**{**args, **change})
    buf = torch.zeros(B, H, 20, d)
    merge = dict(keys=buf, values=buf.clone(), slot_valid=torch.ones(B, H, 20, dtype=torch.bool),
                 selection=selection.clone(), trigger=torch.ones(B, dtype=torch.bool), new_selection=selection,
                 prefix_keys=keys, prefix_values=keys, prefix_valid=valid)
    for msg, change in {"outside the prefix": dict(new_selection=selection + 50),
                        "dtypes differ": dict(prefix_keys=keys.double()),
                        "trigger must be": dict(trigger=torch.ones(B + 1, dtype=torch.bool)),
                        "must be int64": dict(new_selection=selection.int())}.items():
        with pytest.raises(RuntimeError, match=msg):
            torch.ops.rcr.merge_rows(**{**merge, **change})


@pytest.fixture
def unbuildable(monkeypatch):
    def fail():
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(F, "_extension", fail)
    F.available.cache_clear()
    yield
    monkeypatch.undo()
    F.available.cache_clear()


def test_without_a_compiler_rcr_decodes_with_the_torch_ops(unbuildable):
    with pytest.warns(RuntimeWarning, match="could not be built.*no C.. compiler"):
        assert F.available() is False
    model, proc = tiny_models.qwen2_vl()
    cfg = rcr.RCRConfig(selected=8, window=8)
    prefix = rcr.prefill(model, tiny_models.batch_inputs(proc, [6], image_size=112), cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not at every decode
        dec = rcr.Decoder(model, prefix, parse_method("rcr@candidates=32", cfg), 4, eos_token_id=[])
    assert dec.state.fused is False
    dec.run()


def test_fused_kernel_field_is_validated():
    with pytest.raises(rcr.ConfigError, match="fused_kernel"):
        rcr.RCRConfig(fused_kernel="yes")
