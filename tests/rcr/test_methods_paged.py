"""Quest, ArkVale, InfiniGen and rcr_layer: the scoring rules of docs/algorithms.md on random tensors, their
selections, ArkVale's page cache, InfiniGen's skew and speculation, per-layer thresholds. (The contracts every
registered method keeps, no host sync, compiled == eager, budget >= prefix == full and the rest, are in
test_method_contracts.py.)"""

import re

import numpy as np
import pytest
import torch

import rcr
from rcr.cache import PrefixStore
from rcr.generate import build_cache
from rcr.methods import ScorerMethod, parse_method
from rcr.methods.arkvale import cuboid_mean_digest
from rcr.methods.infinigen import InfiniGen, project_query
from rcr.models import geometry
from rcr.pages import PageLayout, bound_scores, page_bounds, page_order_scores
from rcr.scoring import top_sorted
from rcr.skewing import (
    calibration_digest,
    check_orthogonal,
    load_calibration,
    partial_columns,
    save_calibration,
    skew_from_grams,
)
from tests import tiny_models
from tests.methods import Scale

SMALL = Scale(rcr.RCRConfig(selected=8, window=8), candidates=32, tau0=0.3, page_size=4)


def fake_store(valid: torch.Tensor, window: int) -> PrefixStore:
    """A store with only the geometry the page layout reads."""
    B = valid.shape[0]
    return PrefixStore(layers=[], valid=valid, next_position=torch.zeros(B, dtype=torch.long),
                       first_logits=torch.zeros(B, 1), window=window, scaling=1.0, n_kv_heads=1, n_q_heads=1,
                       head_dim=1)


def padded_valid(n: int, pads: list[int]) -> torch.Tensor:
    return torch.stack([torch.arange(n) >= p for p in pads])


# ------------------------------------------------------------------------------------------------- Quest

@pytest.mark.parametrize("seed", range(5))
def test_quest_page_bound_is_an_upper_bound_on_random_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    B, H, G, N, W, d, ps = 2, 3, 4, 61, 5, 16, 16  # 56 prefix entries: pages 16,16,16,8; left padding in sample 1
    valid = padded_valid(N, [0, 7])
    layout = PageLayout.build(fake_store(valid, W), ps)
    keys = torch.randn(B, H, N - W, d, generator=g) * torch.rand(1, 1, 1, d, generator=g) * 3  # uneven channels
    q = torch.randn(B, H, G, d, generator=g) * 2
    hi, lo = page_bounds(keys, layout)
    u = bound_scores(q, hi, lo)  # (B, H, G, P)
    exact = torch.einsum("bhgd,bhnd->bhgn", q, keys)
    n_checked = 0
    for b in range(B):
        for p in range(layout.n_pages):
            members = ((layout.page_of[b] == p) & valid[b, : N - W]).nonzero().squeeze(1)
            if len(members) == 0:
                assert layout.page_len[b, p] == 0
                continue
            assert layout.page_len[b, p] == len(members)
            true_max = exact[b, :, :, members].amax(-1)  # (H, G)
            assert (u[b, :, :, p] >= true_max - 1e-4).all()
            # the bound written out literally: sum_i max(q_i M_i, q_i m_i)
            lit = torch.maximum(q[b] * hi[b, :, None, p], q[b] * lo[b, :, None, p]).sum(-1)
            torch.testing.assert_close(u[b, :, :, p], lit, rtol=1e-5, atol=1e-4)
            n_checked += 1
    assert n_checked == 8  # sample 0: pages of 16, 16, 16, 8; sample 1 (49 valid entries): 16, 16, 16, 1
    # reduced over the G query heads by max (quest_reduction="max"), it bounds the whole group's max
    for b in range(B):
        for p in range(layout.n_pages):
            members = ((layout.page_of[b] == p) & valid[b, : N - W]).nonzero().squeeze(1)
            assert (u[b, :, :, p].amax(-1) >= exact[b, :, :, members].amax(dim=(-1, -2)) - 1e-4).all()


def test_quest_selection_is_the_union_of_the_top_pages():
    N, W, ps = 45, 5, 8  # Np = 40: sample 0 pages of 8; sample 1 has 3 padding entries -> pages 8,8,8,8,5
    valid = padded_valid(N, [0, 3])
    layout = PageLayout.build(fake_store(valid, W), ps)
    assert layout.n_pages == 5
    assert layout.page_len.tolist() == [[8, 8, 8, 8, 8], [8, 8, 8, 8, 5]]
    scores = torch.tensor([[[0.0, 5.0, 1.0, 4.0, 2.0]], [[0.0, 1.0, 2.0, 3.0, 9.0]]])  # (B, H=1, P)
    sel = top_sorted(page_order_scores(scores, layout, valid[:, : N - W]), 16)
    assert sel[0, 0].tolist() == list(range(8, 16)) + list(range(24, 32))  # pages 1 and 3
    # sample 1: page 4 (5 entries, 35..39) + page 3 (27..34) + 3 slots from page 2, in position order (19..21)
    assert sel[1, 0].tolist() == [19, 20, 21] + list(range(27, 40))
    # every page fits: every entry is selected (sample 1's 3 padding entries fill the 3 spare slots)
    all_sel = top_sorted(page_order_scores(scores, layout, valid[:, : N - W]), 40)
    assert all_sel[0, 0].tolist() == all_sel[1, 0].tolist() == list(range(40))


# ----------------------------------------------------------------------------------------------- ArkVale

def test_arkvale_cuboid_mean_digest_matches_definition():
    g = torch.Generator().manual_seed(0)
    N, W, ps, d = 37, 3, 8, 6
    valid = padded_valid(N, [0, 5])
    layout = PageLayout.build(fake_store(valid, W), ps)
    keys = torch.randn(2, 2, N - W, d, generator=g)
    bmax, bmin = cuboid_mean_digest(keys, layout)
    for b in range(2):
        for p in range(layout.n_pages):
            m = ((layout.page_of[b] == p) & valid[b, : N - W]).nonzero().squeeze(1)
            if len(m) == 0:
                continue
            k = keys[b, :, m].double().numpy()  # (H, n, d)
            c = (k.max(1) + k.min(1)) / 2
            r = np.abs(c[:, None] - k).mean(1)
            np.testing.assert_allclose(bmax[b, :, p].numpy(), c + r, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(bmin[b, :, p].numpy(), c - r, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def qwen():
    model, proc = tiny_models.qwen2_vl()
    inputs = tiny_models.batch_inputs(proc, [4, 20], image_size=224)
    return model, inputs, rcr.prefill(model, inputs, SMALL.config)


def reference_page_cache(scores: list[list[float]], page_len: list[int], c: int, k: int) -> list[tuple]:
    """ArkVale's page cache of one (sample, KV head) written out with sets, from its page scores at each step
    (-inf: no such page): the top k pages must be cached, the cached ones follow, then the rest (filling an empty
    cache); the first c stay. Per step: (the top k pages, the cache, the entries of the pages that entered it)."""
    cache: set[int] = set()
    out = []
    for s in scores:
        ranked = sorted((p for p in range(len(s)) if s[p] > float("-inf")), key=lambda p: (-s[p], p))
        must = ranked[:k]
        new = (must + [p for p in ranked if p in cache and p not in must]
               + [p for p in ranked if p not in cache and p not in must])[:c]
        out.append((must, new, sum(page_len[p] for p in new if p not in cache)))
        cache = set(new)
    return out


@pytest.mark.parametrize("rule", ["topk", "recall"])
def test_arkvale_attends_its_top_pages_and_records_its_recalls_apart(qwen, rule):
    """``topk`` (ArkVale's paper): the top C = S / page_size pages by digest are the selection at every step, from
    a page cache of 2C pages. ``recall`` (ablation): the selection is a cache of C pages of which only the top
    max(1, C // 2) must be resident. Either way the reads are S keys and S values per step (the cost model), and
    the recalls into the page cache, checked against the cache written out with sets, are recorded apart."""
    model, _, prefix = qwen
    cfg = SMALL.replace(rule=rule)
    S, ps = cfg.selected, cfg.page_size
    C = S // ps
    c, k = (2 * C, C) if rule == "topk" else (C, max(1, C // 2))
    seen = []

    class Probe(type(cfg.method("arkvale"))):
        def decide(self, ctx):
            scores = self.page_scores(ctx)  # (B, Hkv, P)
            d = super().decide(ctx)
            seen.append((ctx.layer, scores.clone(), d.selection.clone(), d.recalled.clone()))
            return d

    n = 12
    r = rcr.decode(model, prefix, Probe(config=cfg.config, page_size=ps, rule=rule), n, eos_token_id=[])
    tel = r.telemetry
    assert (tel.trigger == 1).all() and (tel.keys_read == S).all() and (tel.values_read == S).all()
    layout = PageLayout.build(prefix, ps)
    B, H = prefix.batch_size, prefix.n_kv_heads
    kept_other = 0  # steps where the selection holds a page outside the top C (the recall rule's stale pages)
    for layer in range(len(prefix.layers)):
        steps = [x for x in seen if x[0] == layer]
        assert len(steps) == n - 1
        for b in range(B):
            page_len = layout.page_len[b].tolist()
            members = [((layout.page_of[b] == p) & prefix.prefix_valid[b]).nonzero().squeeze(1).tolist()
                       for p in range(layout.n_pages)]
            refs = [reference_page_cache([x[1][b, h].tolist() for x in steps], page_len, c, k) for h in range(H)]
            for t, (_, scores, sel, recalled) in enumerate(steps):
                for h in range(H):
                    must, cache, _ = refs[h][t]
                    chosen = set(sel[b, h].tolist())
                    assert {i for p in (must if rule == "topk" else cache) for i in members[p]} <= chosen, (b, h, t)
                    top = sorted(range(layout.n_pages), key=lambda p: (-scores[b, h, p].item(), p))[:C]
                    kept_other += not {i for p in top for i in members[p]} <= chosen
                want = np.mean([refs[h][t][2] for h in range(H)])  # recalled entries, mean over KV heads
                assert recalled[b].item() == pytest.approx(want) and tel.recalled[b, layer, t] == pytest.approx(want)
    assert (kept_other > 0) == (rule == "recall")
    assert 0 < tel.recalled[:, :, 1:].mean() < S  # after the first step, some pages are recalled, not all


def test_quest_arkvale_and_infinigen_read_what_the_rcr_paper_charges(qwen):
    """At the paper's budget (32 selected entries) each reads 64 vectors per KV head and layer-step: the RCR
    paper's "Quest, ArkVale and InfiniGen read 64 vectors per step"."""
    from pipeline.schema import telemetry_summary

    model, inputs, _ = qwen
    cfg = rcr.RCRConfig(window=8)
    res = rcr.generate(model, inputs, method=["quest", "arkvale", "infinigen"], max_new_tokens=4, config=cfg,
                       ignore_eos=True)  # their own page size and columns: the paper's
    for label, r in res.items():
        assert int(r.prefix_len.min()) > cfg.selected
        for b in range(2):
            row = telemetry_summary(r.sample(b))
            assert row["keys_read_per_step"] + row["values_read_per_step"] == 64, label
            assert (row["recalled_per_step"] is None) == (label != "arkvale"), label


# --------------------------------------------------------------------------------------------- InfiniGen

def test_infinigen_skew_is_orthogonal_and_leaves_qk_unchanged():
    g = torch.Generator().manual_seed(0)
    d = 32
    mix = torch.randn(d, d, generator=g)
    q = torch.randn(3, 200, d, generator=g) @ mix  # correlated channels, like real queries
    k = torch.randn(3, 150, d, generator=g) @ mix.T
    a = skew_from_grams(q.transpose(1, 2) @ q, k.transpose(1, 2) @ k)  # (3, d, d)
    check_orthogonal(a)
    torch.testing.assert_close(a.transpose(1, 2) @ a, torch.eye(d).expand(3, d, d), atol=1e-5, rtol=0)
    torch.testing.assert_close((q @ a) @ (k @ a).transpose(1, 2), q @ k.transpose(1, 2), rtol=1e-4, atol=1e-3)
    # the first skewed column carries the most query energy (it is the top right singular vector of Q)
    energy = (q @ a).pow(2).sum(1)  # (3, d)
    assert (energy.argmax(-1) == 0).all()
    with pytest.raises(ValueError, match="not orthogonal"):
        check_orthogonal(a * 1.01)


def test_infinigen_partial_columns_union_rule():
    abs_q = torch.tensor([9.0, 1.0, 8.0, 2.0, 0.0, 3.0])
    abs_k = torch.tensor([0.0, 7.0, 1.0, 2.0, 9.0, 3.0])
    assert partial_columns(abs_q, abs_k, 2).tolist() == [0, 4]  # rank 0 of each
    assert partial_columns(abs_q, abs_k, 4).tolist() == [0, 1, 2, 4]  # + rank 1 of each
    assert len(partial_columns(abs_q, abs_k, 5)) == 5


@pytest.mark.parametrize("family", list(tiny_models.FAMILIES))
def test_infinigen_speculation_uses_the_modules_own_projection(family):
    """project_query on layer l's own input reproduces the query transformers computed (Qwen2's q bias,
    Qwen3's q_norm, M-RoPE), and the speculated query of layer l is built from layer l-1's input."""
    model, proc = tiny_models.FAMILIES[family]()
    inputs = tiny_models.batch_inputs(proc, [4, 9], image_size=112)
    prefix = rcr.prefill(model, inputs, SMALL.config)
    checked = []

    class Probe(InfiniGen):
        def decide(self, ctx):
            st = ctx.state
            own = project_query(st.attn[ctx.layer], st.inputs[ctx.layer], st.position_embeddings)
            torch.testing.assert_close(own, ctx.query, rtol=1e-5, atol=1e-5)
            if ctx.layer > 0:
                spec = self.speculated_query(ctx)
                ref = project_query(st.attn[ctx.layer], st.inputs[ctx.layer - 1], st.position_embeddings)
                assert torch.equal(spec, ref) and not torch.allclose(spec, ctx.query)
            checked.append(ctx.layer)
            return super().decide(ctx)

    m = Probe(config=SMALL.config)
    rcr.decode(model, prefix, m, 3, eos_token_id=[])
    # sliding-window layers make no decision
    assert len(checked) == 2 * sum(geometry(model).reselected(inputs["input_ids"].shape[1] + 2))
    if family not in ("llava_next", "llava"):  # the families whose projection has a bias / a q_norm
        attn = model.model.language_model.layers[0].self_attn
        assert attn.q_proj.bias is not None or getattr(attn, "q_norm", None) is not None
    for layer in model.model.language_model.layers:  # hooks live for one decode only
        assert not layer.self_attn._forward_pre_hooks


def test_infinigen_calibration_file_round_trip_and_use(qwen, tmp_path):
    from rcr.calibrate_infinigen import calibrate, synthetic_scene
    from rcr.models import build_inputs

    model, inputs, _ = qwen
    proc = tiny_models.qwen2_vl()[1]
    data = [build_inputs(proc, ["Describe this image in detail."], [[synthetic_scene(i, 112)]]) for i in range(2)]
    skews, cols, stats = calibrate(model, data, 0.25)
    assert stats["partial_columns"] == 8 and len(skews) == len(cols) == 3
    save_calibration(str(tmp_path), skews, cols, {"command": "test"})
    s2, _, meta = load_calibration(str(tmp_path))
    assert meta["command"] == "test" and all(torch.equal(a, b) for a, b in zip(skews, s2))
    # q.k invariance on the model's real post-RoPE prefix keys and window queries
    prefix = rcr.prefill(model, inputs, SMALL.config)
    k = prefix.layers[1].keys[0, 0].float()
    q = prefix.layers[1].window_queries[0, :2].float().reshape(-1, k.shape[-1])
    a = s2[1][0]
    torch.testing.assert_close((q @ a) @ (k @ a).T, q @ k.T, rtol=1e-4, atol=1e-4)
    r = rcr.generate(model, inputs, method=[SMALL.replace(calibration=str(tmp_path)).method("infinigen")],
                     max_new_tokens=4, ignore_eos=True)
    assert r["infinigen"].cost["calibration"] == str(tmp_path)  # no description in its meta: the path
    assert r["infinigen"].cost["calibration_sha256"] == meta["sha256"] == calibration_digest(str(tmp_path))
    for value in (None, "per_sample"):  # per sample: each sample's own prefill, no file
        r = rcr.generate(model, inputs, method=[SMALL.replace(calibration=value).method("infinigen")],
                         max_new_tokens=4, ignore_eos=True)
        assert r["infinigen"].cost["calibration"] == "per_sample" and r["infinigen"].cost["calibration_sha256"] is None
    big = Scale(rcr.RCRConfig(selected=4096, window=8), candidates=4096, calibration=str(tmp_path))
    r = rcr.generate(model, inputs, method=big.methods(["full", "infinigen"]), max_new_tokens=6, ignore_eos=True)
    assert torch.equal(r["full"].sequences, r["infinigen"].sequences)
    with pytest.raises(rcr.ConfigError, match="infinigen.calibration"):
        rcr.generate(model, inputs, method=f"infinigen@calibration={tmp_path / 'nothing'}", max_new_tokens=2)


def test_infinigen_layer0_rules(qwen):
    model, _, prefix = qwen
    r = rcr.decode(model, prefix, SMALL.replace(layer0="static").method("infinigen"), 5, eos_token_id=[])
    assert (r.telemetry.trigger[:, 0] == 0).all() and (r.telemetry.keys_read[:, 0] == 0).all()
    assert (r.telemetry.trigger[:, 1:] == 1).all()
    r = rcr.decode(model, prefix, SMALL.method("infinigen"), 5, eos_token_id=[])
    assert (r.telemetry.trigger == 1).all()
    np.testing.assert_allclose(r.telemetry.detector_dots[0], prefix.prefix_valid[0].sum().item() * 8 / 32)


# ------------------------------------------------------------------------------------------ scorer base

class Latest(ScorerMethod):
    """Scores the prefix by position (the S latest valid entries win); no score at layer 0."""

    name = "latest"

    def score(self, ctx):
        if ctx.layer == 0:
            return None
        p = ctx.prefix
        pos = torch.arange(p.n_prefix, dtype=torch.float32).expand(p.batch_size, p.n_kv_heads, p.n_prefix)
        return pos.masked_fill(~p.prefix_valid.unsqueeze(1), float("-inf"))


def test_scorer_base_turns_any_score_into_a_top_s_refresh_and_counts_its_reads(qwen):
    """The ScorerMethod base owns the decision: every layer-step, the top S of the method's score, merged
    under an all-true trigger and counted as S key + S value reads; no score means no refresh and no reads."""
    model, _, prefix = qwen
    m = Latest(config=SMALL.config)
    initial = [layer.selection.clone() for layer in build_cache(m, prefix, 5).layers]
    dec = rcr.Decoder(model, prefix, m, max_new_tokens=5, eos_token_id=[])
    dec.run()
    r = dec.result(0.0, 0.0)
    S, Np = SMALL.selected, prefix.n_prefix
    latest = torch.arange(Np - S, Np).expand(prefix.batch_size, prefix.n_kv_heads, S)
    assert torch.equal(dec.cache.layers[0].selection, initial[0])  # layer 0: BACON's selection stays
    assert not torch.equal(initial[1], latest)
    for layer in dec.cache.layers[1:]:
        assert torch.equal(layer.selection, latest)
    tel = r.telemetry
    assert (tel.trigger[:, 0] == 0).all() and (tel.keys_read[:, 0] == 0).all()
    assert (tel.trigger[:, 1:] == 1).all() and (tel.keys_read[:, 1:] == S).all() and (tel.values_read[:, 1:] == S).all()
    assert r.cost == {"keys_per_refresh": S, "values_per_refresh": S}


# --------------------------------------------------------------------------------------------- rcr_layer

def test_rcr_layer_has_one_tau_per_layer_updated_by_its_own_refreshes(qwen):
    model, _, prefix = qwen
    probe = rcr.decode(model, prefix, SMALL.method("rcr"), 12, eos_token_id=[]).telemetry.drift
    cfg = SMALL.replace(tau0=float(np.median(probe)))  # this sample's drift scale: some layer-steps fire
    r = rcr.decode(model, prefix, cfg.method("rcr_layer"), 12, eos_token_id=[])
    tau, trig = r.telemetry.tau, r.telemetry.trigger  # (B, L, T)
    assert 0 < trig.mean() < 1
    np.testing.assert_allclose(tau[:, :, 0], cfg.tau0, rtol=1e-6)
    expect = tau[:, :, :-1] * np.exp(cfg.step * (trig[:, :, :-1] - cfg.rho))  # each layer its own controller
    np.testing.assert_allclose(tau[:, :, 1:], expect, rtol=1e-5)
    assert not np.allclose(tau[:, 0], tau[:, -1])  # layers diverge: they are not one shared threshold


# ------------------------------------------------------------------------------------------------ config

@pytest.mark.parametrize("method,knob,value", [
    ("quest", "page_size", 0), ("arkvale", "page_size", -1), ("quest", "reduction", "sum"), ("arkvale", "rule", "lru"),
    ("arkvale", "groups", "all"), ("infinigen", "partial_ratio", 0.0), ("infinigen", "partial_ratio", 1.5),
    ("infinigen", "layer0", "skip"), ("infinigen", "calibration", ""), ("prefill_oracle", "pool", "yes"),
])
def test_the_page_and_speculation_knobs_are_validated(method, knob, value):
    with pytest.raises(rcr.ConfigError) as e:
        rcr.METHODS[method](**{knob: value})
    assert e.value.field == f"{method}.{knob}"


def test_new_methods_are_registered():
    for name in ("quest", "arkvale", "infinigen", "rcr_layer"):
        assert name in rcr.METHODS and parse_method(name).name == name


def test_calibrate_infinigen_cli_records_its_command_and_says_its_progress(tmp_path, capsys):
    import json

    from rcr.calibrate_infinigen import main

    model, proc = tiny_models.qwen2_vl()
    model.save_pretrained(tmp_path / "model")
    proc.save_pretrained(tmp_path / "model")
    argv = ["--model", str(tmp_path / "model"), "--out", str(tmp_path / "cal"), "--n", "2", "--image-size", "112"]
    assert main(argv) == 0
    said = [re.fullmatch(r"\[calibrate\] pass (\d) of 2 \(.+\): prompt (\d) of 2 \(\d+ tokens\), \d+s elapsed", ln)
            for ln in capsys.readouterr().out.splitlines() if ln.startswith("[calibrate] ")]
    # one line after each of the two passes' prefills (minutes each at real size on a CPU)
    assert [m and m.groups() for m in said] == [(p, i) for p in "12" for i in "12"]
    with open(tmp_path / "cal" / "calibration.json") as f:
        meta = json.load(f)
    assert meta["command"].startswith("python -m rcr.calibrate_infinigen --model ")
    assert meta["n_prompts"] == 2 and meta["partial_columns"] == 8 and "synthetic_scenes" in meta["source"]
    skews, cols, _ = load_calibration(str(tmp_path / "cal"))
    assert len(skews) == 3 and tuple(cols[0].shape) == (2, 8)


def test_offline_calibration_on_a_prompt_is_its_per_sample_calibration():
    """Offline and per-sample InfiniGen calibrate on the same tokens (the queries of the prompt's last `window`
    tokens, the prefix keys before them), so calibrated offline on one prompt, the skew and partial columns are
    those the per-sample path derives from that prompt's own prefill (skew columns up to sign; the window's G*W
    queries span the head dim, so no eigenvalue is degenerate)."""
    from rcr.calibrate_infinigen import calibrate
    from rcr.methods.infinigen import _prefill_grams
    from rcr.skewing import n_partial, partial_columns, skew_from_grams

    model, proc = tiny_models.qwen2_vl()
    cfg = rcr.RCRConfig(selected=4, window=32)
    inputs = tiny_models.batch_inputs(proc, [40])
    skews, cols, stats = calibrate(model, [inputs], 0.25, window=cfg.window)
    assert stats["query_window"] == cfg.window
    prefix = rcr.prefill(model, inputs, cfg)
    for layer, (skew, col) in enumerate(zip(skews, cols)):
        gq, gk, q, k = _prefill_grams(prefix, layer)
        a = skew_from_grams(gq, gk)  # (1, Hkv, d, d)
        own = partial_columns((q @ a).abs().sum(-2), (k @ a).abs().sum(-2), n_partial(0.25, a.shape[-1]))[0]
        assert torch.equal(col, own), layer
        cos = (skew.transpose(-1, -2) @ a[0]).diagonal(dim1=-2, dim2=-1).abs()  # (Hkv, d): column by column
        assert cos.min() > 0.999, (layer, cos.min())
