"""Synthetic generator, input schema and shard I/O (no model needed)."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data import images, shards
from pipeline.data import synthetic as S
from pipeline.schema import INPUT_SCHEMA, SchemaError, input_table_from_records, validate_input_table
from pipeline.tasks import TASKS


def _record(**over):
    rec = S.make_record("textcaps", 0, 0)
    rec.update(over)
    return rec


# ------------------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("task", S.TASKS)
def test_same_seed_same_bytes(task):
    a = [S.make_record(task, 3, i) for i in range(3)]
    b = [S.make_record(task, 3, i) for i in range(3)]
    assert a == b
    c = [S.make_record(task, 4, i) for i in range(3)]
    assert [r["images"] for r in a] != [r["images"] for r in c]
    assert len({r["references"][0] for r in a}) == 3  # different indices, different samples


def test_workers_do_not_change_output(tmp_path):
    one = list(shards.synthetic_records("detailcaps", 10, seed=5, workers=1, chunk=3))
    two = list(shards.synthetic_records("detailcaps", 10, seed=5, workers=2, chunk=3))
    assert one == two
    # the default layout's name is in the id unless it is v1's (whose ids predate the layouts)
    tag = "" if S.DEFAULT_LAYOUT == "v1" else f"{S.DEFAULT_LAYOUT}-"
    assert [r["sample_id"] for r in one] == [f"synthetic-{tag}detailcaps-s5-{i:07d}" for i in range(10)]


# ------------------------------------------------------------------------------------- content
def _phrases(text: str) -> list[tuple[int, int, list[str]]]:
    """(row, column, the words after "In row R , column C ,") of every cell a detailcaps description names."""
    words = text.split()
    starts = [k for k in range(len(words)) if words[k] == "In" and words[k + 1] == "row"] + [len(words)]
    return [(S.NUMBER_WORDS.index(words[a + 2]), S.NUMBER_WORDS.index(words[a + 5]), words[a + 7:b])
            for a, b in zip(starts, starts[1:])]


def _cells(text: str) -> list[tuple[int, int]]:
    """(row, column) of every object a detailcaps description names, in order (cells said to hold nothing
    are skipped)."""
    return [(r, c) for r, c, rest in _phrases(text) if rest[0] != "nothing"]


@pytest.mark.parametrize("layout", list(S.LAYOUTS))
def test_detailcaps_is_long_and_spatial(layout):
    lay = S.LAYOUTS[layout]
    lengths = []
    for i in range(40):
        frames, text = S.render("detailcaps", 1, i, layout=layout)
        # 28 px per merged visual token: (height/28) x (width/28) tokens
        assert len(frames) == 1 and frames[0].shape == (lay.height, lay.width, 3)
        assert lay.height % 28 == 0 and lay.width % 28 == 0
        lengths.append(len(text.split()))
        cells = _cells(text)
        assert lay.min_objects <= len(cells) <= lay.max_objects
        assert cells == sorted(set(cells))  # raster order, one object per cell
        assert all(r < lay.rows and c < lay.cols for r, c in cells)
    assert np.mean(lengths) >= 100


def test_v2_scenes_hold_a_long_prefix_and_more_objects_than_v1():
    """The v2 layout's premise: at least 8x the 32-entry budget of visual tokens, and more objects."""
    v1, v2 = S.LAYOUTS["v1"], S.LAYOUTS["v2"]
    assert (v2.height // 28) * (v2.width // 28) >= 8 * 32 + 32  # prefix >= 256 after the 32-token window
    assert v2.min_objects > v1.max_objects


@pytest.mark.parametrize("layout", list(S.LAYOUTS))
def test_each_object_is_drawn_in_its_cell(layout):
    lay = S.LAYOUTS[layout]
    frames, text = S.render("detailcaps", 2, 0, layout=layout)
    img = frames[0].astype(int)
    words = text.split()
    cells = _cells(text)
    colours = [words[k + 9] for k in range(len(words))
               if words[k] == "In" and words[k + 1] == "row" and words[k + 7] == "a"]
    for (r, c), colour in zip(cells, colours):
        cell = img[r * lay.cell:(r + 1) * lay.cell, c * lay.cell:(c + 1) * lay.cell]
        hit = np.all(cell == np.array(S.COLOURS[colour]), axis=-1).sum()
        assert hit > 30, (r, c, colour)
    # an empty cell is plain background (or, on a textured layout, holds no object colour)
    r, c = next((r, c) for r in range(lay.rows) for c in range(lay.cols) if (r, c) not in set(cells))
    cell = img[r * lay.cell + 12:(r + 1) * lay.cell - 12, c * lay.cell + 12:(c + 1) * lay.cell - 12]
    if lay.textured:
        assert not any(np.all(cell == np.array(rgb), axis=-1).any() for rgb in S.COLOURS.values())
    else:
        assert np.all(cell == np.array(S.BACKGROUND))


def test_v3_describes_every_cell_and_relates_only_neighbours():
    """v3: all 20 cells in raster order; an empty cell is "nothing" (and plain background); an object names
    its right-hand neighbour only when that cell holds one, and the last column is "at the end of its row"."""
    lay = S.LAYOUTS["v3"]
    for i in range(10):
        frames, text = S.render("detailcaps", 3, i, layout="v3")
        phrases = _phrases(text)
        assert [(r, c) for r, c, _ in phrases] == [(r, c) for r in range(lay.rows) for c in range(lay.cols)]
        objects = {(r, c): rest for r, c, rest in phrases if rest[0] == "a"}
        assert lay.min_objects <= len(objects) <= lay.max_objects
        img = frames[0]
        for r, c, rest in phrases:
            cell = img[r * lay.cell:(r + 1) * lay.cell, c * lay.cell:(c + 1) * lay.cell]
            if rest == ["nothing", "."]:
                assert np.all(cell == np.array(S.BACKGROUND))
                continue
            tail = " ".join(rest)
            right = objects.get((r, c + 1))
            if c == lay.cols - 1:
                assert tail.endswith(", at the end of its row ."), tail
            elif right is not None:  # "a big red plain circle ." -> "left of the red circle"
                assert tail.endswith(f", left of the {right[2]} {right[4]} ."), tail
            else:
                assert "," not in tail, tail


@pytest.mark.parametrize("task", ["detailcaps", "textcaps"])
def test_v4_is_v3_on_a_textured_canvas(task):
    """v4: the same objects and text as v3 for the same index; every object pixel identical, and the empty canvas
    varies from token to token (no two 28 x 28 background blocks alike) and is never flat grey."""
    for i in range(4):
        (a,), text3 = S.render(task, 3, i, layout="v3")
        (b,), text4 = S.render(task, 3, i, layout="v4")
        assert text4 == text3
        empty = (a == np.array(S.BACKGROUND)).all(-1)
        assert np.array_equal(a[~empty], b[~empty])
        blocks = b.reshape(a.shape[0] // 28, 28, a.shape[1] // 28, 28, 3).transpose(0, 2, 1, 3, 4)
        bg = [blk for blk, e in zip(blocks.reshape(-1, 28, 28, 3),
                                    empty.reshape(a.shape[0] // 28, 28, -1, 28).all((1, 3)).reshape(-1)) if e]
        assert len(bg) > 100 and len({blk.tobytes() for blk in bg}) == len(bg)
        assert not any((blk == blk[0, 0]).all() for blk in bg)  # no empty-canvas token is one flat colour
        spread = b[empty].astype(int)
        assert 0 < (spread.max(-1) - spread.min(-1)).mean() < 80  # faint colour, far from the objects' saturation
    assert np.array_equal(S.render(task, 3, 3, layout="v4")[0][0], b)  # a pure function of its arguments


def test_canvas_strength_fades_v4_toward_its_flat_twin():
    """Training's texture ramp: strength 0 is v3 exactly, strength 1 is v4, and in between the empty canvas's
    departure from grey grows with the strength while the objects and the text stay those of the same index."""
    (v3,), t3 = S.render("detailcaps", 5, 2, layout="v3")
    (v4,), t4 = S.render("detailcaps", 5, 2, layout="v4")
    assert np.array_equal(S.render("detailcaps", 5, 2, layout="v4", canvas_strength=0.0)[0][0], v3)
    assert np.array_equal(S.render("detailcaps", 5, 2, layout="v4", canvas_strength=1.0)[0][0], v4)
    empty = (v3 == np.array(S.BACKGROUND)).all(-1)
    dev = []
    for s in (0.25, 0.5, 0.75):
        (img,), text = S.render("detailcaps", 5, 2, layout="v4", canvas_strength=s)
        assert text == t3 == t4 and np.array_equal(img[~empty], v3[~empty])
        dev.append(np.abs(img[empty].astype(int) - 128).mean())
    assert dev[0] < dev[1] < dev[2] < np.abs(v4[empty].astype(int) - 128).mean()
    assert np.array_equal(S.render("textcaps", 1, 0, layout="v3", canvas_strength=0.3)[0][0],
                          S.render("textcaps", 1, 0, layout="v3")[0][0])  # a flat layout has no canvas to fade
    with pytest.raises(S.SyntheticError, match="canvas_strength"):
        S.render("textcaps", 0, 0, layout="v4", canvas_strength=1.5)


def _cell_canvas(img: np.ndarray, empty: np.ndarray, lay: S.SceneLayout) -> np.ndarray:
    """(rows, cols, 2): mean brightness and red - blue of each cell's empty-canvas pixels."""
    out = np.zeros((lay.rows, lay.cols, 2))
    for r in range(lay.rows):
        for c in range(lay.cols):
            sl = np.s_[r * lay.cell:(r + 1) * lay.cell, c * lay.cell:(c + 1) * lay.cell]
            px = img[sl][empty[sl]].astype(float)
            out[r, c] = px.mean(), (px[:, 0] - px[:, 2]).mean()
    return out


@pytest.mark.parametrize("task", ["detailcaps", "textcaps"])
def test_v5_canvas_says_where_a_token_is(task):
    """v5: v4's objects and text for the same index, on a canvas lit by position. Every cell's empty canvas is
    brighter than the cell above it and warmer (red - blue) than the cell to its left, by more than the texture
    varies from scene to scene, so a token's own pixels place its cell; v4's canvas does not."""
    lay = S.get_layout("v5")
    for i in range(3):
        (a,), text4 = S.render(task, 3, i, layout="v4")
        (b,), text5 = S.render(task, 3, i, layout="v5")
        (flat,), _ = S.render(task, 3, i, layout="v3")
        assert text5 == text4
        empty = (flat == np.array(S.BACKGROUND)).all(-1)
        assert np.array_equal(a[~empty], b[~empty])
        lit, plain = _cell_canvas(b, empty, lay), _cell_canvas(a, empty, lay)
        assert (np.diff(lit[..., 0], axis=0) > 8).all() and (np.diff(lit[..., 1], axis=1) > 8).all()
        assert not (np.diff(plain[..., 0], axis=0) > 8).all()
        # training's fade: at strength 0 the light goes with the texture
        assert np.array_equal(S.render(task, 3, i, layout="v5", canvas_strength=0.0)[0][0], flat)


@pytest.mark.parametrize("task", ["detailcaps", "textcaps"])
def test_v6_is_v5_with_a_canvas_tint_drawn_per_scene(task):
    """v6: v5's objects, text and canvas for the same index, with the empty canvas shifted by the scene's tint
    (0-1, ``scene_tint``, a draw of its own): green - (red + blue) / 2 moves by 60 x the tint while brightness and
    warmth (the light's axes, which place a token's cell) stay; the objects' pixels are untouched; scenes draw
    different tints; at canvas strength 0 the tint fades with the texture."""
    tints = []
    for i in range(8):
        (a,), text5 = S.render(task, 3, i, layout="v5")
        (b,), text6 = S.render(task, 3, i, layout="v6")
        (flat,), _ = S.render(task, 3, i, layout="v3")
        assert text6 == text5
        empty = (flat == np.array(S.BACKGROUND)).all(-1)
        assert np.array_equal(a[~empty], b[~empty])
        t = S.scene_tint(task, 3, i, "v6")
        assert 0.0 <= t <= 1.0 and t == S.scene_tint(task, 3, i, "v6")
        d = b[empty].astype(float) - a[empty].astype(float)  # (pixels, 3)
        assert (d[:, 1] - (d[:, 0] + d[:, 2]) / 2).mean() == pytest.approx(60 * t, abs=1.0)
        assert abs(d.mean()) < 1.0 and abs((d[:, 0] - d[:, 2]).mean()) < 1.0
        assert np.array_equal(S.render(task, 3, i, layout="v6", canvas_strength=0.0)[0][0], flat)
        tints.append(t)
    assert max(tints) - min(tints) > 0.5
    assert S.scene_tint(task, 3, 0, "v5") is None and S.scene_tint("video", 3, 0, "v6") is None
    assert S.make_record(task, 3, 0, layout="v6")["sample_id"] == f"synthetic-v6-{task}-s3-0000000"


def test_layouts_keep_video_and_tag_sample_ids():
    assert S.render("video", 0, 3, layout="v1")[1] == S.render("video", 0, 3, layout="v3")[1]
    assert S.make_record("detailcaps", 0, 1, layout="v2")["sample_id"] == "synthetic-v2-detailcaps-s0-0000001"
    assert S.make_record("detailcaps", 0, 1, layout="v1")["sample_id"] == "synthetic-detailcaps-s0-0000001"
    with pytest.raises(S.SyntheticError, match="layout"):
        S.render("detailcaps", 0, 0, layout="v9")


def test_forced_object_count_is_in_the_scene_and_the_id():
    """The drift_spread probe draws detailcaps scenes of a given size: the count reaches the description
    (one clause per occupied cell) and the id, so scenes of two counts never share a key."""
    rec = S.make_record("detailcaps", 0, 1, layout="v5", n_objects=3)
    assert rec["sample_id"] == "synthetic-v5-detailcaps-n3-s0-0000001"
    assert rec["sample_id"] != S.make_record("detailcaps", 0, 1, layout="v5", n_objects=4)["sample_id"]
    for task, layout, n in (("detailcaps", "v5", 3), ("detailcaps", "v1", None), ("video", "v5", None)):
        assert S.scene_index(S.make_record(task, 12, 1234, layout=layout, n_objects=n)["sample_id"]) == 1234
    for n in (1, 3, 20):
        _, text = S.render("detailcaps", 0, 1, n_objects=n, layout="v5")
        assert len(text.split(" . ")) - text.count("nothing") == n  # 20 clauses, n of them an object
    with pytest.raises(S.SyntheticError, match="textcaps draws its own"):
        S.make_record("textcaps", 0, 1, n_objects=3)


def test_textcaps_short_and_video_frames():
    for i in range(30):
        _, text = S.render("textcaps", 0, i)
        assert len(text.split()) <= 30 and text.endswith(".")
        frames, vtext = S.render("video", 0, i)
        assert 8 <= len(frames) <= 16 and len(frames) % 4 == 0
        assert frames[0].shape == (168, 168, 3)
        assert "moves from" in vtext or "stays in" in vtext
    # frames differ over time (objects move)
    frames, vtext = S.render("video", 0, 1)
    assert not np.array_equal(frames[0], frames[-1]) or "stays" in vtext


@pytest.mark.parametrize("layout", ["v1", "v5"])
def test_textcaps_cells_are_where_each_captioned_object_is_drawn(layout):
    """textcaps_cells replays the generator's placement: the j-th cell lies in the quadrant the caption names for
    its j-th object, and the pixels of the object's colour lie in that cell and nowhere else."""
    lay = S.LAYOUTS[layout]
    for i in range(12):
        frames, text = S.render("textcaps", 5, i, layout=layout)
        cells = S.textcaps_cells(5, i, layout)
        phrases = text[:-2].lower().split(" and ")  # "a big red plain circle at the top left"
        assert len(cells) == len(phrases) and len(set(cells)) == len(cells)
        # cell -> object colour, one entry per object
        colour = {cell: p.split()[2] for cell, p in zip(cells, phrases)}
        for cell, phrase in zip(cells, phrases):
            r, c = divmod(cell, lay.cols)
            quadrant = S.QUADRANTS.index(phrase.split(" at ")[1])
            assert (r < lay.rows // 2, c < lay.cols // 2) == (quadrant < 2, quadrant % 2 == 0), (phrase, r, c)
        img = frames[0]
        for rgb_name in set(colour.values()):
            hit = np.all(img == np.array(S.COLOURS[rgb_name]), axis=-1)  # (H, W)
            ys, xs = hit.nonzero()
            drawn = set(((ys // lay.cell) * lay.cols + xs // lay.cell).tolist())
            assert drawn == {cell for cell, name in colour.items() if name == rgb_name}, (i, rgb_name)


@pytest.mark.parametrize("layout", list(S.LAYOUTS))
def test_vocabulary_covers_everything(layout):
    vocab = set(S.vocabulary())
    for task in S.TASKS:
        assert set(S.canonical(TASKS[task].prompt).split()) <= vocab
        for i in range(25):
            _, text = S.render(task, 9, i, layout=layout)
            assert set(text.split()) <= vocab, set(text.split()) - vocab
            assert S.canonical(text) == text


def test_unknown_task_and_bad_args():
    with pytest.raises(S.SyntheticError, match="task"):
        S.render("captions", 0, 0)
    with pytest.raises(S.SyntheticError, match="task"):
        list(shards.synthetic_records("nope", 2))
    with pytest.raises(S.SyntheticError, match="n_objects"):
        S.render("detailcaps", 0, 0, n_objects=17, layout="v1")  # 16 cells
    with pytest.raises(S.SyntheticError, match="n_objects"):
        S.render("detailcaps", 0, 0, n_objects=21, layout="v2")  # 20 cells
    with pytest.raises(S.SyntheticError, match="seed"):
        S.render("video", -1, 0)


# ------------------------------------------------------------------------------------- schema
def test_records_match_schema_and_images_decode():
    recs = [S.make_record(t, 0, i) for t in S.TASKS for i in range(2)]
    table = input_table_from_records(recs)
    assert table.schema.equals(INPUT_SCHEMA, check_metadata=False)
    for row in table.to_pylist():
        imgs = images.sample_images(row)
        assert all(im.mode == "RGB" for im in imgs)
        assert row["prompt"] == TASKS[row["task"]].prompt
        assert row["source"] == "synthetic"


def test_validate_names_the_bad_field():
    t = input_table_from_records([_record()])
    with pytest.raises(SchemaError, match="missing column 'references'"):
        validate_input_table(t.drop(["references"]))
    bad = t.set_column(t.schema.get_field_index("task"), "task", pa.array(["captioning"]))
    with pytest.raises(SchemaError, match="'task'.*captioning"):
        validate_input_table(bad)
    bad = t.set_column(t.schema.get_field_index("images"), "images", pa.array([[]], pa.list_(pa.binary())))
    with pytest.raises(SchemaError, match="'images' is empty"):
        validate_input_table(bad)
    bad = t.set_column(t.schema.get_field_index("prompt"), "prompt", pa.array([3]))
    with pytest.raises(SchemaError, match="'prompt' has type"):
        validate_input_table(bad)
    two = pa.concat_tables([t, t])
    with pytest.raises(SchemaError, match="'sample_id' is not unique"):
        validate_input_table(two)
    with pytest.raises(SchemaError, match="missing field 'source'"):
        rec = _record()
        del rec["source"]
        input_table_from_records([rec])
    # large_* types from other writers are accepted and cast
    big = t.cast(pa.schema([pa.field(f.name, pa.large_string() if f.type == pa.string() else f.type)
                            for f in INPUT_SCHEMA]))
    assert validate_input_table(big).schema.equals(INPUT_SCHEMA, check_metadata=False)


def test_undecodable_image_is_named():
    row = _record(images=[b"not an image"])
    with pytest.raises(shards.DataError, match=rf"sample_id='{re.escape(row['sample_id'])}' field 'images'\[0\]"):
        images.sample_images(row)


# ------------------------------------------------------------------------------------- shards
def test_write_read_roundtrip_and_atomicity(tmp_path):
    out = tmp_path / "shards"
    paths = shards.write_synthetic(out, "textcaps", 7, seed=1, shard_size=3)
    assert [p.name for p in paths] == ["textcaps-00000.parquet", "textcaps-00001.parquet", "textcaps-00002.parquet"]
    assert (out / shards.SUCCESS_MARKER).exists()
    assert not list(out.glob(".*tmp"))
    t = shards.read_input(out)
    assert t.num_rows == 7 and t.schema.equals(INPUT_SCHEMA, check_metadata=False)
    assert t.to_pylist() == list(shards.synthetic_records("textcaps", 7, seed=1))
    # pixels survive the round trip exactly
    frames, _ = S.render("textcaps", 1, 4)
    assert np.array_equal(np.asarray(images.sample_images(t.to_pylist()[4])[0]), frames[0])
    # rewriting with fewer rows leaves no stale shard behind
    shards.write_synthetic(out, "textcaps", 2, seed=1, shard_size=3)
    assert shards.read_input(out).num_rows == 2


def test_incomplete_directory_is_not_presented_as_complete(tmp_path, monkeypatch):
    out = tmp_path / "shards"

    def boom(records):
        yield from records[:4]
        raise RuntimeError("interrupted")

    recs = list(shards.synthetic_records("textcaps", 6, seed=0))
    with pytest.raises(RuntimeError):
        shards.write_shards(boom(recs), out, shard_size=2)
    assert not (out / shards.SUCCESS_MARKER).exists()
    with pytest.raises(shards.DataError, match="incomplete"):
        shards.read_input(out)
    assert shards.read_input(out, require_complete=False).num_rows == 4
    # a writer that dies inside pq.write_table leaves only a hidden temporary, never the final name
    real = pq.write_table

    def dying(table, where, **kw):
        where.write(b"partial")  # the open hidden temporary of rcr.fileio.atomic_path
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", dying)
    with pytest.raises(OSError):
        shards.write_shard(input_table_from_records(recs[:1]), out / "x.parquet")
    monkeypatch.setattr(pq, "write_table", real)
    assert not (out / "x.parquet").exists()
    assert not list(out.glob(".tmp-*"))


def test_read_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"garbage")
    with pytest.raises(shards.DataError, match="bad.parquet"):
        shards.read_input(bad)
    t = input_table_from_records([_record()]).drop(["prompt"])
    f = tmp_path / "noprompt.parquet"
    pq.write_table(t, f)
    with pytest.raises(SchemaError, match=r"noprompt.parquet: missing column 'prompt'"):
        shards.read_input(f)
    with pytest.raises(shards.DataError, match="no such file"):
        shards.read_input(tmp_path / "nothing")
