"""The actor's callable class on plain dicts (no Ray), with a fake engine: rows, error rows, image modes."""

import dataclasses
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet
import pytest

from pipeline.run.actor import METHODS_COLUMN, SampleEvaluator
from pipeline.run.config import ConfigError, JobConfig
from pipeline.schema import OUTPUT_SCHEMA, validate_output_table
from tests.pipeline_helpers import bad_input_records, fake_model_dir, synthetic_records

METHODS = ["full", "bacon", "rcr"]


@pytest.fixture
def evaluator(tmp_path):
    cfg = JobConfig.from_dict({"task": "detailcaps", "model": str(fake_model_dir(tmp_path)), "methods": METHODS,
                                   "max_new_tokens": 8, "batch_size": 3, "engine": "tests.pipeline_helpers:FakeEngine",
                                   "output_dir": str(tmp_path / "out")})
    return SampleEvaluator(cfg.to_dict())


def _columns(records):
    return {k: [r[k] for r in records] for k in records[0]}


def test_rows_per_sample_and_method(evaluator):
    recs = synthetic_records("detailcaps", 4)
    t = evaluator(_columns(recs))
    assert isinstance(t, pa.Table) and t.schema.equals(OUTPUT_SCHEMA)
    validate_output_table(t)
    keys = set(zip(t.column("sample_id").to_pylist(), t.column("method").to_pylist()))
    assert keys == {(r["sample_id"], m) for r in recs for m in METHODS}
    df = t.to_pandas()
    assert df["error"].isna().all()
    assert (df["n_steps"] == df["output_ids"].map(len)).all()
    row = df.iloc[0]
    assert len(row["drift"]) == row["n_layers"] == 2 and len(row["drift"][0]) == row["n_steps"]
    assert row["config_hash"] == evaluator.job.config_hash and row["references"].tolist() == recs[0]["references"]


def test_resume_column_limits_methods(evaluator):
    recs = synthetic_records("textcaps", 2)
    cols = _columns(recs)
    cols[METHODS_COLUMN] = [["rcr"], ["bacon", "rcr"]]
    t = evaluator(cols)
    assert sorted(zip(t.column("sample_id").to_pylist(), t.column("method").to_pylist())) == sorted(
        [(recs[0]["sample_id"], "rcr"), (recs[1]["sample_id"], "bacon"), (recs[1]["sample_id"], "rcr")])


def test_bad_inputs_become_error_rows(evaluator):
    recs, expect = bad_input_records(synthetic_records("detailcaps", 1)[0])
    recs = [r for r in recs if r is not recs[-1]]  # the duplicate id is the driver's business
    expect.pop("good-a#dup2")
    # invalid UTF-8 exists only in a Parquet shard, and the context check is the real engine's:
    # both run through the driver in tests/pipeline/test_faults.py and tests/integration/test_ray_job.py
    recs = [r for r in recs if r["sample_id"] not in ("prompt-bad-utf8", "too-long")]
    expect.pop("prompt-bad-utf8")
    expect.pop("too-long")
    t = evaluator(pa.Table.from_pylist(recs)).to_pandas()
    assert len(t) == len(recs) * len(METHODS)
    for sid, err in expect.items():
        rows = t[t["sample_id"] == sid]
        assert len(rows) == len(METHODS), sid
        if err is None:
            assert rows["error"].isna().all(), (sid, rows["error"].tolist())
            assert (rows["n_steps"] > 0).all()
        else:
            assert rows["error"].str.contains(err, regex=False).all(), (sid, rows["error"].tolist())


def test_model_error_isolated_to_its_sample(evaluator):
    recs = synthetic_records("detailcaps", 3)
    recs[1]["prompt"] = "CRASH please"
    t = evaluator(_columns(recs)).to_pandas()
    bad = t[t["sample_id"] == recs[1]["sample_id"]]
    assert bad["error"].str.contains("model error: RuntimeError: fake engine crash").all()
    assert t[t["sample_id"] != recs[1]["sample_id"]]["error"].isna().all()
    assert len(t) == 9


def test_a_hand_written_config_gets_the_task_defaults(tmp_path):
    """A config dict that did not come through the driver's validate() (no max_new_tokens) still evaluates, with
    the task's default length; before, every sample became an error row (a TypeError on None)."""
    cfg = {"task": "textcaps", "model": str(fake_model_dir(tmp_path)), "methods": ["full", "bacon"],
           "engine": "tests.pipeline_helpers:FakeEngine"}
    ev = SampleEvaluator(cfg)
    assert ev.cfg.max_new_tokens == JobConfig.from_dict({**cfg, "output_dir": str(tmp_path / "o")}).max_new_tokens
    t = ev(_columns(synthetic_records("textcaps", 2))).to_pandas()
    assert len(t) == 4 and t["error"].isna().all(), t["error"].tolist()
    with pytest.raises(ConfigError, match="'task'"):
        SampleEvaluator({**cfg, "task": "vqa"})


def test_video_frames_reach_the_engine_as_one_sample(evaluator):
    recs = synthetic_records("video", 2)
    t = evaluator(_columns(recs)).to_pandas()
    assert len(t) == 2 * len(METHODS) and t["error"].isna().all()
    assert set(t["task"]) == {"video"}


def test_embedded_shards_are_generated_once(tmp_path, monkeypatch):
    from pipeline.run import inputs as run
    from pipeline.tasks import TASKS

    monkeypatch.setenv("RCR_RUNS_DIR", str(tmp_path))
    monkeypatch.setitem(TASKS, "textcaps", dataclasses.replace(TASKS["textcaps"], embedded_size=3))
    (d,) = run.embedded_shards("textcaps")
    files = sorted(Path(d).glob("*.parquet"))
    assert files and sum(pa.parquet.read_metadata(f).num_rows for f in files) == 3
    mtimes = [f.stat().st_mtime_ns for f in files]
    assert run.embedded_shards("textcaps") == [d]
    assert [f.stat().st_mtime_ns for f in files] == mtimes


def test_drawing_the_embedded_shards_says_where_it_is(tmp_path, monkeypatch):
    """Drawing the embedded scenes is the first job's longest silent stage (minutes for 300 DetailCaps scenes on
    a small CPU): it is a progress stage, whose count is the scenes drawn, ending with its total and time. (The
    heartbeat between items: tests/pipeline/test_diagnose.py.)"""
    from pipeline import progress
    from pipeline.data.shards import write_synthetic
    from pipeline.run import inputs as run
    from pipeline.tasks import TASKS

    lines = []
    monkeypatch.setattr(progress, "say", lines.append)
    monkeypatch.setenv("RCR_RUNS_DIR", str(tmp_path))
    monkeypatch.setitem(TASKS, "textcaps", dataclasses.replace(TASKS["textcaps"], embedded_size=3))
    run.embedded_shards("textcaps", every_s=60)
    assert len(lines) == 1 and lines[0].startswith("drawing the embedded textcaps scenes 3/3 in "), lines
    run.embedded_shards("textcaps", every_s=60)  # generated once: nothing drawn, nothing said
    assert len(lines) == 1, lines
    counts = []  # the count moves scene by scene, not by the generator's chunks of 64
    write_synthetic(tmp_path / "w", "textcaps", 3, done=counts.append)
    assert counts == [1, 2, 3]


def test_embedded_shards_follow_the_model_layout(tmp_path, monkeypatch):
    """Each embedded model gets the shards of the scene layout it was trained on (its recipe's): the cached
    shards of another model's layout are never reused; any other model gets the default layout's."""
    from pipeline.data import synthetic
    from pipeline.run import inputs as run
    from pipeline.tasks import TASKS
    from rcr.embedded import scene_layout

    monkeypatch.setenv("RCR_RUNS_DIR", str(tmp_path))
    monkeypatch.setitem(TASKS, "detailcaps", dataclasses.replace(TASKS["detailcaps"], embedded_size=2))
    layouts = {m: scene_layout(m) for m in ("embedded", "embedded-drift")}
    assert len(set(layouts.values())) == 2, layouts  # the test bed's scenes differ from the default's
    dirs = {}
    for model, layout in layouts.items():
        (dirs[model],) = run.embedded_shards("detailcaps", model)
        ids = pa.parquet.read_table(dirs[model], columns=["sample_id"]).column(0).to_pylist()
        assert len(ids) == 2 and all(f"-{layout}-" in i for i in ids), (model, ids)
    assert dirs["embedded"] != dirs["embedded-drift"]
    (other,) = run.embedded_shards("detailcaps", "Qwen/Qwen2-VL-2B-Instruct")
    assert Path(other).parent.name == synthetic.DEFAULT_LAYOUT


def test_offload_bytes_reach_the_output_rows(tmp_path):
    """The real engine on the embedded model with ``offload=true``: drift-triggered methods report the
    host-to-device bytes they moved; a method that reads nothing from the host reports 0."""
    cfg = JobConfig.from_dict({"task": "detailcaps", "methods": ["full", "bacon", "fixed@0.0"],
                               "max_new_tokens": 6, "batch_size": 1, "rcr": {"offload": True},
                               "output_dir": str(tmp_path / "out")})
    t = SampleEvaluator(cfg.to_dict())(_columns(synthetic_records("detailcaps", 1))).to_pandas()
    assert t["error"].isna().all(), t["error"].tolist()
    by = t.set_index("method")
    # tau = 0 fires on every layer-step after the first, so every step moves the candidates' rows
    assert by.loc["fixed@0.0", "refresh_fraction"] > 0.5
    assert by.loc["fixed@0.0", "bytes_moved_per_step"] > 0
    assert by.loc["full", "bytes_moved_per_step"] == 0 and by.loc["bacon", "bytes_moved_per_step"] == 0


def test_progress_says_it_waits_until_the_first_batch_then_counts(capsys):
    """Before any row arrives (the actors load the model, calibrate, run a batch) the line says so, and what one
    batch holds, instead of a 0.00 rate."""
    from pipeline.run.writer import Progress as _Progress

    p = _Progress(total_pairs=4, total_samples=2, every_s=60, batch="2 sample(s) x 2 method(s)")
    p.report(force=True)
    waiting = capsys.readouterr().out
    assert "0/4 rows, waiting for the first batch" in waiting and "samples/s" not in waiting
    assert "returns up to 2 sample(s) x 2 method(s) at once" in waiting  # why no row comes for so long
    p.update(pa.table({"sample_id": ["a", "a"], "error": pa.array([None, "bad"], pa.string())}), force=True)
    line = capsys.readouterr().out
    assert "progress: 2/4 rows, 1/2 samples, 1 error rows" in line and "samples/s" in line and "ETA" in line


def test_progress_says_waiting_instead_of_a_growing_eta_while_no_rows_arrive(capsys):
    """An ETA from the mean rate only grows while no rows arrive; the line says it waits for the next batch."""
    from pipeline.run.writer import Progress as _Progress

    p = _Progress(total_pairs=4, total_samples=2, every_s=60)
    p.update(pa.table({"sample_id": ["a", "a"], "error": pa.array([None, None], pa.string())}), force=True)
    assert "ETA" in capsys.readouterr().out
    p.report(force=True)  # the heartbeat's next line, no rows since
    line = capsys.readouterr().out
    assert "2/4 rows" in line and "waiting for the next batch" in line and "ETA" not in line
    p.update(pa.table({"sample_id": ["b", "b"], "error": pa.array([None, None], pa.string())}), force=True)
    done = capsys.readouterr().out
    assert "4/4 rows" in done and "waiting" not in done


def test_the_actor_loads_its_model_without_a_progress_bar(monkeypatch):
    """transformers' "Loading weights" bar would print once per actor into the job's output."""
    from transformers.utils import logging as hf_logging

    import rcr.models
    from pipeline.run import actor

    seen = []

    def load(*args, **kwargs):
        seen.append(hf_logging.is_progress_bar_enabled())
        raise RuntimeError("stop here")

    monkeypatch.setattr(rcr.models, "load", load)
    hf_logging.enable_progress_bar()
    with pytest.raises(RuntimeError, match="stop here"):
        actor.RcrEngine(JobConfig(), "cpu", "float32")
    assert seen == [False] and hf_logging.is_progress_bar_enabled()  # off while loading, restored after


def test_the_engine_logs_the_reselected_layers_once_per_model(monkeypatch, capsys):
    """LLaVA-NeXT-Mistral without `sliding_window` in its text config (transformers' default window, 4096): every
    layer is re-selected in a context shorter than the window, and none in a longer one; logged once per change."""
    import rcr.models
    from pipeline.run import actor
    from tests import tiny_models

    base, proc = tiny_models.llava_next()
    d = base.config.to_dict()
    del d["text_config"]["sliding_window"]
    model = type(base)(base.config.__class__.from_dict(d)).eval()
    monkeypatch.setattr(rcr.models, "load", lambda *a, **k: (model, proc))
    engine = actor.RcrEngine(JobConfig(model="llava-next-mistral", max_new_tokens=8), "cpu", "float32")
    capsys.readouterr()
    for n_input in (100, 120, 100, 4089, 4090):  # 4089 + 8 - 1 = 4096 entries at most: the window covers them
        engine.log_reselected(n_input)
    assert capsys.readouterr().out.splitlines() == ["[rcr-job] llava-next-mistral: re-selected layers: 3 of 3",
                                                    "[rcr-job] llava-next-mistral: re-selected layers: 0 of 3"]


def test_the_engine_caps_a_qwen_images_visual_tokens(monkeypatch):
    """Qwen2-VL's published processor keeps up to 12,845,056 pixels (16,384 visual tokens, 4x as many vision-tower
    patches): one 2000 x 1500 photo would be a 3,800-token prefix. The job caps an image at --max-image-tokens
    (the Qwen model cards' 1280 by default); a smaller image keeps its resolution."""
    import copy
    from types import SimpleNamespace

    import numpy as np
    from PIL import Image

    import rcr.models
    from pipeline.run import actor
    from tests import tiny_models

    model, proc = tiny_models.qwen2_vl()
    proc = copy.deepcopy(proc)
    proc.image_processor.size = {"shortest_edge": 3136, "longest_edge": 12845056}  # Qwen2-VL-*-Instruct's
    monkeypatch.setattr(rcr.models, "load", lambda *a, **k: (model, proc))

    def tokens(engine, w, h):
        image = Image.fromarray(np.zeros((h, w, 3), np.uint8))
        ids = rcr.models.build_inputs(engine.processor, ["describe"], [[image]])["input_ids"]
        return int((ids == model.config.image_token_id).sum())

    assert tokens(SimpleNamespace(processor=proc), 2000, 1500) > 3000  # the published processor alone
    engine = actor.RcrEngine(JobConfig(model="qwen2-vl"), "cpu", "float32")
    assert rcr.models.limit_image_tokens(proc, 10**6) == 1280 * 28 * 28  # the default cap in force, in pixels
    assert tokens(engine, 1024, 768) == 37 * 27  # DetailCaps' largest typical size: untouched (smart_resize to 28s)
    assert tokens(engine, 2000, 1500) <= 1280
    small = actor.RcrEngine(JobConfig(model="qwen2-vl", max_image_tokens=64), "cpu", "float32")
    assert tokens(small, 2000, 1500) <= 64 and tokens(small, 1024, 768) <= 64


def test_the_image_token_cap_leaves_fixed_tilings_alone():
    """LLaVA-NeXT's visual tokens per image are fixed by its pinpoints: there is nothing to cap."""
    import rcr.models
    from tests import tiny_models

    _, proc = tiny_models.llava_next()
    before = dict(proc.image_processor.size)
    assert rcr.models.limit_image_tokens(proc, 4) is None and dict(proc.image_processor.size) == before
