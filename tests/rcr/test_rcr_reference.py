"""One RCR layer-step written from docs/algorithms.md ("rcr", "exact"), in plain loops over heads and entries, and
every fast path held to it decision for decision.

``reference_step`` imports nothing of the fast path (no rcr.scoring, rcr.detector, rcr.controller): it takes the
query, the prefix keys and the resident slots as nested lists and follows the text. The detector basis is the top
``rank`` right singular vectors of the sample's prefix keys with padding zeroed (torch.linalg.svd, per head).
The fast paths, run on the same random state through ``Method.decide``: the composed torch ops
(``fused_kernel=False``), the whole-decision C++ op (rcr::decide, an eager CPU step), and the torch path with the
C++ detector kernel (offload mode on CPU, which is also the path of a compiled step); each for ``rcr``, ``fixed``
and ``rcr_layer``, at batch 1 and in a left-padded batch, with the ranking's ablations.
"""

import math

import numpy as np
import pytest
import torch

import rcr
import rcr.fused
from rcr.cache import PrefixLayer, PrefixStore, ResidentLayer
from rcr.methods import StepContext
from rcr.offload import HostReader
from tests.methods import Scale

NEG_INF = float("-inf")
HKV, G, D, RANK, W, S, C, N_PREFIX, N_LAYERS, LAYER = 2, 3, 16, 4, 4, 6, 16, 48, 2, 1
SCALING = D ** -0.5
SINK = 10  # the sink's prefix position in test_a_kept_sink_outside_the_detector_basis_survives_a_refresh


# ----------------------------------------------------------------------------- the reference, from the text

def lse(xs):
    m = max(xs, default=NEG_INF)
    return NEG_INF if m == NEG_INF else m + math.log(sum(math.exp(x - m) for x in xs))


def logaddexp(a, b):
    return lse([a, b])


def dot(a, b):
    return sum(x * y for x, y in zip(a, b))


def top(scores: dict, k: int) -> list:
    """The k keys of the highest scores, in ascending position order."""
    return sorted(sorted(scores, key=lambda n: -scores[n])[:k])


def detector_basis(keys, valid, rank):
    """(d, r) as rows of r columns: the top right singular vectors of the head's prefix keys, padding zeroed."""
    k = torch.tensor([row if ok else [0.0] * len(row) for row, ok in zip(keys, valid)], dtype=torch.float64)
    vh = torch.linalg.svd(k, full_matrices=False).Vh  # (min(Np, d), d)
    return vh[:rank].T.tolist()


def reference_head(q_bh, keys, valid, sel, res, res_valid, cfg: Scale) -> tuple[float, list]:
    """One KV head: its drift (the mean over its G query heads) and its new selection. q_bh (G, d) queries; keys
    (Np, d) prefix keys, valid (Np); sel (S) the kept entries, which the first S of the resident slots res hold."""
    basis = detector_basis(keys, valid, cfg.rank)

    def approx(qv, kv):  # (R^T q) . (R^T k) * scaling
        return sum(dot(qv, col) * dot(kv, col) for col in zip(*basis)) * SCALING

    kept = set(sel)
    evicted = [n for n in range(len(keys)) if valid[n] and n not in kept]
    drift_g, norm, rank_lg = [], [], []
    for qv in q_bh:
        lse_res = lse([dot(qv, k) * SCALING for k, ok in zip(res, res_valid) if ok])
        approx_lg = {n: approx(qv, keys[n]) for n in range(len(keys)) if valid[n]}
        lse_ev = lse([approx_lg[n] for n in evicted])
        # drift: attention mass on the evicted entries, approximate for them, exact for the resident slots
        drift_g.append(1.0 / (1.0 + math.exp(lse_res - lse_ev)) if lse_ev > NEG_INF else 0.0)
        # the ranking: kept entries by their exact logits, evicted ones by the detector's
        lg = {n: (dot(qv, keys[n]) * SCALING if n in kept and cfg.kept_logits == "exact" else a)
              for n, a in approx_lg.items()}
        rank_lg.append(lg)
        # each head's normaliser: its whole context (resident exact + evicted approximate), or the ranked set
        norm.append(logaddexp(lse_res, lse_ev) if cfg.prob_norm == "context" else lse(list(lg.values())))
    mean_prob = cfg.head_reduction == "mean_prob"
    # candidates: the top C of the prefix ranking
    if mean_prob:
        cand_score = {n: sum(math.exp(lg[n] - nm) for lg, nm in zip(rank_lg, norm)) / len(q_bh) for n in rank_lg[0]}
    else:
        cand_score = {n: max(lg[n] for lg in rank_lg) for n in rank_lg[0]}
    assert len(cand_score) >= cfg.candidates, "the test keeps C valid entries per sample"
    cand = top(cand_score, min(cfg.candidates, len(keys)))
    # exact re-scoring of the candidates; the top S are the new selection
    exact_lg = [{n: dot(qv, keys[n]) * SCALING for n in cand} for qv in q_bh]
    if not mean_prob:
        exact = {n: max(lg[n] for lg in exact_lg) for n in cand}
    else:
        if cfg.prob_norm == "scored":  # the softmax over the candidates
            norm = [lse(list(lg.values())) for lg in exact_lg]
        exact = {n: sum(math.exp(lg[n] - nm) for lg, nm in zip(exact_lg, norm)) / len(q_bh) for n in cand}
    return sum(drift_g) / len(drift_g), top(exact, len(sel))


def reference_step(x: dict, cfg: Scale, label: str, tau: list) -> dict:
    """One layer-step of ``label`` (rcr, fixed, rcr_layer) for every sample b and KV head h of ``x`` (nested lists):
    q[b][h][g] (d); keys[b][h][n] (Np prefix keys, d); valid[b][n]; res[b][h][j] (resident slot keys: S kept entries,
    then window and generated); res_valid[b][h][j]; sel[b][h] (the S kept prefix entries, slot order). ``tau[b]``:
    this layer's threshold. Returns drift[b], drift_h[b][h], trigger[b] (or [b][h]), the updated tau[b] and the
    new selection[b][h]."""
    out = {"drift": [], "drift_h": [], "trigger": [], "tau": [], "selection": []}
    for b, q_b in enumerate(x["q"]):
        heads = [reference_head(q_bh, x["keys"][b][h], x["valid"][b], x["sel"][b][h], x["res"][b][h],
                                x["res_valid"][b][h], cfg) for h, q_bh in enumerate(q_b)]
        drift_h = [d for d, _ in heads]
        drift = sum(drift_h) / len(drift_h)  # the layer's drift: the mean over its KV heads
        if cfg.controller_signal == "heads":
            trig = [d > tau[b] for d in drift_h]
            f = sum(trig) / len(trig)
        else:
            trig = drift > tau[b]
            f = float(trig)
        # rate controller: tau <- tau * exp(step * (f - rho)); fixed keeps its threshold
        out["tau"].append(tau[b] if label == "fixed" else tau[b] * math.exp(cfg.step * (f - cfg.rho)))
        out["drift"].append(drift)
        out["drift_h"].append(drift_h)
        out["trigger"].append(trig)
        out["selection"].append([sel for _, sel in heads])
    return out


def reference_exact(x: dict, cfg: Scale) -> list:
    """``exact``'s selection[b][h]: the top S prefix entries by each query head's exact probability under its whole
    context (prefix and the resident slots after the kept ones), or the softmax over the prefix (``scored``)."""
    out = []
    for b, q_b in enumerate(x["q"]):
        sel_b = []
        for h, q_bh in enumerate(q_b):
            keys, valid = x["keys"][b][h], x["valid"][b]
            rest = [k for k, ok in zip(x["res"][b][h][S:], x["res_valid"][b][h][S:]) if ok]
            score = dict.fromkeys((n for n in range(len(keys)) if valid[n]), 0.0)
            for qv in q_bh:
                lg = {n: dot(qv, keys[n]) * SCALING for n in score}
                nm = lse(list(lg.values()))
                if cfg.prob_norm == "context":
                    nm = logaddexp(nm, lse([dot(qv, k) * SCALING for k in rest]))
                for n in score:
                    score[n] += math.exp(lg[n] - nm) / len(q_bh)
            sel_b.append(top(score, S))
        out.append(sel_b)
    return out


# ------------------------------------------------------------------------ random states and the fast paths

def random_state(B: int, padded: bool, seed: int, sink: bool = False):
    """A prefix store of N_LAYERS layers and layer LAYER's resident slots (S kept + W window + 2 generated), with a
    query. ``padded``: sample 1 has 10 left-padding entries. ``sink``: every head's kept entry SINK is an attention
    sink: its key lies along the last axis, which no other key touches and which is too weak to enter the rank-r
    basis, and the query points along it."""
    g = torch.Generator().manual_seed(seed)
    Np, N = N_PREFIX, N_PREFIX + W
    keys = torch.randn(B, HKV, N, D, generator=g) * 1.5
    values = torch.randn(B, HKV, N, D, generator=g)
    query = torch.randn(B, HKV * G, 1, D, generator=g)
    valid = torch.ones(B, N, dtype=torch.bool)
    if padded:
        valid[1, :10] = False
    first = SINK + 1 if sink else 10  # kept entries are valid in every sample
    sel = torch.stack([torch.stack([(torch.randperm(Np - first, generator=g)[:S] + first).sort().values
                                    for _ in range(HKV)]) for _ in range(B)])  # (B, Hkv, S), ascending
    if sink:
        keys[..., -1] = 0.0
        sel[..., 0] = SINK  # kept in every head
        keys[:, :, SINK] = 0.0
        keys[:, :, SINK, -1] = 3.0
        query[..., -1] = 12.0
    layers = [PrefixLayer(keys=keys.clone(), values=values.clone(), window_queries=torch.zeros(B, HKV * G, W, D))
              for _ in range(N_LAYERS)]
    prefix = PrefixStore(layers=layers, valid=valid, next_position=valid.sum(-1), first_logits=torch.zeros(B, 8),
                         window=W, scaling=SCALING, n_kv_heads=HKV, n_q_heads=HKV * G, head_dim=D)
    generated = torch.randn(B, HKV, 2, D, generator=g) * 1.5
    if sink:
        generated[..., -1] = 0.0
    return prefix, sel, generated, query


def resident(prefix, sel, generated, fused: bool) -> ResidentLayer:
    res = ResidentLayer(prefix, LAYER, sel, 4, fused=fused)
    for t in range(generated.shape[2]):
        res.update(generated[:, :, t : t + 1], generated[:, :, t : t + 1])
    return res


def as_lists(prefix, res, query) -> dict:
    B = prefix.batch_size
    k_p, _ = prefix.prefix_kv(LAYER)
    return {"q": query.view(B, HKV, G, D).tolist(), "keys": k_p.tolist(), "valid": prefix.prefix_valid.tolist(),
            "res": res.resident_keys.tolist(), "res_valid": res.resident_valid.tolist(), "sel": res.selection.tolist()}


PATHS = ["torch", "decide_op", "kernel"]  # composed ops; rcr::decide; the torch path with rcr::detector_pass


def fast_step(path: str, label: str, cfg: Scale, prefix, sel, generated, query, tau: list):
    """``label``'s decision at layer LAYER by ``path``, from thresholds ``tau`` (B,). Returns (decision, tau after)."""
    if path != "torch" and not rcr.fused.available():
        pytest.skip("the fused kernels could not be built here")
    method = cfg.replace(fused_kernel=path != "torch").method(label)
    store = prefix.to_host() if path == "kernel" else prefix
    res = resident(store, sel, generated, fused=path == "decide_op")
    state = method.init_state(prefix)
    assert state.fused is (path != "torch")
    t = torch.tensor(tau)
    state.tau.copy_(t.unsqueeze(1).expand_as(state.tau) if state.tau.dim() == 2 else t)
    reader = None
    if path == "kernel":  # offload mode on CPU: the torch path, with the detector kernel
        reader = HostReader(store, torch.device("cpu"), np.zeros((prefix.batch_size, N_LAYERS, 1)))
    ctx = StepContext(layer=LAYER, step=0, query=query, resident=res, prefix=store, state=state, config=method.config,
                      reader=reader)
    d = method.decide(ctx)
    tau_after = state.tau[:, LAYER] if state.tau.dim() == 2 else state.tau
    return d, tau_after, res


def thresholds(want: dict, signal: str) -> list:
    """Per sample, a threshold between its drifts (or at 0.9x / 1.1x its layer drift, alternating), so that triggers
    fire at some samples (KV heads) and not at others."""
    if signal == "heads":
        return [sum(sorted(d)[:2]) / 2 if len(d) > 1 else d[0] * 0.9 for d in want["drift_h"]]
    return [d * (0.9 if b % 2 == 0 else 1.1) for b, d in enumerate(want["drift"])]


def check(path, label, cfg, state, want_fn=reference_step):
    prefix, sel, generated, query = state
    x = as_lists(prefix, resident(prefix, sel, generated, fused=False), query)
    probe = want_fn(x, cfg, label, [1.0] * prefix.batch_size)
    tau = thresholds(probe, cfg.controller_signal)
    want = want_fn(x, cfg, label, tau)
    got, tau_after, res = fast_step(path, label, cfg, prefix, sel, generated, query, tau)
    trig = torch.tensor(want["trigger"])
    assert torch.equal(got.trigger, trig), "trigger"
    assert trig.any() and (prefix.batch_size == 1 or not trig.all()), "triggers must fire, and not everywhere"
    torch.testing.assert_close(got.drift, torch.tensor(want["drift"]), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(tau_after, torch.tensor(want["tau"]), rtol=1e-6, atol=0)
    rows = trig.view(prefix.batch_size, -1).expand(-1, HKV)
    if path == "kernel":  # offload mode reads and re-scores only the rows that fired
        assert got.selection is not None
    sel_want = torch.tensor(want["selection"])
    assert torch.equal(got.selection[rows], sel_want[rows]), "selection where fired"
    if path == "torch":  # the composed ops re-select every row; the masked merge keeps the ones that fired
        assert torch.equal(got.selection, sel_want), "selection"
        assert not got.merged and not got.recorded
    if path == "decide_op":  # only the rows that fired are re-selected, and the op has merged them
        assert torch.equal(got.selection[~rows], sel[~rows]), "a row that did not fire keeps its selection"
        assert got.merged and not got.recorded  # no telemetry in the step context
        assert_merged(res, prefix, got.selection, sel, rows)


def assert_merged(res, prefix, new_sel, old_sel, rows):
    """The resident slots [0, S) hold the prefix rows of ``new_sel`` where ``rows`` fired, of ``old_sel`` elsewhere;
    the window and generated slots are untouched."""
    k_p, v_p = prefix.prefix_kv(LAYER)
    want = torch.where(rows.unsqueeze(-1), new_sel, old_sel)
    idx = want.unsqueeze(-1).expand(*want.shape, D)
    assert torch.equal(res.selection, want)
    assert torch.equal(res.keys[:, :, :S], torch.gather(k_p, 2, idx))
    assert torch.equal(res.values[:, :, :S], torch.gather(v_p, 2, idx))
    assert torch.equal(res.slot_valid[:, :, :S], torch.gather(prefix.prefix_valid.unsqueeze(1).expand(-1, HKV, -1), 2,
                                                              want))
    assert torch.equal(res.keys[:, :, S : S + W], prefix.layers[LAYER].keys[:, :, N_PREFIX:])


ABLATIONS = {"paper": {}, "approx": {"kept_logits": "approx"}, "scored": {"prob_norm": "scored"},
             "both": {"kept_logits": "approx", "prob_norm": "scored"}, "max_logit": {"head_reduction": "max_logit"},
             "heads": {"controller_signal": "heads"}}
CFG = Scale(rcr.RCRConfig(selected=S, window=W), candidates=C, rank=RANK)


# every variant for rcr; fixed and rcr_layer differ only in the threshold, so the default, the ablated ranking and
# per-head triggers
CASES = [(a, "rcr") for a in ABLATIONS] + [(a, lb) for lb in ("fixed", "rcr_layer")
                                           for a in ("paper", "approx", "heads")]


@pytest.mark.parametrize("batch", [(1, False), (3, True)], ids=["batch1", "padded"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("ablation,label", CASES, ids=[f"{lb}-{a}" for a, lb in CASES])
def test_every_path_makes_the_reference_decisions(ablation, label, path, batch):
    state = random_state(*batch, seed=1)
    check(path, label, CFG.replace(**ABLATIONS[ablation]), state)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("batch", [(1, False), (3, True)], ids=["batch1", "padded"])
@pytest.mark.parametrize("label", ["rcr", "fixed"])
def test_a_kept_sink_outside_the_detector_basis_survives_a_refresh(label, batch, path):
    """The paper ranks kept entries by their exact logits. A kept sink whose key is orthogonal to the rank-r basis
    (approximate logit 0) but holds most of the attention stays a candidate and stays selected after a refresh."""
    prefix, sel, generated, query = state = random_state(*batch, seed=2, sink=True)
    x = as_lists(prefix, resident(prefix, sel, generated, fused=False), query)
    share = []  # the sink's exact share of each head's attention over its resident slots
    for q_bh, r_bh in zip((q for q_b in x["q"] for q in q_b), (r for r_b in x["res"] for r in r_b)):
        for qv in q_bh:
            z = [dot(qv, k) * SCALING for k in r_bh]
            share.append(math.exp(z[0] - lse(z)))
    assert min(share) > 0.9
    basis = torch.tensor(detector_basis(x["keys"][0][0], x["valid"][0], RANK))
    assert basis[-1].abs().max() < 1e-9  # the sink's axis is outside the detector's basis
    cfg = CFG.replace(tau0=1e-12, tau=0.0)  # every drift > 0 fires
    got, _, _ = fast_step(path, label, cfg, prefix, sel, generated, query, [cfg.tau0] * prefix.batch_size)
    assert got.trigger.all()
    assert (got.selection == SINK).any(-1).all(), "the kept sink was evicted by the refresh"
    want = reference_step(x, cfg, label, [cfg.tau0] * prefix.batch_size)
    assert torch.equal(got.selection, torch.tensor(want["selection"]))
    # the ablation (kept entries ranked by their approximate logits) drops the sink from the candidates
    ablated, _, _ = fast_step(path, label, cfg.replace(kept_logits="approx"), *state, [cfg.tau0] * prefix.batch_size)
    assert not (ablated.selection == SINK).any(-1).any()


@pytest.mark.parametrize("batch", [(1, False), (3, True)], ids=["batch1", "padded"])
@pytest.mark.parametrize("norm", ["context", "scored"])
def test_exact_selects_by_the_reference_probabilities(norm, batch):
    prefix, sel, generated, query = random_state(*batch, seed=3)
    cfg = CFG.replace(prob_norm=norm)
    res = resident(prefix, sel, generated, fused=False)
    method = cfg.method("exact")
    d = method.decide(StepContext(layer=LAYER, step=0, query=query, resident=res, prefix=prefix, state=None,
                                  config=cfg.config))
    assert torch.equal(d.selection, torch.tensor(reference_exact(as_lists(prefix, res, query), cfg)))

