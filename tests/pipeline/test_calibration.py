"""Methods calibrated offline in a job (pipeline/run/calibration.py, with InfiniGen's ``calibration_samples``,
``calibration_record`` and ``prepare``): the embedded model's shipped file, the held-out rows of other models' jobs,
per-sample as a label's choice; the config hash changes with the calibration, and every infinigen row records the
one it used."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.run.actor import SampleEvaluator
from pipeline.run.config import JobConfig
from pipeline.run.driver import resolve_calibration
from pipeline.run.inputs import resolve_shards, scan_shards
from rcr.config import ConfigError
from rcr.embedded import model_dir
from rcr.methods.infinigen import N_CALIBRATION
from rcr.skewing import calibration_digest, load_calibration, shipped_calibration, tensors_digest, weights_digest
from tests.pipeline_helpers import synthetic_records, tiny_qwen2_vl_dir, write_shard

SHIPPED = model_dir() / "infinigen_calibration"


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
    """Fails when the embedded model is retrained without `python -m embedded.calibration`."""
    from embedded.calibration import CALIBRATION_SEED
    from embedded.recipe import Recipe
    from pipeline.data import synthetic
    from rcr.models import geometry, load

    assert shipped_calibration(model_dir()) == str(SHIPPED)  # made for these weights: no error
    skews, cols, meta = load_calibration(str(SHIPPED))  # safetensors + JSON: nothing is unpickled
    model, _ = load("embedded")
    geo = geometry(model)
    assert len(skews) == geo.n_layers and tuple(skews[0].shape) == (geo.n_kv_heads, geo.head_dim, geo.head_dim)
    assert tuple(cols[0].shape) == (geo.n_kv_heads, round(0.25 * geo.head_dim))
    assert meta["model_sha256"] == weights_digest(model_dir()) and meta["sha256"] == calibration_digest(str(SHIPPED))
    # calibrated on scenes of a seed neither the training nor the evaluation shards use
    assert all(f"-s{CALIBRATION_SEED}-" in s for s in meta["sample_ids"]) and len(meta["sample_ids"]) == N_CALIBRATION
    recipe = Recipe.load(model_dir())  # the recipe the shipped model carries
    assert CALIBRATION_SEED not in (recipe.seed, recipe.polish_seed, synthetic.HELDOUT_SEED)


def test_embedded_default_uses_the_shipped_file_and_changes_the_config_hash(tmp_path, shard, monkeypatch):
    cfg, inputs = _job(tmp_path, "embedded", shard[0], methods=["bacon", "infinigen"], limit=4)
    before = cfg.config_hash
    plan = resolve_calibration(cfg, inputs)
    record = plan.records["infinigen"]
    assert record["kind"] == "shipped" and record["sha256"] == calibration_digest(str(SHIPPED))
    assert plan.heldout is None and cfg.rcr["extra"]["infinigen_calibration"] == record and cfg.config_hash != before
    per, inputs = _job(tmp_path, "embedded", shard[0], methods=["bacon", "infinigen@calibration=per_sample"], limit=4)
    assert resolve_calibration(per, inputs).records["infinigen@calibration=per_sample"]["kind"] == "per_sample"
    assert per.config_hash != cfg.config_hash
    plain, inputs = _job(tmp_path, "embedded", shard[0], methods=["bacon", "rcr"], limit=4)
    h = plain.config_hash
    assert resolve_calibration(plain, inputs).records == {} and plain.config_hash == h  # no infinigen: no change
    monkeypatch.setattr("rcr.skewing.weights_digest", lambda d: "retrained-model")
    stale, inputs = _job(tmp_path, "embedded", shard[0], methods=["infinigen"], limit=4)
    with pytest.raises(ConfigError, match="infinigen.calibration.*made for other weights.*rcr.calibrate_infinigen"):
        resolve_calibration(stale, inputs)


def test_other_models_calibrate_on_the_rows_after_the_limit(tmp_path, shard):
    path, ids = shard
    model = str(tiny_qwen2_vl_dir(tmp_path))
    cfg, inputs = _job(tmp_path, model, path, methods=["full", "infinigen"], limit=4)
    plan = resolve_calibration(cfg, inputs)
    assert plan.records["infinigen"]["kind"] == "heldout"
    assert [r["sample_id"] for r in plan.heldout.rows] == ids[4:4 + N_CALIBRATION]
    assert not {r["sample_id"] for r in plan.heldout.rows} & {r.sample_id for r in inputs[1]}
    other, inputs5 = _job(tmp_path, model, path, methods=["full", "infinigen"], limit=5)
    assert resolve_calibration(other, inputs5).heldout.sha256 != plan.heldout.sha256
    assert other.config_hash != cfg.config_hash
    whole, inputs_all = _job(tmp_path, model, path, methods=["full", "infinigen"])
    with pytest.raises(ConfigError, match="infinigen.calibration.*--limit"):
        resolve_calibration(whole, inputs_all)


def test_an_actor_calibrates_once_on_held_out_rows_and_its_rows_record_it(tmp_path, shard):
    path, ids = shard
    model = str(tiny_qwen2_vl_dir(tmp_path))
    cfg, inputs = _job(tmp_path, model, path, methods=["full", "infinigen"], limit=2, rcr={"selected": 8, "window": 8})
    plan = resolve_calibration(cfg, inputs)
    ev = SampleEvaluator(cfg.to_dict(), calibration=plan.payload())
    skews, cols, meta = ev.engine.methods["infinigen"].prepared  # calibrated by this actor, in memory
    source = plan.heldout.source
    assert meta["description"] == source and meta["n_prompts"] == N_CALIBRATION
    recs = synthetic_records("detailcaps", 2)
    rows = ev({k: [r[k] for r in recs] for k in recs[0]}).to_pandas().set_index("method")
    assert rows["error"].isna().all(), rows["error"].tolist()
    assert (rows.loc["infinigen", "calibration"] == source).all()
    assert (rows.loc["infinigen", "calibration_sha256"] == tensors_digest(skews, cols)).all()
    assert rows.loc["full", "calibration"].isna().all() and rows.loc["full", "calibration_sha256"].isna().all()
    # a worker whose rows differ from the driver's refuses to run
    bad = {**plan.payload(), "records": {"infinigen": {**plan.records["infinigen"], "sha256": "0" * 16}}}
    with pytest.raises(RuntimeError, match="not the one the driver recorded"):
        SampleEvaluator(cfg.to_dict(), calibration=bad)
    # the per-sample ablation, by its label: rows say so, with no file digest
    per, per_inputs = _job(tmp_path, model, path, methods=["full", "infinigen@calibration=per_sample"], limit=2,
                           rcr={"selected": 8, "window": 8})
    ev = SampleEvaluator(per.to_dict(), calibration=resolve_calibration(per, per_inputs).payload())
    inf = ev({k: [r[k] for r in recs] for k in recs[0]}).to_pandas()
    inf = inf[inf.method == "infinigen@calibration=per_sample"]
    assert (inf.calibration == "per_sample").all() and inf.calibration_sha256.isna().all()


def test_a_given_directory_is_used_as_is(tmp_path, shard):
    """infinigen@calibration=DIR: its description and digest are recorded; no held-out rows travel to the actors."""
    from rcr.calibrate_infinigen import calibrate_to_dir
    from rcr.models import build_inputs, load

    model_path = str(tiny_qwen2_vl_dir(tmp_path))
    model, proc = load(model_path, dtype=torch.float32)
    recs = synthetic_records("detailcaps", 2, seed=3)
    data = [build_inputs(proc, [r["prompt"]], [[synthetic_image(r)]]) for r in recs]
    meta = calibrate_to_dir(model, data, str(tmp_path / "cal"), meta={"description": "my set"})
    assert meta["model_sha256"] == weights_digest(model_path)  # a local model: the weights it was made for
    cfg, inputs = _job(tmp_path, model_path, shard[0], methods=[f"infinigen@calibration={tmp_path / 'cal'}"])
    plan = resolve_calibration(cfg, inputs)
    (record,) = plan.records.values()
    assert record == {"kind": "dir", "source": "my set", "sha256": calibration_digest(str(tmp_path / "cal"))}
    assert plan.heldout is None and plan.payload()["heldout"] is None


def synthetic_image(record):
    from pipeline.data.images import decode_image

    return decode_image(record["images"][0], "test")


def test_through_the_driver_the_rows_and_the_run_record_carry_the_calibration(tmp_path, shard):
    """The driver resolves the calibration, hands it to the actors, and the rows and the run record say which."""
    import pandas as pd

    from tests.fault_helpers import run_inline

    out = tmp_path / "out"
    rep = run_inline(["--model", str(tiny_qwen2_vl_dir(tmp_path)), "--shards", str(shard[0]), "--limit", "2",
                      "--methods", "bacon,infinigen", "--max-new-tokens", "3", "--output-dir", str(out),
                      "--no-summary", "--rcr", "selected=8", "--rcr", "window=8"])
    assert rep["status"] == "ok"
    df = pd.read_parquet(out)
    inf = df[df.method == "infinigen"]
    assert len(inf) == 2 and inf.error.isna().all()
    assert inf.calibration.str.startswith(f"heldout: {N_CALIBRATION} input rows after the 2 evaluated").all()
    assert inf.calibration_sha256.str.fullmatch(r"[0-9a-f]{16}").all() and inf.calibration_sha256.nunique() == 1
    (record,) = [json.loads(p.read_text()) for p in (out / "_runs").glob("*.json")]
    extra = record["config"]["rcr"]["extra"]["infinigen_calibration"]
    assert extra["kind"] == "heldout" and extra["source"] == inf.calibration.iloc[0]
    assert record["config_hash"] == df.config_hash.iloc[0]
    assert record["config"]["method_knobs"]["infinigen"]["partial_ratio"] == 0.25  # every method's defaults recorded
