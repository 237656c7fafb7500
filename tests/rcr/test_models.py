"""Loading a Qwen2-VL whose first layer is local (the embedded model's layout: Qwen2's `use_sliding_window` with
`layer_types`): the window is applied under SDPA, the stale "not implemented for `sdpa`" notice is dropped, the
local layer is reported as never re-selected, and decoding with every prefix entry selected is transformers' own."""

from __future__ import annotations

import logging

import torch

import rcr
from rcr.models import STALE_WINDOW_NOTICE, build_inputs, geometry, load
from tests import tiny_models
from tests.rcr.test_equivalence import BIG, N_NEW, hf_greedy

WINDOW = 8


def _local_first_layer(tmp_path):
    base, proc = tiny_models.qwen2_vl()
    cfg = base.config.to_dict()
    n = cfg["text_config"]["num_hidden_layers"]
    cfg["text_config"].update(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=n,
                              layer_types=["sliding_attention"] + ["full_attention"] * (n - 1))
    model = type(base)(base.config.__class__.from_dict(cfg)).eval()
    model.load_state_dict(base.state_dict())
    model.save_pretrained(tmp_path)
    proc.save_pretrained(tmp_path)
    return tmp_path


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_a_local_first_layer_loads_quietly_and_attends_within_its_window(tmp_path):
    path = _local_first_layer(tmp_path)
    logging.Logger.warning_once.cache_clear()  # transformers' once-only notices: as in a fresh process
    seen = _Records()
    logger = logging.getLogger("transformers.models.qwen2_vl.modeling_qwen2_vl")
    logger.addHandler(seen)
    try:
        model, _ = load(str(path))
    finally:
        logger.removeHandler(seen)
    assert not any(STALE_WINDOW_NOTICE in m for m in seen.messages), seen.messages
    assert geometry(model).sliding_windows == (WINDOW, None, None)
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(10, 40, (1, 3 * WINDOW))
    far = ids.clone()
    far[0, :WINDOW] = torch.randint(10, 40, (WINDOW,))  # changes only tokens outside the last position's window
    with torch.no_grad():
        a = model(input_ids=ids, output_hidden_states=True).hidden_states
        b = model(input_ids=far, output_hidden_states=True).hidden_states
    assert torch.equal(a[1][0, -1], b[1][0, -1])  # the local layer does not see them
    assert not torch.equal(a[2][0, -1], b[2][0, -1])  # the global layer after it does


def test_a_local_first_layer_decodes_as_transformers_with_every_entry_selected(tmp_path):
    model, proc = load(str(_local_first_layer(tmp_path)))
    inputs = tiny_models.batch_inputs(proc, [3, 30, 12])
    res = rcr.generate(model, inputs, method=BIG.methods(["full", "exact", "rcr"]), max_new_tokens=N_NEW,
                       ignore_eos=True)
    ref = hf_greedy(model, inputs, N_NEW)
    for label, r in res.items():
        assert torch.equal(r.sequences, ref), label
        assert torch.isnan(torch.from_numpy(r.telemetry.trigger[:, 0])).all(), label  # never re-selected


def test_build_inputs_without_images_decodes_as_transformers():
    """A text-only batch (no sample has an image: lmms-eval's text tasks) builds without image inputs, left padded,
    and every method decodes it as transformers does: with a 6-entry window the prefix is what precedes it."""
    for make in (tiny_models.qwen2_vl, tiny_models.llava):
        model, proc = make()
        prompts = [tiny_models.random_prompt(0, 3), tiny_models.random_prompt(1, 30)]
        inputs = build_inputs(proc, prompts, [[], []])
        assert "pixel_values" not in inputs and not inputs["attention_mask"].bool().all()
        res = rcr.generate(model, inputs, method=BIG.replace(window=6).methods(["full", "rcr"]), max_new_tokens=N_NEW,
                           ignore_eos=True)
        ref = hf_greedy(model, inputs, N_NEW)
        for label, r in res.items():
            assert torch.equal(r.sequences, ref), (make.__name__, label)
