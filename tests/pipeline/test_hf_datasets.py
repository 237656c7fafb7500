"""Source datasets read through Hugging Face `datasets` (pipeline/data/hf_datasets.py, pipeline/data/convert.py):
datasets built locally with `datasets` itself, with an `Image` feature column, in the layouts a user has on disk."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
from PIL import Image

from pipeline.data import convert, images, shards
from pipeline.data import prepare as prepare_data
from pipeline.run import inputs
from pipeline.run import plan as planning
from pipeline.run.cli import job_config
from pipeline.run.config import ConfigError
from pipeline.run.store import OutputStore
from pipeline.tasks import TASKS

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _offline_and_private_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # never touch the network


def _img(colour, size=(24, 16)) -> Image.Image:
    return Image.new("RGB", size, colour)


def _png(colour) -> bytes:
    buf = io.BytesIO()
    _img(colour).save(buf, format="PNG")
    return buf.getvalue()


TEXTCAPS_FEATURES = datasets.Features({
    "image_id": datasets.Value("string"),
    "image": datasets.Image(),
    "caption_str": datasets.Sequence(datasets.Value("string")),
})


def textcaps_dataset(ids: list[str]) -> datasets.Dataset:
    """Like lmms-lab/TextCaps: `image` is a datasets Image feature; rows sharing image_id are one image."""
    return datasets.Dataset.from_dict({
        "image_id": ids,
        "image": [_img((40 * (ord(i[0]) % 6), 0, 0)) for i in ids],
        "caption_str": [[f"caption of {i} row {k}"] for k, i in enumerate(ids)],
    }, features=TEXTCAPS_FEATURES)


def detailcaps_dataset(n: int) -> datasets.Dataset:
    """Like DetailCaps-4870.parquet: encoded bytes in `binary`, three reference columns."""
    return datasets.Dataset.from_dict({
        "image": [f"coco/{i:012d}.jpg" for i in range(n)],
        "binary": [_png((10 * i, 5, 0)) for i in range(n)],
        "GT_Caption_GPT4O": [f"gpt4o {i}" for i in range(n)],
        "GT_Caption_GPT4V": [f"gpt4v {i}" for i in range(n)],
        "GT_Caption_Gemini15Pro": [f"gemini {i}" for i in range(n)],
    })


def _pixel(rec) -> list[int]:
    return np.asarray(images.decode_image(rec["images"][0]))[0, 0].tolist()


def test_save_to_disk_with_image_feature(tmp_path):
    textcaps_dataset(["a1", "a1", "b2", "c3"]).save_to_disk(str(tmp_path / "tc"))
    recs = list(convert.convert_textcaps(local_path=tmp_path / "tc"))
    assert [r["sample_id"] for r in recs] == ["textcaps-a1", "textcaps-b2", "textcaps-c3"]
    assert recs[0]["references"] == ["caption of a1 row 0", "caption of a1 row 1"]
    assert _pixel(recs[1]) == [40 * (ord("b") % 6), 0, 0]
    arrow = sorted((tmp_path / "tc").glob("*.arrow"))  # save_to_disk's data files: the source's SHA-256
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in arrow)).hexdigest()[:12]
    assert len(arrow) == 1 and recs[0]["source"] == f"{tmp_path / 'tc'}@sha256:{digest}:val"


def test_parquet_folders_laid_out_like_the_hub(tmp_path):
    """`huggingface-cli download` layouts: DetailCaps-4870.parquet at the root; TextCaps data/<split>-*.parquet."""
    dc = tmp_path / "DetailCaps-4870"
    dc.mkdir()
    detailcaps_dataset(5).to_parquet(str(dc / "DetailCaps-4870.parquet"))
    tc = tmp_path / "TextCaps"
    (tc / "data").mkdir(parents=True)
    textcaps_dataset(["a", "b"]).to_parquet(str(tc / "data" / "val-00000-of-00002.parquet"))
    textcaps_dataset(["c"]).to_parquet(str(tc / "data" / "val-00001-of-00002.parquet"))
    textcaps_dataset(["z"]).to_parquet(str(tc / "data" / "train-00000-of-00001.parquet"))
    # what a user of datasets would do by hand reads the Image feature back from the Parquet metadata
    by_hand = datasets.load_dataset("parquet", data_files={"val": str(tc / "data" / "val-*.parquet")}, split="val")
    assert isinstance(by_hand.features["image"], datasets.Image) and by_hand.num_rows == 3

    recs = list(convert.convert_detailcaps(local_path=dc))
    assert [r["sample_id"] for r in recs] == [f"detailcaps-{i:05d}" for i in range(5)]
    assert _pixel(recs[3]) == [30, 5, 0] and recs[3]["references"] == ["gpt4o 3", "gpt4v 3", "gemini 3"]
    sub = [r["sample_id"] for r in convert.convert_detailcaps(local_path=dc, limit=2, seed=7)]
    assert len(sub) == 2 and sub == sorted(sub)
    assert [r["sample_id"] for r in convert.convert_textcaps(local_path=tc)] == ["textcaps-a", "textcaps-b",
                                                                                "textcaps-c"]


def test_streaming_keeps_the_first_samples_in_order(tmp_path):
    textcaps_dataset(["a", "a", "b", "c", "d"]).save_to_disk(str(tmp_path / "tc"))
    recs = list(convert.convert_textcaps(local_path=tmp_path / "tc", limit=2, streaming=True))
    assert [r["sample_id"] for r in recs] == ["textcaps-a", "textcaps-b"]
    assert recs[0]["references"] == ["caption of a row 0", "caption of a row 1"]


def test_broken_image_names_row_and_column(tmp_path):
    ds = detailcaps_dataset(3)
    ds = ds.map(lambda r, i: {"binary": b"\x89PNG broken" if i == 1 else r["binary"]}, with_indices=True)
    ds.to_parquet(str(tmp_path / "DetailCaps-4870.parquet"))
    with pytest.raises(shards.DataError, match=r"row 1 column 'binary': cannot decode image"):
        list(convert.convert_detailcaps(local_path=tmp_path))


def test_prepare_data_from_save_to_disk(tmp_path):
    textcaps_dataset(["a", "b", "c"]).save_to_disk(str(tmp_path / "tc"))
    assert prepare_data.main(["textcaps", "--local-path", str(tmp_path / "tc"), "--out", str(tmp_path / "shards")]) == 0
    t = shards.read_input(str(tmp_path / "shards"))
    assert t.column("sample_id").to_pylist() == ["textcaps-a", "textcaps-b", "textcaps-c"]


def test_offline_with_nothing_cached_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"),
               PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "jobs/prepare_data.py", "detailcaps", "--out", str(tmp_path / "out")],
                       cwd=REPO, env=env, capture_output=True, text=True, check=False, timeout=300)
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(lines) == 1 and "--local-path" in lines[0] and "DetailCaps-4870" in lines[0], lines
    assert not (tmp_path / "out" / shards.SUCCESS_MARKER).exists()


# ------------------------------------------------------------------------------------- the jobs' --dataset
def test_job_dataset_flag_is_checked_up_front(tmp_path):
    cfg = job_config(["--dataset", "lmms-lab/TextCaps:val"], task="textcaps")
    assert cfg.dataset == "lmms-lab/TextCaps:val"
    named = convert.parse_dataset(cfg.dataset, "textcaps")
    assert named.local_path is None and named.task is TASKS["textcaps"] and named.split == "val"
    other = convert.parse_dataset("textcaps:train", "textcaps")
    assert (other.split, other.task) == ("train", TASKS["textcaps"])
    for argv, task, words in (
        (["--dataset", "someone/Other"], "textcaps", "neither lmms-lab/TextCaps"),
        (["--dataset", "textcaps", "--shards", str(tmp_path)], "textcaps", "not both"),
        (["--dataset", "detailcaps"], "video", "no Hugging Face source"),
        (["--dataset", "lmms-lab/TextCaps"], "detailcaps", "neither foundation-multimodal-models"),
    ):
        with pytest.raises(ConfigError, match=words) as e:
            job_config(argv, task=task)
        assert e.value.field == "dataset"


def test_job_dataset_from_a_local_copy_is_converted_once(tmp_path, monkeypatch):
    monkeypatch.setenv("RCR_RUNS_DIR", str(tmp_path / "runs"))
    datasets.DatasetDict({"val": textcaps_dataset(["a", "a", "b"]), "train": textcaps_dataset(["t"])}
                         ).save_to_disk(str(tmp_path / "tc"))

    def plan(spec):
        cfg = job_config(["--dataset", spec, "--output-dir", str(tmp_path / "out")], task="textcaps")
        paths, p = planning.plan_job(cfg, OutputStore(cfg.output_dir), inputs.scan_inputs(cfg))
        return paths, [r.sample_id for r in p.rows]

    paths, ids = plan(str(tmp_path / "tc"))
    assert ids == ["textcaps-a", "textcaps-b"]
    assert all(Path(p).is_relative_to(tmp_path / "runs" / "datasets") for p in paths)
    assert plan(f"{tmp_path / 'tc'}:train")[1] == ["textcaps-t"]

    def no_conversion(self):
        raise AssertionError("converted again")

    monkeypatch.setattr(convert.NamedDataset, "records", no_conversion)
    assert plan(str(tmp_path / "tc")) == (paths, ids)  # the shards of the first conversion
    monkeypatch.undo()
    monkeypatch.setenv("RCR_RUNS_DIR", str(tmp_path / "runs"))
    datasets.DatasetDict({"val": textcaps_dataset(["c"])}).save_to_disk(str(tmp_path / "tc2"))
    (tmp_path / "tc").rename(tmp_path / "old")
    (tmp_path / "tc2").rename(tmp_path / "tc")  # the same path, other data: converted anew
    assert plan(str(tmp_path / "tc"))[1] == ["textcaps-c"]
