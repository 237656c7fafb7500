"""Converters for the real datasets, on small local files laid out like each source. No downloads."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipeline.data import convert, images, shards
from pipeline.schema import INPUT_SCHEMA
from pipeline.tasks import TASKS

REPO = Path(__file__).resolve().parents[2]


def _png(colour, size=(32, 24)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def _jpeg(colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (20, 20), colour).save(buf, format="JPEG")
    return buf.getvalue()


def detailcaps_table(n=6, bad_row=None) -> pa.Table:
    """Columns as in DetailCaps-4870.parquet (image identifier, source, binary, the three GT captions)."""
    binaries = [_png((10 * i, 0, 0)) for i in range(n)]
    if bad_row is not None:
        binaries[bad_row] = b"\x89PNG broken"
    return pa.table({
        "source": ["COCO"] * n,
        "image": [f"coco/{i:012d}.jpg" for i in range(n)],
        "binary": pa.array(binaries, pa.binary()),
        "GT_Caption_GPT4O": [f"gpt4o caption {i}" for i in range(n)],
        "GT_Caption_GPT4V": [f"gpt4v caption {i}" for i in range(n)],
        "GT_Caption_Gemini15Pro": [f"gemini caption {i}" if i != 1 else None for i in range(n)],
    })


IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def textcaps_table(ids, references: bool = True) -> pa.Table:
    """Columns and types as in lmms-lab/TextCaps data/<split>-*.parquet: `question_id` a string, `image` a
    datasets Image struct, `caption_id` a list of int64 beside `caption_str`; `references=False`: the test
    split's placeholder, whose captions are null."""
    n = len(ids)
    return pa.table({
        "question_id": pa.array([f"{ids[i]}-q{i}" for i in range(n)], pa.string()),
        "question": ["Please carefully observe the image and come up with a caption for the image."] * n,
        "image_id": ids,
        "image": pa.array([{"bytes": _jpeg((0, 20 * i % 255, 0)), "path": f"{ids[i]}.jpg"} for i in range(n)],
                          IMAGE_STRUCT),
        "image_classes": pa.array([["Sign"]] * n, pa.list_(pa.string())),
        "caption_id": pa.array([[2 * i, 2 * i + 1] if references else None for i in range(n)],
                               pa.list_(pa.int64())),
        "caption_str": pa.array([[f"a sign that says {ids[i]} number {i}", f"second caption {i}"] if references
                                 else None for i in range(n)], pa.list_(pa.string())),
    })


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")


# ------------------------------------------------------------------------------------- DetailCaps
def test_detailcaps_local_parquet(tmp_path):
    f = tmp_path / "DetailCaps-4870.parquet"
    pq.write_table(detailcaps_table(6), f)
    recs = list(convert.convert_detailcaps(local_path=f))
    assert len(recs) == 6
    r = recs[2]
    assert r["sample_id"] == "detailcaps-00002" and r["task"] == "detailcaps"
    assert r["prompt"] == "Describe this image in detail."
    assert r["references"] == ["gpt4o caption 2", "gpt4v caption 2", "gemini caption 2"]
    assert recs[1]["references"] == ["gpt4o caption 1", "gpt4v caption 1"]  # null reference dropped
    assert np.asarray(images.decode_image(r["images"][0]))[0, 0].tolist() == [20, 0, 0]
    # a local file records its path and the SHA-256 of its bytes, not the Hub id of a revision it may not be
    assert r["source"] == f"{f}@sha256:{hashlib.sha256(f.read_bytes()).hexdigest()[:12]}:test"


def test_detailcaps_subset_is_fixed_by_seed(tmp_path):
    f = tmp_path / "DetailCaps-4870.parquet"
    pq.write_table(detailcaps_table(20), f)
    a = [r["sample_id"] for r in convert.convert_detailcaps(local_path=f, limit=5, seed=3)]
    b = [r["sample_id"] for r in convert.convert_detailcaps(local_path=f, limit=5, seed=3)]
    c = [r["sample_id"] for r in convert.convert_detailcaps(local_path=f, limit=5, seed=4)]
    assert a == b and a != c and len(a) == 5 and a == sorted(a)


def test_detailcaps_errors_name_field_and_file(tmp_path):
    f = tmp_path / "DetailCaps-4870.parquet"
    pq.write_table(detailcaps_table(3).drop(["GT_Caption_GPT4V"]), f)
    with pytest.raises(shards.DataError, match=r"DetailCaps-4870.parquet: missing column 'GT_Caption_GPT4V'"):
        list(convert.convert_detailcaps(local_path=f))
    pq.write_table(detailcaps_table(3, bad_row=1), f)
    with pytest.raises(shards.DataError, match=r"DetailCaps-4870.parquet row 1 column 'binary': cannot decode"):
        list(convert.convert_detailcaps(local_path=f))
    with pytest.raises(shards.DataError, match="no such file"):
        list(convert.convert_detailcaps(local_path=tmp_path / "missing"))


def test_detailcaps_from_hub_cache_offline(tmp_path, monkeypatch):
    """Offline, the snapshot of the pinned revision in the hub cache is read, and `source` names it."""
    import huggingface_hub.constants as C

    src = TASKS["detailcaps"].source
    repo_dir = tmp_path / "hub" / ("datasets--" + src.repo_id.replace("/", "--"))
    snap = repo_dir / "snapshots" / src.revision
    snap.mkdir(parents=True)
    pq.write_table(detailcaps_table(4), snap / "DetailCaps-4870.parquet")
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(src.revision)
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", True)
    recs = list(convert.convert_detailcaps(cache_dir=str(tmp_path / "hub"), limit=2, seed=0))
    assert len(recs) == 2 and all(r["task"] == "detailcaps" for r in recs)
    assert {r["source"] for r in recs} == {f"{src.repo_id}@{src.revision[:10]}:test"}


def test_offline_without_local_copy_says_so(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants as C

    monkeypatch.setattr(C, "HF_HUB_OFFLINE", True)  # never touch the network in tests
    with pytest.raises(convert.OfflineError, match="--local-path"):
        list(convert.convert_textcaps(cache_dir=str(tmp_path / "empty-cache")))
    from pipeline.data.prepare import main

    rc = main(["detailcaps", "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "empty-cache")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--local-path" in err[0] and "DetailCaps-4870" in err[0]
    assert not (tmp_path / "out" / shards.SUCCESS_MARKER).exists()


# ------------------------------------------------------------------------------------- TextCaps
def test_textcaps_snapshot_dir_groups_captions(tmp_path):
    snap = tmp_path / "TextCaps"
    (snap / "data").mkdir(parents=True)
    pq.write_table(textcaps_table(["a1", "a1", "b2"]), snap / "data" / "val-00000-of-00002.parquet")
    pq.write_table(textcaps_table(["c3", "d4"]), snap / "data" / "val-00001-of-00002.parquet")
    pq.write_table(textcaps_table(["zz"]), snap / "data" / "train-00000-of-00013.parquet")  # other split
    recs = list(convert.convert_textcaps(local_path=snap))
    assert [r["sample_id"] for r in recs] == ["textcaps-a1", "textcaps-b2", "textcaps-c3", "textcaps-d4"]
    assert recs[0]["references"] == ["a sign that says a1 number 0", "second caption 0",
                                     "a sign that says a1 number 1", "second caption 1"]
    assert recs[0]["prompt"] == "Provide a one-sentence caption for the provided image."
    assert all(len(r["images"]) == 1 for r in recs)
    assert images.decode_image(recs[2]["images"][0]).size == (20, 20)
    files = [snap / "data" / f"val-0000{k}-of-00002.parquet" for k in (0, 1)]  # the split's files, in order
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]
    assert {r["source"] for r in recs} == {f"{snap}@sha256:{digest}:val"}
    sub = [r["sample_id"] for r in convert.convert_textcaps(local_path=snap, limit=2, seed=1)]
    assert sub == [r["sample_id"] for r in convert.convert_textcaps(local_path=snap, limit=2, seed=1)]
    assert len(sub) == 2


def test_textcaps_save_to_disk_layout(tmp_path):
    """A real datasets.save_to_disk directory (DatasetDict with the `val` split), read with load_from_disk."""
    import datasets

    t = textcaps_table(["x", "y", "z"])
    datasets.DatasetDict({"val": datasets.Dataset(t), "train": datasets.Dataset(textcaps_table(["q"]))}
                         ).save_to_disk(str(tmp_path / "textcaps"))
    recs = list(convert.convert_textcaps(local_path=tmp_path / "textcaps"))
    assert [r["sample_id"] for r in recs] == ["textcaps-x", "textcaps-y", "textcaps-z"]


def test_textcaps_missing_column(tmp_path):
    f = tmp_path / "val-00000-of-00002.parquet"
    pq.write_table(textcaps_table(["a"]).drop(["caption_str"]), f)
    with pytest.raises(shards.DataError, match="missing column 'caption_str'"):
        list(convert.convert_textcaps(local_path=f))


# ------------------------------------------------------------------------------------- videos
def _video_folder(root: Path) -> Path:
    root.mkdir()
    frames = root / "clip_a"
    frames.mkdir()
    for i in range(12):
        Image.new("RGB", (28, 28), (i * 20, 0, 0)).save(frames / f"frame_{i:03d}.png")
    (root / "clip_a.txt").write_text("a red square fades in\n")
    gif = [Image.new("RGB", (28, 28), (0, 0, i * 25)) for i in range(10)]
    gif[0].save(root / "clip_b.gif", save_all=True, append_images=gif[1:], duration=40)
    (root / "references.json").write_text(json.dumps({"clip_b": ["blue fades in"]}))
    (root / "notes.md").write_text("ignored")
    return root


def test_video_folder(tmp_path):
    root = _video_folder(tmp_path / "videos")
    recs = list(convert.convert_videos(root, frames=8))
    assert [r["sample_id"] for r in recs] == ["video-clip_a", "video-clip_b"]
    a, b = recs
    assert a["task"] == "video" and len(a["images"]) == 8 and len(b["images"]) == 8
    assert a["references"] == ["a red square fades in"] and b["references"] == ["blue fades in"]
    reds = [np.asarray(images.decode_image(x))[0, 0, 0] for x in a["images"]]
    assert reds[0] == 0 and reds[-1] == 220 and reds == sorted(reds)  # uniform, in order, first and last kept
    t = shards.read_input(shards.write_shards(recs, tmp_path / "out")[0])
    assert t.schema.equals(INPUT_SCHEMA, check_metadata=False)


def test_video_errors(tmp_path):
    root = tmp_path / "v"
    root.mkdir()
    (root / "empty_clip").mkdir()
    with pytest.raises(shards.DataError, match="empty_clip: frame folder holds no image files"):
        list(convert.convert_videos(root))
    (root / "empty_clip").rmdir()
    bad = root / "broken"
    bad.mkdir()
    (bad / "f0.png").write_bytes(b"nope")
    with pytest.raises(shards.DataError, match=r"broken/f0.png: cannot decode"):
        list(convert.convert_videos(root))
    with pytest.raises(shards.DataError, match="not a directory"):
        list(convert.convert_videos(tmp_path / "nothing"))


# ------------------------------------------------------------------------------------- CLI
def test_prepare_data_cli(tmp_path, capsys):
    from pipeline.data.prepare import main

    f = tmp_path / "DetailCaps-4870.parquet"
    pq.write_table(detailcaps_table(10), f)
    out = tmp_path / "dc"
    assert main(["detailcaps", "--local-path", str(f), "--limit", "4", "--seed", "0", "--out", str(out)]) == 0
    t = shards.read_input(out)
    assert t.num_rows == 4 and (out / shards.SUCCESS_MARKER).exists()
    assert "wrote 4 samples" in capsys.readouterr().out
    # synthetic via the same CLI
    assert main(["synthetic", "--task", "video", "-n", "3", "--out", str(tmp_path / "syn")]) == 0
    assert shards.read_input(tmp_path / "syn").column("task").to_pylist() == ["video"] * 3
    # bad input -> exit 1 and a message naming the column
    pq.write_table(detailcaps_table(3).drop(["binary"]), f)
    assert main(["detailcaps", "--local-path", str(f), "--out", str(tmp_path / "bad")]) == 1
    assert "missing column 'binary'" in capsys.readouterr().err
    assert main(["synthetic", "--task", "audio", "--out", str(tmp_path / "x")]) == 1
    assert "unknown task 'audio'" in capsys.readouterr().err
