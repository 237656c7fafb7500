"""The embedded model's probes and bars on constructed inputs (embedded/probes/, bars.py, and the premise
check's attention profile, pipeline/diagnose/attention.py): what each one counts, with no model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.data import synthetic as S


def test_reading_probe_scores_only_the_words_the_image_tells():
    """The reading probe: the attribute words of each object, the a/nothing of each v4 cell, and an
    object's colour and shape only where the text before it has not named them."""
    from embedded.probes.reading import scored_positions

    text = ("In row one , column one , a big red plain circle , left of the blue square . In row one , column two"
            " , a small blue dotted square . In row one , column three , nothing .")
    words = text.split()
    got = {k: [words[i] for i in v] for k, v in scored_positions(words).items()}
    assert got == {"size": ["big", "small"], "colour": ["red"], "texture": ["plain", "dotted"], "shape": ["circle"],
                   "occupied": ["a", "a", "nothing"]}
    text = "A small green striped diamond at the top left ."  # a caption starts with a capital
    words = text.split()
    assert {k: [words[i] for i in v] for k, v in scored_positions(words).items() if v} == {
        "size": ["small"], "colour": ["green"], "texture": ["striped"], "shape": ["diamond"]}


def test_attention_profile_finds_the_described_cells_tokens():
    """The attention profile's column `cell`: each answer step's described cell is the one named last
    before it, its tokens are the cell's 4 x 4 block of v4's 20 x 16 token grid, and the share is 1 for attention
    on that block alone and 1 / 20 for attention spread evenly over the image."""
    from embedded.probes.common import cell_masks
    from pipeline.diagnose.attention import cell_share

    text = "In row one , column one , a big red plain circle . In row two , column three , nothing ."
    words = text.split(" ")
    cells = S.described_cells(words)
    assert cells[:6] == [None] * 6 and cells[6:19] == [(0, 0)] * 13 and cells[19:] == [(1, 2)] * 3
    lay = S.get_layout("v4")
    image = torch.tensor([False] * 2 + [True] * 320 + [False] * 3)  # system text, image tokens, question
    masks = cell_masks(words, lay, image, torch.tensor([1, 40, 32]))
    want = {2 + r * 16 + c for r in range(4, 8) for c in range(8, 12)}  # row 2, column 3: tokens 4-7 x 8-11
    assert set(masks[-1].nonzero().squeeze(-1).tolist()) == want and not masks[:6].any()
    on_cell = masks.double().expand(2, -1, -1)  # (H, steps, N): 2 heads on the described cell only
    assert cell_share(on_cell, image, masks) == pytest.approx(1.0)
    assert cell_share(image.double().expand(2, len(words), -1), image, masks) == pytest.approx(1 / 20)
    with pytest.raises(ValueError, match="layout"):
        cell_masks(words, lay, image, torch.tensor([1, 24, 24]))


def test_attention_profile_static_share_is_what_a_fixed_selection_keeps():
    """The attention profile's columns `top-S` and `static`: attention that reads a new entry at every
    step is held whole by a per-step selection of 1 and by a fixed one for 1 / steps of it; attention that dwells
    on one entry is held whole by both."""
    from pipeline.diagnose.attention import layer_profile

    steps, n_prompt = 4, 6
    moving = torch.zeros(1, n_prompt + steps, n_prompt + steps, dtype=torch.float64)  # (H, T, T)
    dwelling = moving.clone()
    for k in range(steps):  # the query that writes answer token k is row n_prompt - 1 + k
        moving[0, n_prompt - 1 + k, 1 + k] = 1.0
        dwelling[0, n_prompt - 1 + k, 2] = 1.0
    image = torch.tensor([False] + [True] * 4 + [False])
    got = layer_profile(moving, n_prompt, image, 1, selected=1)
    assert got["top"] == pytest.approx(1.0) and got["static"] == pytest.approx(1 / steps)
    got = layer_profile(dwelling, n_prompt, image, 1, selected=1)
    assert got["top"] == pytest.approx(1.0) and got["static"] == pytest.approx(1.0)


def test_image_share_aim_is_the_image_part_of_each_step(capsys):
    """`on_image` (the attention profile's `on-img`, the image-share aim) is the image tokens' share of a step's
    whole attention, not of its prefix part; the aim is met only if every re-selected layer gives the image < 0.5,
    and a sliding-window layer (never re-selected) is left out of the premise check's per-layer figures."""
    from embedded.bars import aims
    from embedded.evaluate import main
    from pipeline.diagnose.attention import layer_profile
    from pipeline.diagnose.premises import layer_figures

    with pytest.raises(SystemExit):
        main(["--attention-samples", "-1"])  # refused before any model loads
    assert "--attention-samples must be >= 0" in capsys.readouterr().err
    for tasks in ("detailcaps,images", ","):
        with pytest.raises(SystemExit):
            main(["--tasks", tasks])
        assert "give some of detailcaps, textcaps, video" in capsys.readouterr().err

    steps, n_prompt = 3, 6
    attn = torch.zeros(1, n_prompt + steps, n_prompt + steps, dtype=torch.float64)  # (H, T, T)
    for k in range(steps):  # a quarter on an image entry; then half on the answer so far (none yet at step 0)
        q = n_prompt - 1 + k
        attn[0, q, 2], attn[0, q, 0], attn[0, q, q] = 0.25, 0.75 if k == 0 else 0.25, 0.0 if k == 0 else 0.5
    image = torch.tensor([False] + [True] * 4 + [False])
    got = layer_profile(attn, n_prompt, image, 1, selected=1)
    assert got["on_image"] == pytest.approx(0.25)
    assert got["image"] == pytest.approx((0.25 + 0.5 + 0.5) / 3)  # the prefix's share: 0.25 / 1, then 0.25 / 0.5
    layers = [{"on_image": 0.9}, {"on_image": 0.2}, {"on_image": 0.45}]
    heads = [[{"recall": 1.0, "top": 1, "mass": 0.5, "in_basis": 1.0, "cand": 1.0}]] * 3
    image_bar = aims(layer_figures(layers, heads, (False, True, True)))[1]
    assert image_bar.passed and image_bar.value.startswith("1:0.200 2:0.450")  # layer 0 slides: not counted
    image_bar = aims(layer_figures(layers, heads, (True, True, True)))[1]
    assert not image_bar.passed and image_bar.aim and image_bar.value.startswith("0:0.900 1:0.200 2:0.450")


def test_drift_spread_tables_each_kind_and_layer(capsys):
    """The drift_spread probe: a kind's drift is the mean of its exact rows' sample drift, a layer's the mean
    over samples of its own steps (samples differ in length; a sliding-window layer, all NaN, is left out), fixed's
    columns come from the fixed rows, and rho follows the forced object count."""
    import pandas as pd

    from embedded.probes.drift_spread import count_rho, kind_table, kinds, main

    for argv, says in [(["--objects", "3,21"], "--objects: counts in 1..20"), (["--objects", "3;6"], "--objects"),
                       (["--tasks", "detailcaps"], "--tasks"), (["--n", "2"], "--n")]:
        with pytest.raises(SystemExit):
            main(argv)  # refused before any model loads
        assert says in capsys.readouterr().err

    assert kinds([3, 18], ["textcaps"]) == [("detailcaps n=3", "detailcaps", 3), ("detailcaps n=18", "detailcaps", 18),
                                            ("textcaps", "textcaps", None)]
    assert kinds([], []) == [("detailcaps", "detailcaps", None)]
    nan = float("nan")
    rows = pd.DataFrame([  # layer 0 slides (never re-selected), layer 1 re-selects
        dict(kind="detailcaps n=3", objects=3, method="exact", mean_drift_exact=0.1,
             drift_exact=[[nan, nan], [0.0, 0.2]]),
        dict(kind="detailcaps n=3", objects=3, method="exact", mean_drift_exact=0.3,
             drift_exact=[[nan, nan, nan, nan], [0.3, 0.3, 0.3, 0.3]]),
        dict(kind="detailcaps n=3", objects=3, method="fixed", mean_drift=0.5, refresh_fraction=0.25),
        dict(kind="detailcaps n=3", objects=3, method="fixed", mean_drift=0.7, refresh_fraction=0.75),
        dict(kind="detailcaps n=18", objects=18, method="exact", mean_drift_exact=0.6,
             drift_exact=[[nan], [0.6]]),
        dict(kind="textcaps", objects=None, method="exact", mean_drift_exact=0.0, drift_exact=[[nan], [0.0]]),
    ])
    t = kind_table(rows).set_index("kind")
    assert list(t.index) == ["detailcaps n=3", "detailcaps n=18", "textcaps"]
    assert t.loc["detailcaps n=3", "drift"] == pytest.approx(0.2)
    assert t.loc["detailcaps n=3", "sd"] == pytest.approx(0.1)
    assert t.loc["detailcaps n=3", "drift per layer"] == "1:0.200"  # (0.1 + 0.3) / 2, not the pooled 1.4 / 6
    assert t.loc["detailcaps n=3", "fixed drift"] == pytest.approx(0.6)
    assert t.loc["detailcaps n=3", "fixed refresh"] == pytest.approx(0.5)
    rho, _, n = count_rho(rows)
    assert n == 3 and rho > 0  # the textcaps row has no count
    assert np.isnan(count_rho(rows[rows["kind"] != "detailcaps n=18"])[0])  # one count: no rank to correlate


def test_position_probe_reads_cells_only_from_features_that_hold_them():
    """The position probe: v4's tokens map to their 4 x 4 cell blocks, and the linear probe names the
    cell of held-out tokens whose features encode it and not of tokens whose features are noise."""
    from embedded.probes.position import probe_accuracy

    cells = S.token_cells(S.get_layout("v4"), torch.tensor([1, 40, 32]))
    assert cells.shape == (320,) and cells[0] == 0 and cells[4] == 1 and cells[16 * 4] == 4 and cells[-1] == 19
    rng = np.random.default_rng(0)
    y = np.tile(cells, 4)
    coded = np.eye(20)[y] * 6 + rng.normal(size=(len(y), 20))  # (tokens, 20): the cell plus noise
    noise = rng.normal(size=(len(y), 20))
    split = 3 * 320
    assert probe_accuracy(coded[:split], y[:split], coded[split:], y[split:], 20) > 0.9
    assert probe_accuracy(noise[:split], y[:split], noise[split:], y[split:], 20) < 0.15


def test_position_probe_takes_the_steps_that_must_read_their_cell():
    """position_probe's queries' side: the steps that write an attribute word nothing before it announced, each
    labelled with the cell being described; announced colours and shapes, "nothing" and the template are left out."""
    from embedded.probes.position import attribute_steps

    text = ("In row one , column one , a big red dotted circle , left of the blue square . In row one , column two "
            ", a small blue plain square . In row one , column three , nothing .")
    words = text.split()
    ks, cells = attribute_steps(words, S.get_layout("v4"))
    assert [words[k] for k in ks] == ["big", "red", "dotted", "circle", "small", "plain"]
    assert cells == [0, 0, 0, 0, 1, 1]


def test_attribute_probe_labels_each_object_token_with_its_object():
    """The attribute probe keeps the tokens that cover part of an object (on the flat twin) and labels
    each with its own object: the token's pixels show that object's colour (or its pattern's dark shade)."""
    from embedded.probes.attribute import cell_objects, object_token_labels

    lay = S.get_layout("v4")
    frames, text = S.render("detailcaps", S.HELDOUT_SEED, 2, layout="v4")
    twin, _ = S.render("detailcaps", S.HELDOUT_SEED, 2, layout="v4", canvas_strength=0.0)
    objects = cell_objects(text, lay)
    assert len(objects) == text.count(" a ") and all(len(v) == 4 for v in objects.values())
    grid = torch.tensor([1, 2 * lay.height // 28, 2 * lay.width // 28])
    keep, labels = object_token_labels(text, lay, twin[0], grid)
    assert 4 * len(objects) <= keep.sum() <= 16 * len(objects)
    h, w = lay.height // 28, lay.width // 28
    blocks = frames[0].reshape(h, 28, w, 28, 3).transpose(0, 2, 1, 3, 4).reshape(h * w, 28 * 28, 3)  # token order
    colours = list(S.COLOURS)
    for block, c in zip(blocks[keep], labels["colour"]):
        rgb = np.array(S.COLOURS[colours[c]])
        assert ((block == rgb).all(1) | (block == (rgb * 0.3).astype(np.uint8)).all(1)).any()
    cells = S.token_cells(lay, grid)
    assert set(cells[keep]) == set(objects)  # every object has tokens, and no empty cell does


def test_quality_gap_counts_only_the_masked_classes_mistakes():
    """The quality_gap probe: masking every attribute class forgives exactly the attribute mistakes, and with
    one class unmasked only that class's mistakes count."""
    from embedded.probes.quality_gap import gap_scores, masked

    assert masked("A big red plain circle .", keep="colour") == "A <size> red <texture> <shape> ."
    ref = "In row one , column one , a big red plain circle . In row one , column two , nothing ."
    out = "In row one , column one , a big red dotted square . In row one , column two , nothing ."
    g = gap_scores(ref, out)
    assert g["as scored"] < 1 and g["masked"] == g["size"] == g["colour"] == 1.0
    assert g["texture"] < 1 and g["shape"] < 1 and g["as scored"] < g["texture"]
    wrong_cell = out.replace("column two , nothing", "column two , a small red plain circle")
    assert gap_scores(ref, wrong_cell)["masked"] < 1  # template and occupancy mistakes are never masked


def test_held_out_answers_answer_the_scenes_of_the_given_seed_and_indices(monkeypatch):
    """The evaluation's per-layer probes answer the very scenes whose rows picked them: ``held_out_answers`` renders
    the given indices of the given seed (the held-out seed by default), so ``--seed`` and the per-tercile picks
    reach the probed images."""
    import embedded.probes.common as C

    seen = []
    monkeypatch.setattr(C, "greedy_answers", lambda model, processor, samples, n, done=None: seen.append(samples) or [])
    monkeypatch.setattr(C, "visual_token_ids", lambda model: set())
    C.held_out_answers(None, None, "textcaps", "v5", [4, 1], 8, seed=7)
    C.held_out_answers(None, None, "textcaps", "v5", 2, 8)
    got = [np.asarray(images[0]) for _, images, _ in seen[0]]
    assert all(np.array_equal(g, S.render("textcaps", 7, i, layout="v5")[0][0]) for g, i in zip(got, (4, 1)))
    default = [np.asarray(images[0]) for _, images, _ in seen[1]]
    assert len(default) == 2 and np.array_equal(default[1], S.render("textcaps", S.HELDOUT_SEED, 1, layout="v5")[0][0])
    assert not np.array_equal(got[1], default[1])
