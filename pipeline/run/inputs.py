"""The job's inputs: the shards it reads (the embedded synthetic ones, a named dataset converted once, or given
files), their schema check, and the scan of their ``sample_id`` column that lists the rows in scope.

Everything here runs in the driver before any model work; a bad input is a ConfigError naming ``shards`` or
``dataset``, and a bad row (a missing or duplicate id) becomes a ``ShardRow`` with an error, an error row later.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data import convert, shards, synthetic
from pipeline.quiet import say
from pipeline.run.config import EMBEDDED, JobConfig, default_runs_root
from pipeline.run.select import fingerprint_row
from pipeline.schema import INPUT_SCHEMA, type_matches
from rcr.config import ConfigError
from rcr.embedded import scene_layout


def embedded_shards(task: str, model: str = EMBEDDED) -> list[str]:
    """The synthetic shards for ``task`` in the scene layout ``model`` was trained on (an embedded model's, or the
    default's for any other model), generated once (deterministic) into the runs directory."""
    # keyed on the scene layout: shards cached for another embedded model's layout are never reused
    layout = scene_layout(model) or synthetic.DEFAULT_LAYOUT
    cache = default_runs_root() / "shards" / layout / task
    if not (cache / shards.SUCCESS_MARKER).is_file():  # absent, or an interrupted write
        write_embedded_shards(task, cache, layout=layout)
    return [str(cache)]


def write_embedded_shards(task: str, out_dir: Path, n: int | None = None, layout: str | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    say(f"writing the embedded synthetic {task} shards to {out_dir}")
    shards.write_synthetic_shards(task=task, out_dir=str(out_dir), n=n, layout=layout)


def dataset_shards(spec: str, task: str) -> list[str]:
    """``--dataset``: the named dataset converted in full once, by the task's converter, into input shards under
    ``~/rcr-runs/datasets/`` (a new revision, split or changed local copy gets its own directory). The job
    then streams them like any shards: resume and ``limit`` work on their sample ids. The Hub's pinned revision,
    once converted, is used as it is; otherwise the split is located first (a split the copy lacks fails here,
    before any model work), and the revision read, or the split's files, name the directory."""
    named = convert.parse_dataset(spec, task)
    root = default_runs_root() / "datasets"
    if named.local_path is None and (root / named.cache_name() / shards.SUCCESS_MARKER).is_file():
        return [str(root / named.cache_name())]
    try:
        loc = named.locate()
        if loc.note:
            say(loc.note)
        cache = root / named.cache_name(loc)
        if not (cache / shards.SUCCESS_MARKER).is_file():  # absent, or an interrupted write
            say(f"converting {spec} to input shards in {cache} (once)")
            shards.write_shards(named.records(loc), cache, prefix=named.task.name)
    except convert.OfflineError as e:
        raise ConfigError("dataset", f"{e} (for a job: --dataset <that file or dir>)") from None
    except shards.DataError as e:
        raise ConfigError("dataset", str(e)) from None
    return [str(cache)]


def scan_inputs(cfg: JobConfig) -> tuple[list[str], list, Any]:
    """The job's shard paths and rows, schema-checked; (paths, rows, duplicate policy). Writes nothing to the
    output directory, so a bad shard fails before the output directory is created or locked."""
    if cfg.dataset is not None:
        specs = dataset_shards(cfg.dataset, cfg.task)
    else:
        specs = embedded_shards(cfg.task, cfg.model) if cfg.shards == [EMBEDDED] else cfg.shards
    paths = resolve_shards(specs)
    rows, dup_accept = scan_shards(paths, cfg.limit)
    if not rows:
        raise ConfigError("shards", "the shards hold no rows")
    return paths, rows, dup_accept


@dataclass
class ShardRow:
    """One input row's place: its key in the output (``key``) and where it lives."""

    key: str  # the output sample_id: the input's, or a derived one for a bad row (duplicate / missing id)
    sample_id: str | None  # as in the shard
    file: str
    row: int
    error: str | None = None  # set for rows the driver rejects without model work


def resolve_shards(patterns: list[str]) -> list[str]:
    """Files, directories (their ``*.parquet``, recursively) and globs -> sorted absolute paths."""
    out: list[str] = []
    for pat in patterns:
        p = Path(pat).expanduser()
        if p.is_dir():
            found = sorted(str(f.resolve()) for f in p.rglob("*.parquet") if not f.name.startswith((".", "_")))
        elif p.is_file():
            found = [str(p.resolve())]
        else:
            found = sorted(str(Path(f).resolve()) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
        if not found:
            raise ConfigError("shards", f"'{pat}' matches no Parquet file")
        out.extend(f for f in found if f not in out)
    return out


def check_shard_schema(path: str) -> pa.Schema:
    """Compare a shard's schema to the input schema; raise ConfigError naming the column."""
    try:
        schema = pq.read_schema(path)
    except Exception as e:  # noqa: BLE001 - any unreadable file is a config error
        raise ConfigError("shards", f"{path} is not a readable Parquet file: {e}") from None
    expected: pa.Schema = INPUT_SCHEMA
    for f in expected:
        if f.name not in schema.names:
            raise ConfigError("shards", f"{path}: column '{f.name}' is missing (input schema: "
                                        f"{', '.join(expected.names)})")
        got = schema.field(f.name).type
        if not type_matches(got, f.type):
            raise ConfigError("shards", f"{path}: column '{f.name}' has type {got}, expected {f.type}")
    return schema


def scan_shards(paths: list[str], limit: int | None) -> tuple[list[ShardRow], dict[str, str]]:
    """Read only the sample_id column of each shard, in order; flag duplicate and missing ids.

    Returns the rows in scope and, for each duplicated id, the fingerprint of its first occurrence (the one
    that is evaluated; later occurrences become error rows keyed ``<id>#dup<k>``).
    """
    rows: list[ShardRow] = []
    first: dict[str, ShardRow] = {}
    seen_count: dict[str, int] = {}
    dup_ids: set[str] = set()
    for path in paths:
        check_shard_schema(path)
        ids = pq.read_table(path, columns=["sample_id"]).column("sample_id").to_pylist()
        for i, sid in enumerate(ids):
            if limit is not None and len(rows) >= limit:
                break
            if sid is None or str(sid).strip() == "":
                key = f"{Path(path).stem}#row{i}"
                rows.append(ShardRow(key, sid, path, i, error=f"bad input: sample_id is missing or empty "
                                                             f"(shard {Path(path).name}, row {i})"))
                continue
            n = seen_count.get(sid, 0) + 1
            seen_count[sid] = n
            if n == 1:
                r = ShardRow(sid, sid, path, i)
                first[sid] = r
            else:
                f0 = first[sid]
                dup_ids.add(sid)
                r = ShardRow(f"{sid}#dup{n}", sid, path, i, error=(
                    f"bad input: duplicate sample_id '{sid}' (occurrence {n}, shard {Path(path).name} row {i}); "
                    f"the first occurrence (shard {Path(f0.file).name} row {f0.row}) is evaluated"))
            rows.append(r)
        if limit is not None and len(rows) >= limit:
            break
    dup_accept: dict[str, str] = {}
    if dup_ids:
        for sid in dup_ids:
            f0 = first[sid]
            t = pq.read_table(f0.file).slice(f0.row, 1).to_pylist()[0]
            dup_accept[sid] = fingerprint_row(t)
    return rows, dup_accept


def read_rows(rows: list[ShardRow]) -> dict[tuple[str, int], dict]:
    """Read the given (file, row) input rows in full (used for the few rows the driver rejects)."""
    out: dict[tuple[str, int], dict] = {}
    by_file: dict[str, list[int]] = {}
    for r in rows:
        by_file.setdefault(r.file, []).append(r.row)
    for f, idx in by_file.items():
        t = pq.read_table(f, columns=["sample_id", "task", "prompt", "references", "source"])
        for i in idx:
            out[(f, i)] = t.slice(i, 1).to_pylist()[0]
    return out
