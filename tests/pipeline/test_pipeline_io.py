"""Output store and planning: atomic parts, resume keys, config-hash guard, shard schema checks, duplicates."""


import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.run.config import ConfigError
from pipeline.run.inputs import resolve_shards, scan_shards
from pipeline.run.plan import make_plan
from pipeline.run.store import OutputStore
from pipeline.schema import output_table
from tests.pipeline_helpers import synthetic_records, write_shard


def _rows(keys, h="abc"):
    return output_table([{"sample_id": s, "method": m, "config_hash": h, "n_steps": 1} for s, m in keys])


def test_parts_are_atomic_and_keyed(tmp_path):
    store = OutputStore(tmp_path / "out")
    store.write_part(_rows([("a", "full"), ("a", "rcr")]), "r1", 0)
    (tmp_path / "out" / ".tmp-deadbeef-part-r1-00001.parquet").write_bytes(b"half a file")  # a killed write
    assert store.existing_keys("abc") == {("a", "full"), ("a", "rcr")}
    import pandas as pd

    assert len(pd.read_parquet(tmp_path / "out")) == 2  # hidden temp files and _runs/ are ignored
    store.write_run_record("r1", {"x": 1})
    assert len(pd.read_parquet(tmp_path / "out")) == 2


def test_other_config_is_refused(tmp_path):
    store = OutputStore(tmp_path)
    store.write_part(_rows([("a", "full")], h="old"), "r1", 0)
    with pytest.raises(ConfigError, match="field 'output_dir'.*config_hash old"):
        store.existing_keys("new")


def test_plan_skips_existing_and_flags_duplicates(tmp_path):
    recs = synthetic_records("textcaps", 4)
    write_shard(tmp_path / "s" / "a.parquet", recs[:2])
    write_shard(tmp_path / "s" / "b.parquet", [recs[2], dict(recs[0], prompt="other"), recs[3]])
    paths = resolve_shards([str(tmp_path / "s")])
    rows, dup_accept = scan_shards(paths, limit=None)
    keys = [r.key for r in rows]
    assert keys == [recs[0]["sample_id"], recs[1]["sample_id"], recs[2]["sample_id"],
                    recs[0]["sample_id"] + "#dup2", recs[3]["sample_id"]]
    assert set(dup_accept) == {recs[0]["sample_id"]}
    plan = make_plan(rows, ["full", "rcr"], {(recs[1]["sample_id"], "full")}, dup_accept)
    assert plan.todo[recs[1]["sample_id"]] == ["rcr"]
    assert [r.key for r in plan.driver_errors] == [recs[0]["sample_id"] + "#dup2"]
    assert plan.n_pairs == 10 and plan.n_existing == 1 and plan.n_todo_pairs == 9
    rows3, _ = scan_shards(paths, limit=3)
    assert len(rows3) == 3


def test_wrong_shard_schema_names_the_column(tmp_path):
    p = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"sample_id": ["a"], "task": ["detailcaps"], "prompt": ["p"], "images": ["notbytes"],
                             "references": [["r"]], "source": ["s"]}), p)
    with pytest.raises(ConfigError, match="column 'images' has type string"):
        scan_shards([str(p)], None)
    pq.write_table(pa.table({"sample_id": ["a"]}), p)
    with pytest.raises(ConfigError, match="column 'task' is missing"):
        scan_shards([str(p)], None)
    with pytest.raises(ConfigError, match="field 'shards'"):
        resolve_shards([str(tmp_path / "nothing-*.parquet")])
