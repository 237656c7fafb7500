"""One definition of each thing: the output row (pipeline/schema.py) and the copies that used to disagree
(ROUGE-L, tracking URI, tasks and prompts, Arrow type checks, image decoding, method order)."""

import io

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

import rcr
from pipeline import schema
from pipeline.analysis import tracking
from pipeline.analysis.analyze import METHOD_MEANS, analyze
from pipeline.analysis.labels import order_methods
from pipeline.analysis.report import minimal_summary
from pipeline.analysis.telemetry import as_2d
from pipeline.data.images import decode_image, load_sample_images
from pipeline.run import config, inputs
from rcr.generate import GenerationResult
from rcr.telemetry import HostTelemetry
from tests.fake_output import make_output_frame

JOB = schema.JobStamp(model="m", config_hash="abc", job_name="j", task="detailcaps")


def _result(lengths=(5, 2), L=3, T=6) -> GenerationResult:
    """A 2-sample batch whose telemetry past each sample's length is a value no summary may include."""
    B = len(lengths)
    steps = np.arange(T)[None, None, :] < (np.asarray(lengths)[:, None, None] - 1)  # (B, 1, T) valid steps
    rng = np.random.default_rng(0)

    def tel(valid, pad):
        return np.where(steps, valid, pad).astype(np.float32) * np.ones((B, L, T), np.float32)

    t = HostTelemetry(drift=tel(rng.random((B, L, T)), 99.0), tau=tel(0.05, 99.0),
                      trigger=tel(rng.random((B, L, T)) < 0.5, 1.0),
                      keys_read=tel(rng.integers(0, 9, (B, L, T)), 999.0),
                      values_read=tel(4.0, 999.0), detector_dots=tel(2.0, 999.0),
                      bytes_moved=tel(rng.random((B, L, T)), 999.0))
    seq = torch.arange(B * T).reshape(B, T) + 3
    return GenerationResult(label="rcr", sequences=seq, lengths=torch.tensor(lengths), telemetry=t,
                            prefix_len=np.array([40, 17]), prefill_s=0.5, decode_s=2.0)


def test_a_layer_never_re_selected_is_null_and_outside_the_refresh_fraction():
    """A sliding-window layer has no selection (rcr.telemetry: its trigger is NaN): its trigger row is null,
    the refresh fraction is over the other layers, and the analyses read the null row back as NaN."""
    res = _result()
    res.telemetry.trigger[:, 0] = np.nan  # layer 0: a sliding-window layer
    res.telemetry.trigger[:, 1:] = 1.0
    row = schema.output_row(JOB, {"sample_id": "x", "references": ["r"], "prompt": "p"}, "exact", res, 0, "t")
    assert row["refresh_fraction"] == 1.0  # not 2/3
    assert row["trigger"][0] is None and row["trigger"][1] == [True] * 4
    schema.validate_output_table(schema.output_table([row]))
    back = as_2d(schema.output_table([row]).to_pylist()[0]["trigger"], float)
    assert np.isnan(back[0]).all() and (back[1:] == 1).all()


def test_sample_is_trimmed_arrays_only():
    res = _result()
    s = res.sample(1)
    assert set(s) == {"tokens", *vars(res.telemetry)}
    assert s["tokens"].tolist() == res.sequences[1, :2].tolist()
    for k, v in s.items():
        assert v is None or (isinstance(v, np.ndarray) and (k == "tokens" or v.shape == (3, 1))), k


def test_output_row_is_the_schema_and_summarises_only_valid_steps():
    res = _result()
    row = schema.output_row(JOB, {"sample_id": "x", "references": ["r"], "prompt": "p"}, "rcr", res, 0, "t")
    assert list(row) == schema.OUTPUT_SCHEMA.names  # a schema field without a value fails here
    s = res.sample(0)
    assert row["refresh_fraction"] == pytest.approx(s["trigger"].mean()) and row["refresh_fraction"] < 1
    assert row["keys_read_per_step"] == pytest.approx(s["keys_read"].mean()) and row["keys_read_per_step"] < 999
    assert row["bytes_moved_per_step"] == pytest.approx(s["bytes_moved"].sum(0).mean())
    assert row["mean_drift_exact"] is None and row["top_prefix_pos"] is None
    assert (row["n_steps"], row["n_layers"], row["prefix_len"]) == (5, 3, 40)
    assert row["tokens_per_s"] == pytest.approx((5 + 2) / 2.0)  # the batch's tokens over its decode time
    table = schema.output_table([row, *schema.error_rows(JOB, {"sample_id": "y"}, ["full", "rcr"], "bad input: z")])
    schema.validate_output_table(table)
    assert table.column("error").to_pylist() == [None, "bad input: z", "bad input: z"]


def test_rows_name_the_node_that_made_them():
    """The actor stamps its Ray node on every row it makes; outside Ray (no node) the column is null."""
    from dataclasses import replace

    from pipeline.run.actor import ray_node_id

    res = _result()
    on = replace(JOB, node_id="ab12")
    rows = [schema.output_row(on, {"sample_id": "x"}, "rcr", res, 0, "t"),
            *schema.error_rows(on, {"sample_id": "y"}, ["full"], "bad input: z")]
    assert schema.output_table(rows).column("node_id").to_pylist() == ["ab12", "ab12"]
    assert ray_node_id() is None  # this process is not a Ray worker
    assert schema.output_table(schema.error_rows(JOB, {"sample_id": "y"}, ["full"], "e")).column("node_id")[0].as_py() \
        is None


def test_row_summaries_reach_the_method_table_and_mlflow():
    """A new float64 summary column in OUTPUT_SCHEMA needs no edit in the analysis or the tracking."""
    assert set(schema.ROW_SUMMARIES) - {schema.Col.REFRESH_FRACTION} <= set(METHOD_MEANS)
    methods = analyze(make_output_frame(n_samples=6), bootstrap_resamples=50).methods
    assert set(METHOD_MEANS) <= set(methods.columns)
    assert schema.Col.MEAN_DRIFT_EXACT == "mean_drift_exact" and tuple(schema.Col) == tuple(schema.OUTPUT_SCHEMA.names)


def test_minimal_summary_scores_rouge_l_with_the_unicode_tokenizer():
    """It used whitespace tokens: 'Привет, мир!' vs 'привет мир' scored 0 there and 1 with the project's
    tokenizer (case and punctuation are not words)."""
    df = pd.DataFrame({"sample_id": ["a", "a"], "method": ["full", "rcr"],
                       "output_text": ["Привет, мир!", "привет мир"], "error": [None, None],
                       "refresh_fraction": [0.0, 0.5]})
    line = next(x for x in minimal_summary(df).splitlines() if x.startswith("rcr"))
    assert line.split()[3] == "1.000"


@pytest.mark.parametrize("uri", ["sqlite:///:memory:", "sqlite:///rel/m.db", "file:rel/dir", "file:///abs/dir",
                                 "rel/dir", "http://127.0.0.1:5000"])
def test_one_tracking_uri_resolver(uri, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = config.JobConfig.from_dict({"mlflow_uri": uri, "output_dir": str(tmp_path / "o")})
    assert cfg.mlflow_uri == tracking.resolve_tracking_uri(uri)
    assert cfg.mlflow_uri.startswith(("sqlite:////", "file:///", "http://")) or uri == "sqlite:///:memory:"
    if uri == "sqlite:///:memory:":
        assert cfg.mlflow_uri == uri  # SQLite's in-memory database, not a file named ':memory:'


def test_one_arrow_type_check(tmp_path):
    """The shard scan and the input validation accept the same variants; list_view, which the scan accepted
    and the validation refused, is refused by both (it does not cast to list)."""
    good = {"sample_id": pa.array(["a"], pa.large_string()), "task": pa.array(["detailcaps"], pa.string_view()),
            "prompt": pa.array(["p"]), "images": pa.array([[b"x"]], pa.large_list(pa.binary_view())),
            "references": pa.array([["r"]], pa.large_list(pa.string())), "source": pa.array(["s"])}
    t = pa.table(good)
    assert schema.validate_input_table(t).schema.equals(schema.INPUT_SCHEMA)
    path = tmp_path / "s.parquet"
    pq.write_table(t, path)
    inputs.check_shard_schema(str(path))  # the type written back by Parquet: accepted too
    bad = pa.table({**good, "references": pa.array([[1]], pa.list_(pa.int64()))})
    with pytest.raises(schema.SchemaError, match="'references' has type"):
        schema.validate_input_table(bad)
    pq.write_table(bad, path)
    with pytest.raises(config.ConfigError, match="'references' has type"):
        inputs.check_shard_schema(str(path))
    assert not schema.type_matches(pa.list_(pa.string()), pa.string())
    assert not schema.type_matches(pa.list_view(pa.binary()), pa.list_(pa.binary()))


@pytest.mark.parametrize("mode", ["RGBA", "I;16", "P"])
def test_one_image_decoding(mode):
    """The converters' decode_image and the actor's loader give the same RGB pixels (RGBA used to lose its
    alpha in one and be composited on white in the other)."""
    a = (np.arange(32 * 32 * 4) % 251).astype(np.uint8).reshape(32, 32, 4)
    img = Image.fromarray(a, "RGBA")
    img = img.convert("I;16") if mode == "I;16" else (img.convert("P") if mode == "P" else img)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    data = buf.getvalue()
    (actor,) = load_sample_images([data], "detailcaps", 1, 2**20, 10**6)
    assert actor.mode == "RGB" and np.array_equal(np.asarray(actor), np.asarray(decode_image(data)))
    if mode == "RGBA":  # composited on white, not alpha dropped
        assert not np.array_equal(np.asarray(actor), a[..., :3])


def test_one_method_order_the_registrys(monkeypatch):
    """--methods all and the analysis' display order are the registry's: a method registered later comes after the
    others, not where its name sorts; its variants and the fixed-tau sweep follow."""
    late = type("Late", (rcr.methods.Exact,), {"name": "a_late"})
    monkeypatch.setitem(rcr.METHODS, late.name, late)
    methods = config.available_methods()
    assert methods == list(rcr.METHODS) and methods[-1] == "a_late"
    assert order_methods(["fixed@0.05", "a_late", "rcr@rho=0.3", "infinigen", "full", "fixed@0.02"]) == \
        ["full", "infinigen", "a_late", "fixed@0.02", "fixed@0.05", "rcr@rho=0.3"]
