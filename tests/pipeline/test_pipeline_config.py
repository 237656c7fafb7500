"""The job config: one typed object, validated up front, errors naming the field."""

import json

import pytest

from pipeline.run.cli import job_config
from pipeline.run.config import ConfigError


def test_defaults_resolve_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("RCR_RUNS_DIR", str(tmp_path / "runs"))
    cfg = job_config([], task="detailcaps")
    assert cfg.max_new_tokens == 512
    assert cfg.methods[0] == "full"
    assert cfg.model == "embedded" and cfg.shards == ["embedded"]
    assert cfg.output_dir == str((tmp_path / "runs" / "detailcaps-embedded").resolve())
    assert cfg.mlflow_uri == f"sqlite:///{(tmp_path / 'runs' / 'mlflow.db').resolve()}"
    assert job_config([], task="textcaps").max_new_tokens == 64


def test_flags_override_yaml(tmp_path):
    y = tmp_path / "job.yaml"
    y.write_text("methods: [full, rcr, bacon]\nbatch_size: 3\nlimit: 7\nrcr: {selected: 16}\n")
    cfg = job_config(["--config", str(y), "--batch-size", "5", "--output-dir", "rel/out",
                               "--mlflow-uri", "sqlite:///m.db"], task="textcaps")
    assert cfg.batch_size == 5 and cfg.limit == 7 and cfg.methods == ["full", "rcr", "bacon"]
    assert cfg.output_dir.startswith("/") and cfg.output_dir.endswith("rel/out")
    assert cfg.mlflow_uri.startswith("sqlite:////")
    assert cfg.rcr.get("selected") == 16


@pytest.mark.parametrize("argv, field", [
    (["--methods", "full,nosuchmethod"], "methods"),
    (["--model", "acme/not a vlm"], "model"),  # not the shape of a Hub id; a well-formed one is pre-flight's
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--batch-size", "0"], "batch_size"),
    (["--num-actors", "0"], "num_actors"),
    (["--limit", "-3"], "limit"),
    (["--rcr", "selected=-1"], "rcr.selected"),
    (["--rcr", "rho=0.5"], "rcr.rho"),  # a method's knob: refused with where it goes
    (["--methods", "rcr@rho=7"], "methods"),
])
def test_bad_values_name_the_field(argv, field):
    with pytest.raises(ConfigError) as e:
        job_config(argv, task="detailcaps")
    assert e.value.field.startswith(field)
    assert f"'{e.value.field}'" in str(e.value)


def test_unknown_yaml_key_and_task_mismatch(tmp_path):
    y = tmp_path / "job.yaml"
    y.write_text("batch_sise: 3\n")
    with pytest.raises(ConfigError, match="batch_sise"):
        job_config(["--config", str(y)], task="detailcaps")
    y.write_text("task: video\n")
    with pytest.raises(ConfigError, match="field 'task'"):
        job_config(["--config", str(y)], task="detailcaps")


def test_local_checkpoint_model_type(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ConfigError, match="field 'model'.*bert"):
        job_config(["--model", str(d)], task="detailcaps")
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    assert job_config(["--model", str(d)], task="detailcaps").model_path() == str(d.resolve())
    for name in ("Qwen/Qwen2-VL-7B-Instruct", "llava-hf/llava-v1.6-mistral-7b-hf", "Qwen/Qwen3-VL-8B-Instruct"):
        job_config(["--model", name], task="detailcaps")


def test_config_hash_ignores_batching_and_paths():
    a = job_config(["--batch-size", "2", "--limit", "3", "--output-dir", "/tmp/x"], task="detailcaps")
    b = job_config(["--batch-size", "8", "--num-actors", "2"], task="detailcaps")
    c = job_config(["--max-new-tokens", "100"], task="detailcaps")
    assert a.config_hash == b.config_hash != c.config_hash


def test_config_hash_follows_a_local_models_weights(tmp_path):
    """A model directory retrained in place (same config, same weight-file size, other bytes) gets another
    config_hash, so a resume never reuses the old model's rows; the same bytes keep it."""
    import os

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2_vl"}')
    weights = model / "model.safetensors"
    weights.write_bytes(b"a" * 64)

    def config_hash():
        return job_config(["--model", str(model)], task="detailcaps").config_hash

    first = config_hash()
    weights.write_bytes(b"b" * 64)
    os.utime(weights, ns=(1, 1))  # a rewrite within the clock tick of the first would keep its memo key
    second = config_hash()
    weights.write_bytes(b"a" * 64)
    assert first != second and config_hash() == first


def test_help_lists_every_registered_method():
    from pipeline.run.cli import build_arg_parser
    from rcr.methods import METHODS
    from rcr.methods.knobs import knob_fields

    text = " ".join(build_arg_parser("detailcaps").format_help().split())  # undo argparse's line wrapping
    for name, cls in METHODS.items():  # listed in --methods' default, and with its own fields in the epilog
        assert f" {name}," in text or f" {name})" in text, name
        assert all(f"{f}=" in text for f in knob_fields(cls)), name
    assert "fixed@TAU" in text and "NAME@FIELD=VALUE" in text


def test_all_methods_expands_to_the_core_registry():
    from pipeline.run.config import available_methods

    cfg = job_config(["--methods", "all,fixed@0.05"], task="detailcaps")
    assert cfg.methods == [*available_methods(), "fixed@0.05"]
    assert cfg.methods[0] == "full" and {"bacon", "rcr", "exact", "fixed", "prefill_oracle"} <= set(cfg.methods)
    assert job_config([], task="video").methods == cfg.methods[:-1]
