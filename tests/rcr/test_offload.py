"""Offload (deployment) mode: the prefix store in host memory, reads only where the trigger fired, bytes counted.
On CPU the outputs must equal resident (GPU-only) mode token for token."""

import numpy as np
import pytest
import torch

import rcr
from pipeline.schema import telemetry_summary
from rcr.offload import HostReader
from tests import tiny_models
from tests.methods import Scale

SMALL = Scale(rcr.RCRConfig(selected=8, window=8), candidates=32, tau0=0.3)
OFFLOAD_METHODS = ["rcr", "fixed", "rcr_layer"]


@pytest.fixture(scope="module")
def qwen():
    model, proc = tiny_models.qwen2_vl()
    inputs = tiny_models.batch_inputs(proc, [4, 20], image_size=224)  # left padded
    prefix = rcr.prefill(model, inputs, SMALL.config)
    probe = rcr.decode(model, prefix, SMALL.method("rcr"), 8, eos_token_id=[]).telemetry.drift
    return model, inputs, prefix, float(np.median(probe))


@pytest.mark.parametrize("signal", ["layer", "heads"])
def test_offload_and_resident_modes_give_identical_outputs(qwen, signal):
    model, inputs, _, tau0 = qwen
    cfg = SMALL.replace(tau0=tau0, tau=tau0, controller_signal=signal)
    res = rcr.generate(model, inputs, method=cfg.methods(OFFLOAD_METHODS), max_new_tokens=14, ignore_eos=True)
    off = rcr.generate(model, inputs, method=cfg.replace(offload=True).methods(OFFLOAD_METHODS), max_new_tokens=14,
                       ignore_eos=True)
    d, elt = 32, 4  # head dim, fp32
    H = 2  # KV heads
    for m in OFFLOAD_METHODS:
        a, b = res[m], off[m]
        assert b.offload and not a.offload
        assert torch.equal(a.sequences, b.sequences), m
        for f in ("trigger", "tau", "keys_read", "values_read"):
            np.testing.assert_array_equal(getattr(a.telemetry, f), getattr(b.telemetry, f), err_msg=f"{m}/{f}")
        # equal to rounding: on CPU resident mode decides in one C++ op (rcr.fused), offload mode with torch ops
        np.testing.assert_allclose(a.telemetry.drift, b.telemetry.drift, rtol=1e-5, atol=1e-7, err_msg=f"{m}/drift")
        trig = b.telemetry.trigger  # fraction of the layer's KV heads that fired
        assert 0 < trig.mean() < 1, "the test needs layer-steps that fire and others that do not"
        # bytes: exactly (C keys + S values) x d x element size for every KV head that fired, nothing otherwise
        np.testing.assert_allclose(b.telemetry.bytes_moved, trig * H * (32 + 8) * d * elt)
        assert (a.telemetry.bytes_moved == 0).all()  # GPU-only mode copies nothing from the host
        s = telemetry_summary(b.sample(1))  # the output row's column
        assert s["bytes_moved_per_step"] == pytest.approx(trig[1].sum(0).mean() * H * 40 * d * elt)


def test_offload_reads_only_the_rows_that_fired(qwen, monkeypatch):
    model, _, prefix, tau0 = qwen
    cfg = SMALL.replace(tau0=tau0, controller_signal="heads", offload=True)
    reads, decisions = [], []
    gather = HostReader.gather

    def spy(self, layer, step, kind, idx, rows):
        out = gather(self, layer, step, kind, idx, rows)
        reads.append((layer, step, kind, rows.clone()))
        assert (out[~rows.to(out.device)] == 0).all()  # rows that did not fire were not read
        return out

    monkeypatch.setattr(HostReader, "gather", spy)
    m = cfg.method("rcr")
    decide = m.decide

    def rec(ctx):
        d = decide(ctx)
        decisions.append((ctx.layer, ctx.step, d.trigger.clone(), d.selection is None))
        assert ctx.prefix.offloaded and ctx.prefix.layers[ctx.layer].keys.device.type == "cpu"
        return d

    m.decide = rec
    r = rcr.decode(model, prefix, m, 10, eos_token_id=[])
    assert r.offload
    by_step = {(layer, step, kind): rows for layer, step, kind, rows in reads}
    n_skipped = 0
    for layer, step, trig, skipped in decisions:
        if not trig.any():
            assert skipped and (layer, step, "keys") not in by_step  # nothing fired: nothing read
            n_skipped += 1
        else:
            assert torch.equal(by_step[(layer, step, "keys")], trig)
            assert torch.equal(by_step[(layer, step, "values")], trig)
    assert n_skipped > 0 and len(reads) > 0


def test_offload_applies_to_drift_methods_only(qwen):
    model, inputs, prefix, _ = qwen
    cfg = SMALL.replace(offload=True)
    out = rcr.generate(model, inputs, method=cfg.methods(["full", "exact", "quest", "rcr"]), max_new_tokens=4,
                       ignore_eos=True)
    assert out["rcr"].offload and not out["exact"].offload and not out["quest"].offload
    host = prefix.to_host()
    assert host is prefix.to_host() and host.offloaded and not prefix.offloaded  # one shared host copy
    assert all(pl.keys.device.type == "cpu" and pl.keys.is_contiguous() for pl in host.layers)


def test_offload_equals_resident_and_full_on_every_family(family):
    """Per family: offload == resident at a small budget, and == full with a budget over the prefix."""
    name, model, proc = family
    inputs = tiny_models.batch_inputs(proc, [3, 12])
    small = Scale(rcr.RCRConfig(selected=4, window=4), candidates=8, tau0=0.05)
    a = rcr.generate(model, inputs, method=small.methods(["rcr"]), max_new_tokens=8, ignore_eos=True)["rcr"]
    b = rcr.generate(model, inputs, method=small.replace(offload=True).methods(["rcr"]), max_new_tokens=8,
                     ignore_eos=True)["rcr"]
    assert b.offload and torch.equal(a.sequences, b.sequences), name
    big = Scale(rcr.RCRConfig(selected=4096, window=8, offload=True), candidates=4096)
    r = rcr.generate(model, inputs, method=big.methods(["full", "rcr", "rcr_layer"]), max_new_tokens=8,
                     ignore_eos=True)
    assert torch.equal(r["rcr"].sequences, r["full"].sequences), name
    assert torch.equal(r["rcr_layer"].sequences, r["full"].sequences), name
