"""Copies of the real datasets as users hold them, with the real schemas: DetailCaps-4870 at a later commit with two
more Parquet files at its root, TextCaps with its one-row test placeholder, and snapshots in a hub cache. A split a
copy lacks fails in one line naming the splits it has; the hub cache is searched for any revision; `source` records
what was read. No network: the hub cache is a temporary folder and HF_HUB_OFFLINE is on."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import pytest

from pipeline.analysis.analyze import analyze
from pipeline.analysis.report import format_summary
from pipeline.data import convert, shards
from pipeline.run import driver, inputs
from pipeline.run.cli import job_config
from pipeline.run.config import ConfigError
from pipeline.tasks import TASKS
from tests.fake_output import make_output_frame
from tests.pipeline.test_convert import detailcaps_table, textcaps_table

REPO = Path(__file__).resolve().parents[2]
DC_TASK, TC_TASK = TASKS["detailcaps"], TASKS["textcaps"]
DC, TC = DC_TASK.source, TC_TASK.source
MAIN = "fb4e2ea348e5c3fb61bd1c327af39b0ed515bb3f"  # a commit of DetailCaps-4870 after the pinned one
# the dataset cards' `configs` as the repositories carry them at the pinned revisions
DC_CARD = ("---\nlicense: cc-by-nc-sa-4.0\nconfigs:\n- config_name: default\n  data_files:\n  - split: test\n"
           "    path: \"DetailCaps-4870.parquet\"\n---\n\n# DetailCaps-4870 Benchmark\n")
TC_CARD = ("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*\n"
           "  - split: val\n    path: data/val-*\n  - split: test\n    path: data/test-*\n---\n")


@pytest.fixture(autouse=True)
def _offline(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("RCR_RUNS_DIR", str(tmp_path / "runs"))


def detailcaps_later(d: Path, card: bool = True) -> Path:
    """DetailCaps-4870 as `hf download --local-dir` leaves it after the two refined files were added: 3 rows in
    the pinned file and 3 in each extra one, so reading "every parquet here" would give 9."""
    d.mkdir(parents=True)
    if card:
        (d / "README.md").write_text(DC_CARD)
    pq.write_table(detailcaps_table(3), d / "DetailCaps-4870.parquet")
    for lang in ("CN", "EN"):
        pq.write_table(detailcaps_table(3), d / f"DetailCaps-4870_refined_{lang}.parquet")
    return d


def textcaps_copy(d: Path) -> Path:
    """lmms-lab/TextCaps at the pinned revision: val in two files, train, and test as a one-row placeholder."""
    (d / "data").mkdir(parents=True)
    (d / "README.md").write_text(TC_CARD)
    pq.write_table(textcaps_table(["a1", "b2"]), d / "data" / "val-00000-of-00002.parquet")
    pq.write_table(textcaps_table(["c3"]), d / "data" / "val-00001-of-00002.parquet")
    pq.write_table(textcaps_table(["t0"], references=False), d / "data" / "test-00000-of-00001.parquet")
    pq.write_table(textcaps_table(["z9"]), d / "data" / "train-00000-of-00013.parquet")
    return d


def hub_snapshot(hub: Path, repo_id: str, commit: str, source: Path, ref: str | None = None) -> Path:
    """``source``'s files as huggingface_hub stores a download: blobs named by their SHA-256, a snapshot folder of
    links to them under the commit, and ``refs/<ref>`` holding the commit."""
    repo = hub / ("datasets--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for f in sorted(p for p in source.rglob("*") if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        blob.write_bytes(f.read_bytes())
        link = snap / f.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snap


def _ids(recs) -> list[str]:
    return [r["sample_id"] for r in recs]


# ------------------------------------------------------------------------------------- an unknown split
def test_unknown_split_of_a_later_detailcaps_fails_naming_the_splits(tmp_path):
    copy = detailcaps_later(tmp_path / "DetailCaps-4870")
    recs = list(convert.convert_detailcaps(local_path=copy))  # the pinned split: the card's one file
    assert _ids(recs) == [f"detailcaps-{i:05d}" for i in range(3)]
    for split in ("validation", "train"):
        with pytest.raises(shards.DataError, match=rf"DetailCaps-4870: no split '{split}' \(have: test; from the "
                                                 r"dataset card's configs \(README.md\)\)"):
            list(convert.convert_hub(DC_TASK, local_path=copy, split=split))
    # without the card: the pinned file at its repository path names the split; the refined files are not read
    bare = detailcaps_later(tmp_path / "bare", card=False)
    assert len(list(convert.convert_detailcaps(local_path=bare))) == 3
    with pytest.raises(shards.DataError, match=r"no split 'validation' \(have: test; from the pinned file"):
        list(convert.convert_hub(DC_TASK, local_path=bare, split="validation"))
    # one file is the pinned split (or the split its Hub name says), never the split asked for
    with pytest.raises(shards.DataError, match=r"DetailCaps-4870.parquet: no split 'validation' \(have: test; "
                                             r"from a single file, read as the pinned split\)"):
        list(convert.convert_hub(DC_TASK, local_path=copy / "DetailCaps-4870.parquet", split="validation"))
    shard = tmp_path / "val-00000-of-00002.parquet"
    pq.write_table(textcaps_table(["v"]), shard)
    with pytest.raises(shards.DataError, match=r"no split 'test' \(have: val; from its file name\)"):
        list(convert.convert_hub(TC_TASK, local_path=shard, split="test"))
    # a folder with neither a card, nor the Hub's names, nor the pinned file: nothing is guessed
    (tmp_path / "loose").mkdir()
    pq.write_table(detailcaps_table(2), tmp_path / "loose" / "captions.parquet")
    with pytest.raises(shards.DataError, match="cannot tell which files hold split 'test'"):
        list(convert.convert_detailcaps(local_path=tmp_path / "loose"))


def test_unknown_split_of_save_to_disk_fails_naming_the_splits(tmp_path):
    datasets.DatasetDict({"val": datasets.Dataset(textcaps_table(["x"]))}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(shards.DataError, match=r"no split 'test' \(have: val; from its datasets.save_to_disk"):
        list(convert.convert_hub(TC_TASK, local_path=tmp_path / "dd", split="test"))
    one = datasets.Dataset(textcaps_table(["y"]), split="val")
    one.save_to_disk(str(tmp_path / "one"))
    with pytest.raises(shards.DataError, match=r"no split 'train' \(have: val"):
        list(convert.convert_hub(TC_TASK, local_path=tmp_path / "one", split="train"))
    assert _ids(convert.convert_textcaps(local_path=tmp_path / "one")) == ["textcaps-y"]


def test_job_with_an_unknown_split_fails_before_any_model_work(tmp_path, capsys):
    copy = detailcaps_later(tmp_path / "DetailCaps-4870")
    out = tmp_path / "out"
    rc = driver.main("detailcaps", ["--dataset", f"{copy}:validation", "--output-dir", str(out)])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1, err
    assert "field 'dataset'" in err[0] and "no split 'validation' (have: test;" in err[0]
    assert not out.exists() and not list((tmp_path / "runs").rglob("_SUCCESS"))  # nothing converted or written


# ------------------------------------------------------------------------------------- a split without references
def test_textcaps_test_placeholder_runs_with_reference_metrics_marked_absent(tmp_path):
    copy = textcaps_copy(tmp_path / "TextCaps")
    cfg = job_config(["--dataset", f"{copy}:test", "--output-dir", str(tmp_path / "out")], task="textcaps")
    paths, rows, _ = inputs.scan_inputs(cfg)
    t = shards.read_input(paths[0])
    assert t.column("sample_id").to_pylist() == ["textcaps-t0"] and t.column("references").to_pylist() == [[]]
    assert t.column("source").to_pylist()[0].endswith(":test")
    # the val split of the same copy: its two files, by the card
    val = list(convert.convert_textcaps(local_path=copy))
    assert _ids(val) == ["textcaps-a1", "textcaps-b2", "textcaps-c3"] and val[0]["references"]
    # what the job's summary and MLflow then say (tests/pipeline/test_tracking.py checks the MLflow param)
    a = analyze(make_output_frame(n_samples=4, methods=("full", "rcr"), references=False), bootstrap_resamples=200)
    assert a.meta["reference_metrics"] == "absent: none of the 4 samples has references"
    assert a.per_sample.rougeL_ref.isna().all() and a.per_sample.cider.isna().all()
    text = format_summary(a)
    assert "reference metrics (ROUGE-L and CIDEr against references): absent: none of the 4 samples" in text
    assert "against references (ROUGE-L: max" not in text
    some = make_output_frame(n_samples=4, methods=("full", "rcr"))
    some["references"] = [r if s != "s0000" else [] for r, s in zip(some.references, some.sample_id)]
    assert analyze(some, bootstrap_resamples=200).meta["reference_metrics"] == (
        "on 3 of 4 samples (the others have no references)")


# ------------------------------------------------------------------------------------- the hub cache, offline
def test_offline_a_main_snapshot_is_found_and_named(tmp_path):
    """`hf download <id> --repo-type dataset` without --revision stores main's commit: the real command finds it."""
    snap = hub_snapshot(tmp_path / "hf-home" / "hub", DC.repo_id, MAIN,
                        detailcaps_later(tmp_path / "later"), ref="main")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "jobs/prepare_data.py", "detailcaps", "--out", str(tmp_path / "out")],
                       cwd=REPO, env=env, capture_output=True, text=True, check=False, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    notes = [ln for ln in r.stderr.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and f"reading revision {MAIN[:10]} (main)" in notes[0], r.stderr
    assert f"the revision asked for, {DC.revision[:10]}, is not there" in notes[0]
    t = shards.read_input(tmp_path / "out")
    assert t.num_rows == 3 and set(t.column("source").to_pylist()) == {f"{DC.repo_id}@{MAIN[:10]}:test"}
    assert f"source {DC.repo_id}@{MAIN[:10]}:test" in r.stdout
    # the snapshot folder passed by its path records the same provenance
    recs = list(convert.convert_detailcaps(local_path=snap))
    assert {x["source"] for x in recs} == {f"{DC.repo_id}@{MAIN[:10]}:test"}


def test_offline_the_pinned_snapshot_is_preferred(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    hub = tmp_path / "hub"
    hub_snapshot(hub, DC.repo_id, MAIN, detailcaps_later(tmp_path / "later"), ref="main")
    pinned = tmp_path / "pinned"
    pinned.mkdir()
    (pinned / "README.md").write_text(DC_CARD)
    pq.write_table(detailcaps_table(5), pinned / "DetailCaps-4870.parquet")
    hub_snapshot(hub, DC.repo_id, DC.revision, pinned)
    recs = list(convert.convert_detailcaps(cache_dir=str(hub)))
    assert len(recs) == 5 and {r["source"] for r in recs} == {f"{DC.repo_id}@{DC.revision[:10]}:test"}
    main = list(convert.convert_detailcaps(cache_dir=str(hub), revision="main"))  # a branch, by its ref
    assert len(main) == 3 and {r["source"] for r in main} == {f"{DC.repo_id}@{MAIN[:10]}:test"}
    assert "note:" not in capsys.readouterr().err
    # a split neither snapshot has fails naming the pinned snapshot's splits
    with pytest.raises(shards.DataError, match=rf"snapshots/{DC.revision}: no split 'validation' \(have: test"):
        list(convert.convert_hub(DC_TASK, cache_dir=str(hub), split="validation"))
    # a snapshot of one split (`hf download --include`, or what an earlier load fetched) is enough for that
    # split; for another one, the snapshot of another revision that holds it is read and named
    tc = textcaps_copy(tmp_path / "TextCaps")
    hub_snapshot(hub, TC.repo_id, MAIN, tc, ref="main")
    hub_snapshot(hub, TC.repo_id, TC.revision, tc, ref=None)
    for f in (hub / "datasets--lmms-lab--TextCaps" / "snapshots" / TC.revision / "data").glob("t*"):
        f.unlink()  # the pinned snapshot: README.md and val only
    assert len(list(convert.convert_textcaps(cache_dir=str(hub)))) == 3
    assert "note:" not in capsys.readouterr().err
    recs = list(convert.convert_hub(TC_TASK, cache_dir=str(hub), split="test"))
    assert {r["source"] for r in recs} == {f"{TC.repo_id}@{MAIN[:10]}:test"}
    assert (f"reading revision {MAIN[:10]} (main) from the hub cache {hub}; the revision asked for, "
            f"{TC.revision[:10]}, holds no files of split 'test'") in capsys.readouterr().err
    with pytest.raises(shards.DataError, match=r"split 'test' has no files in this copy \(looked for data/test-\*"):
        list(convert.convert_hub(TC_TASK, local_path=hub / "datasets--lmms-lab--TextCaps" / "snapshots" / TC.revision,
                                 split="test"))
    # a job's --dataset by name: the converted shards are named by the revision read
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    named = convert.parse_dataset("detailcaps", "detailcaps")
    assert named.cache_name(named.locate()) == named.cache_name() == f"detailcaps-test-{DC.revision[:10]}"


def test_job_dataset_by_name_reads_the_cached_main_snapshot(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    hub_snapshot(tmp_path / "hub", TC.repo_id, MAIN, textcaps_copy(tmp_path / "TextCaps"), ref="main")
    cfg = job_config(["--dataset", "lmms-lab/TextCaps", "--output-dir", str(tmp_path / "out")],
                              task="textcaps")
    paths, rows, _ = inputs.scan_inputs(cfg)
    assert Path(paths[0]).parent.name == f"textcaps-val-{MAIN[:10]}"  # not named by the pinned revision
    assert [r.sample_id for r in rows] == ["textcaps-a1", "textcaps-b2", "textcaps-c3"]
    assert f"reading revision {MAIN[:10]} (main)" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"no network, and no snapshot of it in the hub cache") as e:
        inputs.scan_inputs(job_config(["--dataset", "detailcaps"], task="detailcaps"))
    assert e.value.field == "dataset"


# ------------------------------------------------------------------------------------- the docs
def test_the_docs_download_commands_pin_the_revision():
    text = (REPO / "docs" / "pipeline.md").read_text()
    for src in (t.source for t in TASKS.values() if t.source is not None):
        cmds = re.findall(rf"hf download {re.escape(src.repo_id)} --repo-type dataset --revision (\w+)", text)
        assert cmds == [src.revision], (src.repo_id, cmds)
