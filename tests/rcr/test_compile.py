"""The compiled decode (``RCRConfig.compile``): the whole decode step (model forward + every layer's decision)
is one ``torch.compile(fullgraph=True)`` graph over a static-shape resident cache. On CPU with torch's "eager"
backend (dynamo traces and checks the graph; no code generation, so the test is quick): no graph break, no
recompilation after the first step, and the same tokens and telemetry as the eager decode, with left padding.
"""

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import rcr
from rcr.methods import parse_method
from tests import tiny_models

CFG = rcr.RCRConfig(selected=8, window=8, candidates=32, tau0=0.3)
N_NEW = 12


@pytest.fixture(scope="module")
def padded_prefix():
    model, proc = tiny_models.qwen2_vl()
    inputs = tiny_models.batch_inputs(proc, [4, 20], image_size=224)
    assert not inputs["attention_mask"].bool().all()
    prefix = rcr.prefill(model, inputs, CFG)
    probe = rcr.decode(model, prefix, parse_method("rcr", CFG), 6, eos_token_id=[])
    med = float(np.median(probe.telemetry.drift))  # thresholds at the median drift: triggers fire, not always
    return model, prefix, CFG.replace(tau0=med, fixed_tau=med)


@pytest.mark.parametrize("label", ["rcr", "rcr_layer", "fixed", "exact", "quest", "bacon", "full"])
def test_compiled_decode_is_one_graph_and_equals_eager(padded_prefix, label):
    model, prefix, cfg = padded_prefix
    cfg = cfg.replace(exact_drift=True)
    eager = rcr.decode(model, prefix, parse_method(label, cfg), N_NEW, eos_token_id=[])

    torch._dynamo.reset()
    counters.clear()
    dec = rcr.Decoder(model, prefix, parse_method(label, cfg.replace(compile="eager")), N_NEW, eos_token_id=[])
    assert all(layer.static for layer in dec.cache.layers)
    with dec.enabled(), torch.no_grad():
        dec.step()  # traces and compiles
        with torch._dynamo.config.patch(error_on_recompile=True):  # any later recompilation raises
            while dec.t < N_NEW - 1:
                dec.step()
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    got = dec.result(0.0, 0.0)
    assert torch.equal(got.sequences, eager.sequences)
    for name in ("trigger", "tau", "keys_read", "values_read", "detector_dots"):
        np.testing.assert_array_equal(getattr(got.telemetry, name), getattr(eager.telemetry, name), err_msg=name)
    np.testing.assert_allclose(got.telemetry.drift, eager.telemetry.drift, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got.telemetry.drift_exact, eager.telemetry.drift_exact, rtol=1e-5, atol=1e-7)
    if label in ("rcr", "rcr_layer", "fixed"):
        assert 0 < got.telemetry.trigger.mean() < 1


def test_compile_field_is_validated():
    with pytest.raises(rcr.ConfigError, match="compile"):
        rcr.RCRConfig(compile="fast")
    with pytest.raises(rcr.ConfigError, match="compile"):
        rcr.RCRConfig(compile="reduce-overhead", offload=True)
