"""The embedded model's training data (embedded/batches.py, curriculum.py, assets.py): the vision stage's
single-object scenes, the curriculum's plan, the model sizes' rotary sections and the grounding targets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedded.assets import MODEL_SIZES, SPECIAL_TOKENS, build_model, build_processor, build_tokenizer
from embedded.batches import VISION_ATTRIBUTES, VISION_INDEX_BASE, BatchBuilder, vision_batch
from embedded.curriculum import BOOTSTRAP_LAYOUT, CURRICULUM, batch_plan, make_batch
from pipeline.data import synthetic as S


def test_vision_batches_label_the_object_they_draw():
    """The vision stage's scenes (vision_batch): one object each, labelled with the size and colour its pixels
    show, alternately on the flat bootstrap canvas and on the layout's, the same for the same (seed, step) and
    others for the next step."""
    pix, grid, labels = vision_batch(0, 3, "v4", BOOTSTRAP_LAYOUT, n=6)
    again = vision_batch(0, 3, "v4", BOOTSTRAP_LAYOUT, n=6)
    assert torch.equal(pix, again[0]) and torch.equal(labels, again[2])
    assert labels.shape == (6, len(VISION_ATTRIBUTES)) and grid.shape == (6, 3)
    names = list(VISION_ATTRIBUTES)
    for i, row in enumerate(labels.tolist()):
        frames, text = S.render("detailcaps", 0, VISION_INDEX_BASE + 3 * 64 + i, n_objects=1,
                                layout=(BOOTSTRAP_LAYOUT, "v4")[i % 2])
        img = frames[0].reshape(-1, 3).astype(int)
        colour = np.array(S.COLOURS[VISION_ATTRIBUTES["colour"][row[names.index("colour")]]])
        painted = (img == colour).all(1) | (img == (colour * 0.3).astype(int)).all(1)  # its colour or its pattern
        # a big object (radius 22 px) covers at least ~870 px (a triangle), a small one (13 px) at most ~530
        big = VISION_ATTRIBUTES["size"][row[names.index("size")]] == "big"
        assert (painted.sum() > 700) == big, (text, painted.sum())
    assert grid[0].tolist() != grid[1].tolist()  # the flat bootstrap canvas and v4's, in turn
    assert not torch.equal(pix, vision_batch(0, 4, "v4", BOOTSTRAP_LAYOUT, n=6)[0])


def test_curriculum_bootstraps_vision_on_the_small_flat_canvas():
    """Steps of the first phases show BOOTSTRAP_LAYOUT's scenes, a middle phase mixes them with the recipe's
    layout's, the rest are all the layout's, and its textured canvas fades in from flat grey (CURRICULUM): from
    scratch on v4 the model never reads, and full texture at once unlearns what v1 taught."""
    n = 1000
    plans = [batch_plan(0, s, n, 1.0, "v4") for s in range(n)]
    assert plans == [batch_plan(0, s, n, 1.0, "v4") for s in range(n)]  # a pure function: resumes see the same
    assert CURRICULUM[0][3] == 0.0 and CURRICULUM[-1][3] == 1.0
    assert any(0 < c[3] < 1 for c in CURRICULUM)
    lo = 0.0
    for until, _, _, share, _ in CURRICULUM:
        on_target = [lay == "v4" for step, (_, lay, _, _) in enumerate(plans) if lo <= step / n < until]
        if share in (0.0, 1.0):  # a pure phase never shows the other canvas
            assert set(on_target) == {bool(share)}, until
        else:
            assert abs(np.mean(on_target) - share) < 0.15, (until, np.mean(on_target), share)
        lo = until
    for _, lay, items, _ in plans:  # object counts fit the scene they are drawn on
        cells = S.get_layout(lay).rows * S.get_layout(lay).cols
        assert all(n_obj is None or 1 <= n_obj <= cells for _, _, n_obj in items)
    # the canvas: the layout's first scenes are flat (v3's twin), its strength never falls, and ends at full
    ramp = [(step, strength) for step, (_, lay, _, strength) in enumerate(plans) if lay == "v4"]
    strengths = [x for _, x in ramp]
    assert strengths[0] < 0.01 and strengths == sorted(strengths) and strengths[-1] == 1.0
    assert 0.1 * n < next(step for step, x in ramp if x == 1.0) - ramp[0][0]  # faded in over many steps
    assert all(x == 1.0 for _, lay, _, x in plans if lay != "v4")
    # the batches are drawn on the planned layout (v1 is 24 x 24 patches, v4 40 x 32) at the planned strength
    builder = BatchBuilder(build_processor(build_tokenizer()))
    grids = {}
    first_tc_v4 = next(i for i, p in enumerate(plans) if p[0] == "textcaps" and p[1] == "v4")
    mid_ramp = next(i for i, p in enumerate(plans) if p[0] == "textcaps" and p[1] == "v4" and 0.3 < p[3] < 0.7)
    for step in (next(i for i, p in enumerate(plans) if p[0] == "textcaps"), first_tc_v4, mid_ramp):
        _, batch = make_batch(builder, 0, step, n, 0.25, "v4")
        grids[plans[step][1]] = batch["image_grid_thw"][0].tolist()
        if step == mid_ramp:
            seed, idx, _ = plans[step][2][0]
            want = builder.build("textcaps", [S.render("textcaps", seed, idx, layout="v4",
                                                       canvas_strength=plans[step][3])])
            full = builder.build("textcaps", [S.render("textcaps", seed, idx, layout="v4")])
            n0 = want["pixel_values"].shape[0]
            assert torch.equal(batch["pixel_values"][:n0], want["pixel_values"])
            assert not torch.equal(batch["pixel_values"][:n0], full["pixel_values"])
    assert grids == {BOOTSTRAP_LAYOUT: [1, 24, 24], "v4": [1, 40, 32]}
    # a run on the bootstrap layout itself never leaves it
    assert {batch_plan(0, s, n, 1.0, "v1")[1] for s in range(n)} == {"v1"}


def _rotary_rates(model) -> dict[str, torch.Tensor]:
    """Rad per step of each rotary pair (head_dim/2,) when only time, row or column moves, and along text
    (t = h = w), read from the model's own rotary embedding (transformers applies the M-RoPE sections)."""
    rope = model.model.language_model.rotary_emb
    steps = {"origin": (0, 0, 0), "time": (1, 0, 0), "row": (0, 1, 0), "column": (0, 0, 1), "text": (1, 1, 1)}
    pos = torch.tensor([list(v) for v in steps.values()]).T.unsqueeze(1)  # (3, 1, 5): (t, h, w) per position
    cos, sin = rope(torch.zeros(1, dtype=torch.float32), pos)  # (1, 5, head_dim)
    half = cos.shape[-1] // 2
    angle = torch.atan2(sin[0, :, :half], cos[0, :, :half])  # (5, half); every rate here is below pi
    return {k: (angle[i] - angle[0]).abs() for i, k in enumerate(steps) if k != "origin"}


@pytest.mark.parametrize("size", sorted(MODEL_SIZES))
def test_every_size_builds_with_valid_rotary_sections(size):
    model = build_model(build_tokenizer(), size, 0)
    rates = _rotary_rates(model)
    # each pair follows exactly one of time, row and column, and text moves every pair
    moved = torch.stack([rates[k] > 0 for k in ("time", "row", "column")])
    assert (moved.sum(0) == 1).all(), moved
    assert torch.allclose(rates["text"], rates["time"] + rates["row"] + rates["column"])


def test_the_shipped_size_resolves_cells_and_leaves_room_for_a_sink():
    """The shipped size's rotary sections: fast row and column pairs tell cells one token apart, and the slowest
    pair turns so little over a whole sample that a key keeps its logit from the first answer step to the last."""
    slow = _rotary_rates(build_model(build_tokenizer(), "mini_2d_slow", 0))
    assert slow["row"].max() > 0.9 and slow["column"].max() > 0.5  # one cell (2 tokens) apart is told apart
    assert slow["text"].min() * 700 < 0.2  # the slowest pair turns < 0.2 rad over a 700-token sample


def test_ground_targets_mark_the_described_cells_tokens_at_attribute_steps():
    """The grounding loss's targets (BatchBuilder.ground_targets): on a v5 detailcaps batch, the position that predicts
    each of an object's four attribute words targets the 4 x 4 tokens of the cell its sentence names (v5: 112 px
    cells on a 16-token-wide grid), and no other position targets anything; textcaps and v1's scenes (whose
    descriptions do not walk the cells) get none."""
    builder = BatchBuilder(build_processor(build_tokenizer()))
    samples = [S.render("detailcaps", 3, i, layout="v5") for i in range(2)]
    batch = builder.build("detailcaps", samples, ground=S.get_layout("v5"))
    target, image_id = batch["ground"], builder.tok.convert_tokens_to_ids(SPECIAL_TOKENS["image"])
    for i, (_, text) in enumerate(samples):
        first = int((batch["input_ids"][i] == image_id).nonzero()[0])
        start = int((batch["labels"][i] != -100).nonzero()[0])  # the answer's first word
        want = {}
        words = text.split(" ")
        for sentence in text.split(" . "):  # "In row two , column three , a big red plain circle , ..."
            w = sentence.split(" ")
            if w[7] == "a":
                r, c = S.NUMBER_WORDS.index(w[2]), S.NUMBER_WORDS.index(w[5])
                block = {first + (4 * r + y) * 16 + 4 * c + x for y in range(4) for x in range(4)}
                k = next(j for j in range(len(words)) if words[j:j + len(w)] == w) + 7  # the sentence's "a"
                want.update({start + k + off - 1: block for off in range(1, 5)})
        rows = target[i].any(-1).nonzero().squeeze(-1).tolist()
        got = {q: set(target[i, q].nonzero().squeeze(-1).tolist()) for q in rows}
        assert len(want) >= 4 * S.get_layout("v5").min_objects and got == want
    assert "ground" not in builder.build("textcaps", [S.render("textcaps", 3, 0, layout="v5")], S.get_layout("v5"))
    assert "ground" not in builder.build("detailcaps", [S.render("detailcaps", 3, 0, layout="v1")], S.get_layout("v1"))


def test_ground_targets_mark_the_captioned_objects_cell_at_textcaps_attribute_steps():
    """Grounding textcaps: on a v5 textcaps batch, the position that predicts each of an object phrase's four
    attribute words targets the 4 x 4 tokens of the cell where that object is drawn (found here from the image's
    pixels of the phrase's colour in its named quadrant), and nothing else; make_batch adds targets only to the
    grounded tasks' batches on the recipe layout's scenes."""
    builder = BatchBuilder(build_processor(build_tokenizer()))
    samples = [S.render("textcaps", 3, i, layout="v5") for i in range(4)]
    batch = builder.build("textcaps", samples, ground=S.get_layout("v5"),
                          placed=[S.textcaps_cells(3, i, "v5") for i in range(4)])
    target, image_id = batch["ground"], builder.tok.convert_tokens_to_ids(SPECIAL_TOKENS["image"])
    for i, (frames, text) in enumerate(samples):
        first = int((batch["input_ids"][i] == image_id).nonzero()[0])
        start = int((batch["labels"][i] != -100).nonzero()[0])
        words, want = text.split(" "), {}
        for k in (k for k, w in enumerate(words) if w.lower() == "a"):  # "a big red plain circle at the top left"
            quadrant = S.QUADRANTS.index(" ".join(words[k + 6:k + 9]))
            ys, xs = np.all(frames[0] == np.array(S.COLOURS[words[k + 2]]), axis=-1).nonzero()
            mine = (ys < 2 * 112 if quadrant < 2 else ys >= 3 * 112) & (xs < 224 if quadrant % 2 == 0 else xs >= 224)
            r, c = int(np.median(ys[mine])) // 112, int(np.median(xs[mine])) // 112
            block = {first + (4 * r + y) * 16 + 4 * c + x for y in range(4) for x in range(4)}
            want.update({start + k + off - 1: block for off in range(1, 5)})
        rows = target[i].any(-1).nonzero().squeeze(-1).tolist()
        assert {q: set(target[i, q].nonzero().squeeze(-1).tolist()) for q in rows} == want and want
    steps = {batch_plan(0, step, 100, 0.25, "v5")[:2]: step for step in range(100)}
    assert {("textcaps", "v5"), ("textcaps", "v1"), ("detailcaps", "v5")} <= set(steps)
    for (task, lay), step in steps.items():
        for ground in ((), ("detailcaps",), ("textcaps",), ("detailcaps", "textcaps")):
            _, batch = make_batch(builder, 0, step, 100, 0.25, "v5", ground=ground)
            assert ("ground" in batch) == (task in ground and lay == "v5" and task != "video"), (task, lay, ground)
