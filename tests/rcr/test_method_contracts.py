"""The contracts every method keeps, each test parametrized over the registry (``rcr.METHODS``): a method that is
registered joins every contract, with no list to edit.

1. No host read of a device value inside a decode step, eager or compiled (``tests/host_sync.py``).
2. A compiled decode (torch's "eager" backend: dynamo traces and checks the graph, no code generation) is one graph
   that never recompiles and gives the eager decode's tokens and telemetry, on a left-padded batch.
3. Every tensor the compiled step reads or writes is a static address (``torch._dynamo.mark_static_address``, or a
   module weight, which dynamo marks itself), so a CUDA graph (``compile="reduce-overhead"``) replays on it without a
   copy and a tensor updated in place (RCR's threshold, ArkVale's page cache) does not stop the capture.
4. With a budget >= the prefix, every method reproduces ``full`` token for token on every family, fp32 and bf16,
   batch 1 and a left-padded batch of 3 (``full`` itself is checked against transformers' ``generate``).
5. A left-padded batch gives each sample the tokens and decisions it gets decoded alone.
6. The reads a row reports are the method's own cost model: per KV head and layer-step, over the layers the method
   re-selects, the refresh fraction times its reads per refresh (docs/algorithms.md, "Cost per decode step").
"""

import copy
import sys

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import rcr
from pipeline.schema import telemetry_summary
from tests import tiny_models
from tests.host_sync import HostSync, forbid_host_sync
from tests.methods import Scale

# each method's contracts carry the mark method(name=...): `-m "method(name='rcr')"` selects exactly rcr's (`-k rcr`
# matches every id that contains "rcr", rcr_layer's too)
METHODS = [pytest.param(m, marks=pytest.mark.method(name=m)) for m in sorted(rcr.METHODS)]
# refreshkv's full steps every 3 decode steps: several in each decode here (its default, 10, would come after them)
SMALL = Scale(rcr.RCRConfig(selected=8, window=8), candidates=32, tau0=0.3, page_size=4, stride=3)
BIG = Scale(rcr.RCRConfig(selected=4096, window=8), candidates=4096, stride=3)  # budget >= any test prefix
N_NEW = 10


def decode(model, prefix, label, cfg, n, reference=None):
    return rcr.decode(model, prefix, cfg.method(label), n, eos_token_id=[], reference_scores=reference)


def with_reference(model, prefix, cfg, n):
    """``full``'s decode and its answer's attention (what ``prefill_oracle`` selects by)."""
    full = decode(model, prefix, "full", cfg, n)
    return full, rcr.answer_attention_scores(model, prefix, full)


@pytest.fixture(scope="module")
def padded():
    """A left-padded batch of 2 on the tiny Qwen2-VL (64 visual tokens per image), thresholds at its median drift
    so that the drift methods fire at some layer-steps and not at others."""
    model, proc = tiny_models.qwen2_vl()
    inputs = tiny_models.batch_inputs(proc, [4, 20], image_size=224)
    assert not inputs["attention_mask"].bool().all()
    prefix = rcr.prefill(model, inputs, SMALL.config)
    med = float(np.median(decode(model, prefix, "rcr", SMALL, 6).telemetry.drift))
    cfg = SMALL.replace(tau0=med, tau=med)
    return model, prefix, cfg, with_reference(model, prefix, cfg, 12)[1]


def assert_same_telemetry(got: dict, want: dict, where: str = "") -> None:
    """Every telemetry array equal (the drifts to rounding: other kernels may sum in another order)."""
    assert got.keys() == want.keys()
    for name, value in got.items():
        if value is None or want[name] is None:
            assert value is None and want[name] is None, f"{where}{name}"
        elif name.startswith("drift"):
            np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-7, err_msg=f"{where}{name}")
        else:
            np.testing.assert_array_equal(value, want[name], err_msg=f"{where}{name}")


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------- 1. no host sync

@pytest.mark.parametrize("compile", [None, "eager"], ids=["eager_decode", "compiled_decode"])
@pytest.mark.parametrize("label", METHODS)
def test_a_decode_step_makes_no_host_sync(padded, label, compile, fresh_dynamo):
    model, prefix, cfg, reference = padded
    cfg = cfg.replace(exact_drift=True, record_attention=True, compile=compile)
    dec = rcr.Decoder(model, prefix, cfg.method(label), 6, eos_token_id=[0], reference_scores=reference)
    with dec.enabled(), torch.no_grad():
        dec.step()  # compiles
        with forbid_host_sync():
            with pytest.raises(HostSync):  # the guard itself works
                torch.ones(1).item()
            dec.step()
            dec.step()
    assert dec.t == 3


# ------------------------------------------------------------------------------------ 2. compiled == eager

@pytest.mark.parametrize("label", METHODS)
def test_a_compiled_decode_is_one_graph_and_equals_eager(padded, label, fresh_dynamo):
    model, prefix, cfg, reference = padded
    cfg = cfg.replace(exact_drift=True)
    n = 12
    eager = decode(model, prefix, label, cfg, n, reference)
    dec = rcr.Decoder(model, prefix, (cfg.replace(compile="eager")).method(label), n, eos_token_id=[],
                      reference_scores=reference)
    assert all(layer.static for layer in dec.cache.layers)
    with dec.enabled(), torch.no_grad():
        dec.step()  # traces and compiles
        with torch._dynamo.config.patch(error_on_recompile=True):  # any later recompilation raises
            while dec.t < n - 1:
                dec.step()
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    got = dec.result(0.0, 0.0)
    assert torch.equal(got.sequences, eager.sequences)
    assert_same_telemetry(vars(got.telemetry), vars(eager.telemetry))
    if cfg.method(label).supports_offload:  # the drift methods: their triggers really vary
        assert 0 < got.telemetry.trigger.mean() < 1


# ---------------------------------------------------------------------------------- 3. static addresses

@pytest.mark.parametrize("label", METHODS)
def test_every_input_of_the_compiled_step_is_a_static_address(padded, label, fresh_dynamo, monkeypatch):
    """A backend that records the graph dynamo hands it: each tensor input (placeholder) must carry dynamo's
    static-address mark, which is what CUDA graphs read to replay on an input without copying it, and what lets a
    graph mutate an input in place."""
    model, prefix, cfg, reference = padded
    inputs = []

    def recording_backend(gm, example_inputs):
        for node in gm.graph.find_nodes(op="placeholder"):
            if isinstance(node.meta.get("example_value"), torch.Tensor):
                source = getattr(node, "_dynamo_source", None)
                static = node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
                inputs.append((source.name if source else node.name, static))
        return gm.forward

    generate_module = sys.modules["rcr.generate"]  # (``rcr.generate`` the name is the function)
    monkeypatch.setattr(generate_module, "compile_options", lambda mode: {"backend": recording_backend})
    dec = rcr.Decoder(model, prefix, (cfg.replace(compile="eager")).method(label), 4, eos_token_id=[],
                      reference_scores=reference)
    with dec.enabled(), torch.no_grad():
        dec.step()
    assert inputs, "the backend saw no graph"
    assert [name for name, static in inputs if static is None] == []


# -------------------------------------------------------------------------------- 4. budget >= prefix

@pytest.fixture(scope="module")
def uncompressed():
    """Per (family, batch, dtype): the model, its prefix store, ``full``'s answer (checked against transformers'
    own greedy ``generate``) and its attention, computed once for every method."""
    runs = {}

    def get(family, words, dtype):
        key = (family, tuple(words), dtype)
        if key not in runs:
            model, proc = tiny_models.FAMILIES[family]()
            # bf16 on CPU: dtype mistakes show up without a GPU. A copy: the family's model is cached and shared
            # with other tests, and Module.to() converts in place.
            model = copy.deepcopy(model).to(dtype)
            inputs = tiny_models.batch_inputs(proc, words)
            if len(words) > 1:
                assert not inputs["attention_mask"].bool().all(), "the batch must be left padded"
            prefix = rcr.prefill(model, inputs, BIG.config)
            full, reference = with_reference(model, prefix, BIG, N_NEW)
            hf = model.generate(**inputs, max_new_tokens=N_NEW, do_sample=False, eos_token_id=None)
            assert torch.equal(full.sequences, hf[:, inputs["input_ids"].shape[1]:]), f"{family}: full != generate"
            runs[key] = (model, prefix, full, reference)
        return runs[key]

    return get


@pytest.mark.parametrize("family", list(tiny_models.FAMILIES))
@pytest.mark.parametrize("label", METHODS)
def test_a_budget_over_the_prefix_equals_full(uncompressed, label, family):
    for words in ([6], [3, 30, 12]):
        for dtype in (torch.float32, torch.bfloat16):
            model, prefix, full, reference = uncompressed(family, words, dtype)
            got = decode(model, prefix, label, BIG, N_NEW, reference)
            assert torch.equal(got.sequences, full.sequences), f"{family}, {len(words)} samples, {dtype}"


# ------------------------------------------------------------------------------- 5. padded == alone

@pytest.fixture(scope="module")
def batch_and_alone():
    """A left-padded batch of 3 prompts of 3, 30 and 12 words, and each of them as a batch of its own, prefilled
    once; thresholds at the batch's median drift. A window of 32 gives InfiniGen's per-sample calibration
    G x 32 = 64 window queries, more than the head dim (32): with fewer, the skew's columns outside their span are
    any orthogonal basis of it, which the arithmetic of a batch and of one sample settle differently."""
    model, proc = tiny_models.qwen2_vl()
    words = [3, 30, 12]
    batch = tiny_models.batch_inputs(proc, words, image_size=224)
    assert not batch["attention_mask"].bool().all()
    alone = [tiny_models.batch_inputs(proc, [w], image_size=224, seed=i) for i, w in enumerate(words)]
    cfg = SMALL.replace(window=32)
    prefix = rcr.prefill(model, batch, cfg.config)
    med = float(np.median(decode(model, prefix, "rcr", cfg, 6).telemetry.drift))
    cfg = cfg.replace(tau0=med, tau=med)
    prefixes = [prefix] + [rcr.prefill(model, inputs, cfg.config) for inputs in alone]
    return model, cfg, [(p, with_reference(model, p, cfg, 14)[1]) for p in prefixes]


@pytest.mark.parametrize("label", METHODS)
def test_a_padded_batch_equals_its_samples_decoded_alone(batch_and_alone, label):
    model, cfg, runs = batch_and_alone
    n = 14
    (prefix, reference), alone = runs[0], runs[1:]
    batch = decode(model, prefix, label, cfg, n, reference)
    for b, (p, ref) in enumerate(alone):
        one = decode(model, p, label, cfg, n, ref)
        assert torch.equal(batch.sequences[b], one.sequences[0]), f"sample {b}: tokens"
        assert_same_telemetry({k: None if v is None else v[b] for k, v in vars(batch.telemetry).items()},
                              {k: None if v is None else v[0] for k, v in vars(one.telemetry).items()}, f"sample {b}: ")


# ---------------------------------------------------------------------------- 6. reads = cost model

@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3"])  # gemma3: a local layer, never re-selected
@pytest.mark.parametrize("label", METHODS)
def test_the_reads_of_a_row_are_the_methods_cost_model(label, family):
    model, proc = tiny_models.FAMILIES[family]()
    inputs = tiny_models.batch_inputs(proc, [3, 30, 12])
    prefix = rcr.prefill(model, inputs, SMALL.config)
    full, reference = with_reference(model, prefix, SMALL, N_NEW)
    res = decode(model, prefix, label, SMALL, N_NEW, reference)
    cost = res.cost
    tel = res.telemetry
    local = np.isnan(tel.trigger).all(axis=(0, 2))  # (L,) layers with no selection
    assert local.any() == (family == "gemma3")
    # per layer-step: the refresh fraction times the reads per refresh; nothing on a layer without a selection
    for kind in ("keys", "values"):
        per_refresh = np.asarray(cost[f"{kind}_per_refresh"], np.float32).reshape(-1, 1, 1)  # (B or 1, 1, 1)
        np.testing.assert_array_equal(getattr(tel, f"{kind}_read")[:, ~local], tel.trigger[:, ~local] * per_refresh)
    assert (tel.keys_read[:, local] == 0).all() and (tel.values_read[:, local] == 0).all()
    for b in range(prefix.batch_size):  # the row: over the layers the method re-selects
        row = telemetry_summary(res.sample(b))
        for kind in ("keys", "values"):
            per_refresh = cost[f"{kind}_per_refresh"]  # a list: per sample
            per_refresh = per_refresh[b] if isinstance(per_refresh, list) else per_refresh
            assert row[f"{kind}_read_per_step"] == pytest.approx(row["refresh_fraction"] * per_refresh), kind
