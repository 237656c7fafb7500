"""With a selected-slot budget >= the prefix, every method must reproduce `full` token for token, and `full`
must reproduce transformers' own greedy `generate`: on video (temporal M-RoPE rows), on sliding-window layers and
on windows from the config. This guards positions, the resident layout, masks with left padding, and the
prefill-once/decode-many path. (Images on every family, fp32 and bf16, batch 1 and left padded, are a contract of
every registered method: test_method_contracts.py.)"""


import numpy as np
import pytest
import torch

import rcr
from rcr.generate import build_cache
from rcr.models import build_inputs, geometry
from tests import tiny_models
from tests.methods import Scale

# Every method test runs over the registry: a method added to it is covered automatically.
ALL_METHODS = list(rcr.METHODS)

BIG = Scale(rcr.RCRConfig(selected=4096, window=8), candidates=4096)  # budget >= any test prefix
N_NEW = 10


def hf_greedy(model, inputs, n):
    out = model.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[:, inputs["input_ids"].shape[1]:]


def test_video_every_method_equals_full_and_transformers(family):
    """Video positions (Qwen's temporal M-RoPE rows, Qwen2.5-VL's frame spacing) on a left-padded batch of 2."""
    name, model, proc = family
    if getattr(proc, "video_processor", None) is None:
        pytest.skip(f"{name}: image-only family")
    frames = [[tiny_models.random_image(10 * b + i, 56) for i in range(4)] for b in range(2)]
    inputs = build_inputs(proc, [tiny_models.random_prompt(0, 4), tiny_models.random_prompt(1, 11)], frames,
                          video=True)
    assert not inputs["attention_mask"].bool().all()
    res = rcr.generate(model, inputs, method=BIG.methods(ALL_METHODS), max_new_tokens=6, ignore_eos=True)
    assert torch.equal(res["full"].sequences, hf_greedy(model, inputs, 6)), f"{name}: full != transformers generate"
    for label in ALL_METHODS:
        assert torch.equal(res[label].sequences, res["full"].sequences), f"{name}/{label} diverged from full"


def test_compressed_methods_differ_from_full_with_small_budget():
    """The converse: at a small budget the cache really is compressed (otherwise the test above is vacuous)."""
    model, proc = tiny_models.qwen2_vl()
    inputs = tiny_models.batch_inputs(proc, [6], image_size=224)
    cfg = Scale(rcr.RCRConfig(selected=4, window=4), candidates=8)
    res = rcr.generate(model, inputs, method=cfg.methods(["full", "bacon", "exact"]), max_new_tokens=N_NEW,
                       ignore_eos=True)
    assert not torch.equal(res["bacon"].sequences, res["full"].sequences)
    assert not torch.equal(res["exact"].sequences, res["full"].sequences)


def test_sliding_window_layers_keep_their_whole_prefix_and_global_layers_are_compressed():
    """Gemma 3 at a small budget: the local (sliding-window) layer holds every prefix entry and makes no decision;
    the global layer holds `selected` entries and re-selects them."""
    model, proc = tiny_models.gemma3()
    inputs = tiny_models.batch_inputs(proc, [3, 30, 12])
    cfg = Scale(rcr.RCRConfig(selected=4, window=4), candidates=8)
    prefix = rcr.prefill(model, inputs, cfg.config)
    windows = [pl.sliding_window for pl in prefix.layers]
    assert windows == [tiny_models.GEMMA_SLIDING_WINDOW, None]
    assert prefix.n_prefix > tiny_models.GEMMA_SLIDING_WINDOW  # the window really drops prefix entries
    cache = build_cache(cfg.method("exact"), prefix, N_NEW)
    assert cache.layers[0].n_selected == prefix.n_prefix and cache.layers[1].n_selected == 4
    res = rcr.generate(model, inputs, method=cfg.methods(["full", "exact"]), max_new_tokens=N_NEW, ignore_eos=True)
    trigger = res["exact"].telemetry.trigger  # (B, L, T)
    assert np.isnan(trigger[:, 0]).all() and (trigger[:, 1] == 1).all()  # the local layer has no selection
    assert not torch.equal(res["exact"].sequences, res["full"].sequences)


def test_a_window_from_the_config_applies_to_every_layer():
    """Mistral passes its config's `sliding_window` to every layer (no per-layer attribute): with a window shorter
    than the prompt, every layer is windowed, none is re-selected, and `full` still equals transformers."""
    from transformers import LlavaNextForConditionalGeneration

    base, proc = tiny_models.llava_next()
    cfg = base.config.__class__.from_dict(base.config.to_dict())
    cfg.text_config.sliding_window = 12
    model = LlavaNextForConditionalGeneration(cfg).eval()
    model.load_state_dict(base.state_dict())
    assert geometry(model).sliding_windows == (12,) * cfg.text_config.num_hidden_layers
    inputs = tiny_models.batch_inputs(proc, [3, 30, 12])
    res = rcr.generate(model, inputs, method=BIG.methods(["full", "exact"]), max_new_tokens=N_NEW, ignore_eos=True)
    ref = hf_greedy(model, inputs, N_NEW)
    assert torch.equal(res["full"].sequences, ref) and torch.equal(res["exact"].sequences, ref)
    assert not torch.equal(ref, hf_greedy(base, inputs, N_NEW))  # the window changed the answer
    assert np.isnan(res["exact"].telemetry.trigger).all()  # no layer has a selection: none is re-selected


def _with_text_config(family: str, drop: tuple[str, ...] = (), **changes):
    """The tiny model of ``family`` with its text config changed (dropped keys: transformers' defaults), same weights
    as the cached one."""
    base, proc = tiny_models.FAMILIES[family]()
    d = base.config.to_dict()
    for k in drop:
        del d["text_config"][k]
    d["text_config"].update(changes)
    model = type(base)(base.config.__class__.from_dict(d)).eval()
    model.load_state_dict(base.state_dict())
    return model, proc


def test_a_mistral_config_without_a_window_is_compressed_at_every_layer():
    """LLaVA-NeXT-Mistral's text config without `sliding_window` inherits transformers' default window (4096),
    which cannot exclude anything of a shorter context: every layer is global, re-selected and compressed."""
    model, proc = _with_text_config("llava_next", drop=("sliding_window",))
    L = model.config.text_config.num_hidden_layers
    assert geometry(model).sliding_windows == (4096,) * L
    inputs = tiny_models.batch_inputs(proc, [3, 30, 12])
    context = inputs["input_ids"].shape[1] + N_NEW - 1
    assert geometry(model).reselected(context) == (True,) * L
    cfg = Scale(rcr.RCRConfig(selected=4, window=4), candidates=8)
    res = rcr.generate(model, inputs, method=cfg.methods(["full", "exact", "rcr"]), max_new_tokens=N_NEW,
                       ignore_eos=True)
    assert torch.equal(res["full"].sequences, hf_greedy(model, inputs, N_NEW))
    assert (res["exact"].telemetry.trigger == 1).all()  # a decision at every layer-step of every layer
    assert not np.isnan(res["rcr"].telemetry.trigger).any()
    assert not torch.equal(res["exact"].sequences, res["full"].sequences)  # compressed


def test_a_window_is_local_exactly_when_it_can_exclude_an_entry():
    """The longest a decode's attention gets is N + max_new_tokens - 1 entries (the last token is never fed): a
    window that long is global (re-selected), one entry shorter it is local, and `full` is transformers' own."""
    _, proc = tiny_models.llava_next()
    inputs = tiny_models.batch_inputs(proc, [3, 30, 12])
    longest = inputs["input_ids"].shape[1] + N_NEW - 1
    for window, reselected in ((longest, True), (longest - 1, False)):
        model, _ = _with_text_config("llava_next", sliding_window=window)
        res = rcr.generate(model, inputs, method=BIG.methods(["full", "exact"]), max_new_tokens=N_NEW, ignore_eos=True)
        assert torch.equal(res["full"].sequences, hf_greedy(model, inputs, N_NEW)), window
        trigger = res["exact"].telemetry.trigger
        assert ((trigger == 1).all() if reselected else np.isnan(trigger).all()), window


def test_a_gemma3_window_longer_than_the_context_is_reselected():
    """Gemma 3's local layers are global once their window covers the context; with the tiny config's short window
    the local layer is not re-selected (test_sliding_window_layers_keep_their_whole_prefix_...)."""
    model, proc = _with_text_config("gemma3", sliding_window=4096)
    inputs = tiny_models.batch_inputs(proc, [3, 30, 12])
    assert geometry(model).sliding_windows[0] == 4096
    assert geometry(model).reselected(inputs["input_ids"].shape[1] + N_NEW - 1) == (True, True)
    cfg = Scale(rcr.RCRConfig(selected=4, window=4), candidates=8)
    res = rcr.generate(model, inputs, method=cfg.methods(["full", "exact"]), max_new_tokens=N_NEW, ignore_eos=True)
    assert torch.equal(res["full"].sequences, hf_greedy(model, inputs, N_NEW))
    assert (res["exact"].telemetry.trigger == 1).all()


@pytest.fixture
def fresh_dynamo():
    """Dynamo's state lives for the process: a later compile of the same decode frame for another family would see
    a changed float (the attention scaling), trace it as dynamic and read it with `.item()` inside the graph."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("label", ["full", "exact"])
def test_compiled_decode_keeps_the_window_on_sliding_window_layers(label, fresh_dynamo):
    """The static-shape compiled decode (torch's "eager" backend: traced as one graph, no code generation) limits
    Gemma 3's local layer to its window as the eager decode does, on a left-padded batch whose prefix is longer
    than the window; `full` compiled still equals transformers' own `generate`."""
    model, proc = tiny_models.gemma3()
    inputs = tiny_models.batch_inputs(proc, [3, 30, 12])
    cfg = Scale(rcr.RCRConfig(selected=4, window=4), candidates=8)
    prefix = rcr.prefill(model, inputs, cfg.config)
    assert prefix.n_prefix > tiny_models.GEMMA_SLIDING_WINDOW
    eager = rcr.decode(model, prefix, cfg.method(label), N_NEW, eos_token_id=[])
    dec = rcr.Decoder(model, prefix, cfg.replace(compile="eager").method(label), N_NEW, eos_token_id=[])
    assert all(layer.static for layer in dec.cache.layers)
    dec.run()
    compiled = dec.result(0.0, 0.0)
    assert torch.equal(compiled.sequences, eager.sequences)
    if label == "full":
        assert torch.equal(compiled.sequences, hf_greedy(model, inputs, N_NEW))
    else:  # the global layer is compressed and re-selected, the local one is not
        assert np.isnan(compiled.telemetry.trigger[:, 0]).all() and (compiled.telemetry.trigger[:, 1] == 1).all()
