"""InfiniGen calibrated offline in a job (pipeline/run/calibration.py): the embedded model's shipped file, the
held-out rows of other models' jobs, per-sample as a named option; the config hash changes with the
calibration, and every infinigen row records the one it used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.run import calibration as C
from pipeline.run.actor import SampleEvaluator
from pipeline.run.config import ConfigError, JobConfig
from pipeline.run.driver import resolve_calibration
from pipeline.run.store import resolve_shards, scan_shards
from rcr.skewing import calibration_digest, load_calibration
from tests.pipeline_helpers import synthetic_records, tiny_qwen2_vl_dir, write_shard


def _job(tmp_path, model, shard, **kw) -> tuple[JobConfig, tuple]:
    cfg = JobConfig.from_dict({"task": "detailcaps", "model": model, "shards": [str(shard)], "max_new_tokens": 4,
                               "batch_size": 2, "output_dir": str(tmp_path / "out"), **kw})
    paths = resolve_shards(cfg.shards)
    return cfg, (paths, *scan_shards(paths, cfg.limit))


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    recs = synthetic_records("detailcaps", 14)
    return write_shard(tmp_path_factory.mktemp("cal") / "in.parquet", recs), [r["sample_id"] for r in recs]


def test_the_shipped_calibration_belongs_to_the_shipped_model():
    """Fails when the embedded model is retrained without `python -m pipeline.run.calibration`."""
    from rcr.models import geometry, load

    d = C.shipped_dir()
    skews, cols, meta = load_calibration(str(d))  # safetensors + JSON: nothing is unpickled
    model, _ = load("embedded")
    geo = geometry(model)
    assert len(skews) == geo.n_layers and tuple(skews[0].shape) == (geo.n_kv_heads, geo.head_dim, geo.head_dim)
    assert tuple(cols[0].shape) == (geo.n_kv_heads, round(0.25 * geo.head_dim))
    assert meta["model_sha256"] == C.embedded_weights_sha256() and meta["sha256"] == calibration_digest(str(d))
    # calibrated on scenes of a seed neither the training nor the evaluation shards use
    from embedded.recipe import Recipe
    from pipeline.data import synthetic

    assert all(f"-s{C.CALIBRATION_SEED}-" in s for s in meta["sample_ids"]) and len(meta["sample_ids"]) == C.N_HELDOUT
    recipe = Recipe.load(C.shipped_dir().parent)  # the recipe the shipped model carries
    assert C.CALIBRATION_SEED not in (recipe.seed, recipe.polish_seed, synthetic.HELDOUT_SEED)
    assert meta["command"].startswith("python -m pipeline.run.calibration")


def test_embedded_default_uses_the_shipped_file_and_changes_the_config_hash(tmp_path, shard, monkeypatch):
    cfg, inputs = _job(tmp_path, "embedded", shard[0], methods=["bacon", "infinigen"], limit=4)
    before = cfg.config_hash
    spec = resolve_calibration(cfg, inputs)
    assert spec.kind == "shipped" and spec.sha256 == calibration_digest(str(C.shipped_dir()))
    assert cfg.rcr["extra"]["infinigen_calibration"] == spec.record() and cfg.config_hash != before
    per, inputs = _job(tmp_path, "embedded", shard[0], methods=["bacon", "infinigen"], limit=4,
                       rcr={"infinigen_calibration": "per_sample"})
    assert resolve_calibration(per, inputs).kind == "per_sample" and per.config_hash != cfg.config_hash
    plain, inputs = _job(tmp_path, "embedded", shard[0], methods=["bacon", "rcr"], limit=4)
    h = plain.config_hash
    assert resolve_calibration(plain, inputs) is None and plain.config_hash == h  # no infinigen: no change
    monkeypatch.setattr(C, "embedded_weights_sha256", lambda: "retrained-model")
    stale, inputs = _job(tmp_path, "embedded", shard[0], methods=["infinigen"], limit=4)
    with pytest.raises(ConfigError, match="rcr.infinigen_calibration.*python -m pipeline.run.calibration"):
        resolve_calibration(stale, inputs)


def test_other_models_calibrate_on_the_rows_after_the_limit(tmp_path, shard):
    path, ids = shard
    model = str(tiny_qwen2_vl_dir(tmp_path))
    cfg, inputs = _job(tmp_path, model, path, methods=["full", "infinigen"], limit=4)
    spec = resolve_calibration(cfg, inputs)
    assert spec.kind == "heldout" and [r["sample_id"] for r in spec.rows] == ids[4:4 + C.N_HELDOUT]
    assert not {r["sample_id"] for r in spec.rows} & {r.sample_id for r in inputs[1]}
    other, inputs5 = _job(tmp_path, model, path, methods=["full", "infinigen"], limit=5)
    assert resolve_calibration(other, inputs5).sha256 != spec.sha256 and other.config_hash != cfg.config_hash
    whole, inputs_all = _job(tmp_path, model, path, methods=["full", "infinigen"])
    with pytest.raises(ConfigError, match="rcr.infinigen_calibration.*--limit"):
        resolve_calibration(whole, inputs_all)


def test_an_actor_calibrates_once_on_held_out_rows_and_its_rows_record_it(tmp_path, shard):
    path, ids = shard
    model = str(tiny_qwen2_vl_dir(tmp_path))
    cfg, inputs = _job(tmp_path, model, path, methods=["full", "infinigen"], limit=2,
                       rcr={"selected": 8, "window": 8, "candidates": 16})
    spec = resolve_calibration(cfg, inputs)
    ev = SampleEvaluator(cfg.to_dict(), calibration=spec.actor_payload())
    cal_dir = ev.engine.rcr_config.infinigen_calibration
    assert cal_dir == ev._calibration_dir.name  # calibrated by this actor, kept while it lives
    meta = json.loads((Path(cal_dir) / "calibration.json").read_text())
    assert meta["sample_ids"] == ids[2:2 + C.N_HELDOUT] and meta["description"] == spec.source
    recs = synthetic_records("detailcaps", 2)
    rows = ev({k: [r[k] for r in recs] for k in recs[0]}).to_pandas().set_index("method")
    assert rows["error"].isna().all(), rows["error"].tolist()
    assert (rows.loc["infinigen", "calibration"] == spec.source).all()
    assert (rows.loc["infinigen", "calibration_sha256"] == calibration_digest(cal_dir)).all()
    assert rows.loc["full", "calibration"].isna().all() and rows.loc["full", "calibration_sha256"].isna().all()
    # the same actor on the per-sample ablation: rows say so, with no file digest
    per, _ = _job(tmp_path, model, path, methods=["full", "infinigen"], limit=2,
                  rcr={"selected": 8, "window": 8, "candidates": 16, "infinigen_calibration": "per_sample"})
    rows = SampleEvaluator(per.to_dict())({k: [r[k] for r in recs] for k in recs[0]}).to_pandas()
    inf = rows[rows.method == "infinigen"]
    assert (inf.calibration == "per_sample").all() and inf.calibration_sha256.isna().all()


def test_a_given_directory_is_used_as_is(tmp_path, shard):
    """--rcr infinigen_calibration=DIR: its description and digest are recorded; the actor needs no payload."""
    from rcr.models import load

    model_dir = str(tiny_qwen2_vl_dir(tmp_path))
    model, proc = load(model_dir, dtype=torch.float32)
    C.calibrate_rows(model, proc, synthetic_records("detailcaps", 2, seed=3), 0.25, tmp_path / "cal", "my set")
    cfg, inputs = _job(tmp_path, model_dir, shard[0], methods=["infinigen"], rcr={"infinigen_calibration":
                                                                                   str(tmp_path / "cal")})
    spec = resolve_calibration(cfg, inputs)
    assert (spec.kind, spec.source, spec.sha256) == ("dir", "my set", calibration_digest(str(tmp_path / "cal")))
    assert spec.actor_payload() is None


def test_through_the_driver_the_rows_and_the_run_record_carry_the_calibration(tmp_path, shard):
    """The driver resolves the calibration, hands it to the actors, and the rows and the run record say which."""
    import pandas as pd

    from tests.fault_helpers import run_inline

    out = tmp_path / "out"
    rep = run_inline(["--model", str(tiny_qwen2_vl_dir(tmp_path)), "--shards", str(shard[0]), "--limit", "2",
                      "--methods", "bacon,infinigen", "--max-new-tokens", "3", "--output-dir", str(out),
                      "--no-summary", "--rcr", "selected=8", "--rcr", "window=8", "--rcr", "candidates=16"])
    assert rep["status"] == "ok"
    df = pd.read_parquet(out)
    inf = df[df.method == "infinigen"]
    assert len(inf) == 2 and inf.error.isna().all()
    assert inf.calibration.str.startswith(f"heldout: {C.N_HELDOUT} input rows after the 2 evaluated").all()
    assert inf.calibration_sha256.str.fullmatch(r"[0-9a-f]{16}").all() and inf.calibration_sha256.nunique() == 1
    (record,) = [json.loads(p.read_text()) for p in (out / "_runs").glob("*.json")]
    extra = record["config"]["rcr"]["extra"]["infinigen_calibration"]
    assert extra["kind"] == "heldout" and extra["source"] == inf.calibration.iloc[0]
    assert record["config_hash"] == df.config_hash.iloc[0]
