"""Reading and writing input shards (Parquet, ``pipeline.schema.INPUT_SCHEMA``).

* Shards are written atomically (``rcr/fileio.py``), so a shard that exists under its final name is
  complete. A directory of shards gets a ``_SUCCESS`` marker
  (with the row count) only after its last shard is in place; readers refuse a directory without it
  unless ``require_complete=False``.
* ``read_input`` accepts a ``.parquet``/``.arrow`` file or a directory of them, validates the schema and
  names the file in every error.
* ``write_synthetic`` generates synthetic samples (``pipeline/data/synthetic.py``) in worker processes; the
  output depends only on (task, n, seed), never on the number of workers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data import synthetic
from pipeline.schema import input_table_from_records, validate_input_table
from pipeline.tasks import TASKS
from rcr.fileio import atomic_path, atomic_write_text

SUCCESS_MARKER = "_SUCCESS"


class DataError(ValueError):
    """Bad input data: an unreadable file, an undecodable image, an incomplete shard directory."""


# ------------------------------------------------------------------------------------------- write
def write_shard(table: pa.Table, path: str | os.PathLike, validate: bool = True) -> Path:
    """Write ``table`` as one Parquet shard at ``path``, atomically (``rcr/fileio.py``)."""
    path = Path(path)
    if validate:
        table = validate_input_table(table, where=str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as fh:
        pq.write_table(table, fh, compression="zstd")
    return path


def mark_complete(out_dir: str | os.PathLike, rows: int, extra: dict | None = None) -> None:
    atomic_write_text(json.dumps({"rows": rows, **(extra or {})}), Path(out_dir) / SUCCESS_MARKER)


def write_shards(records: Iterable[dict], out_dir: str | os.PathLike, shard_size: int = 256,
                 prefix: str = "part", extra: dict | None = None) -> list[Path]:
    """Write records into ``out_dir/prefix-00000.parquet`` ..., then the completion marker."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    marker = out_dir / SUCCESS_MARKER
    if marker.exists():
        marker.unlink()  # the directory is being rewritten: not complete until we say so
    paths, buf, total = [], [], 0
    for rec in records:
        buf.append(rec)
        if len(buf) >= shard_size:
            paths.append(write_shard(input_table_from_records(buf, f"{out_dir} shard {len(paths)}"),
                                     out_dir / f"{prefix}-{len(paths):05d}.parquet", validate=False))
            total += len(buf)
            buf = []
    if buf or not paths:
        paths.append(write_shard(input_table_from_records(buf, f"{out_dir} shard {len(paths)}"),
                                 out_dir / f"{prefix}-{len(paths):05d}.parquet", validate=False))
        total += len(buf)
    # remove stale shards from an earlier, larger write
    keep = {p.name for p in paths}
    for old in out_dir.glob(f"{prefix}-*.parquet"):
        if old.name not in keep:
            old.unlink()
    mark_complete(out_dir, total, extra)
    return paths


# ------------------------------------------------------------------------------------------- read
def _shard_files(path: Path, require_complete: bool) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    files = sorted(p for p in path.iterdir() if p.suffix in (".parquet", ".arrow") and not p.name.startswith("."))
    if not files:
        raise DataError(f"{path}: no .parquet or .arrow shards in this directory")
    if require_complete and not (path / SUCCESS_MARKER).exists():
        raise DataError(f"{path}: shard directory is incomplete (no {SUCCESS_MARKER} marker; was the writer "
                        f"interrupted?). Pass require_complete=False to read it anyway.")
    return files


def _read_one(f: Path) -> pa.Table:
    try:
        if f.suffix == ".arrow":
            with pa.memory_map(str(f)) as src:
                try:
                    return pa.ipc.open_file(src).read_all()
                except pa.ArrowInvalid:
                    src.seek(0)
                    return pa.ipc.open_stream(src).read_all()
        return pq.read_table(f)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{f}: cannot read shard ({e})") from e


def read_input(path: str | os.PathLike, require_complete: bool = True, limit: int | None = None) -> pa.Table:
    """Read and validate an input file or shard directory; returns a table with ``INPUT_SCHEMA``."""
    path = Path(path)
    tables = []
    for f in _shard_files(path, require_complete):
        tables.append(validate_input_table(_read_one(f), where=str(f)))
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    if len(tables) > 1:
        table = validate_input_table(table, where=str(path))  # sample_id unique across shards
    return table.slice(0, limit) if limit is not None else table


def iter_input_rows(path: str | os.PathLike, require_complete: bool = True):
    yield from read_input(path, require_complete).to_pylist()


# ------------------------------------------------------------------------------------------- synthetic
def _synthetic_chunk(args):
    task, seed, start, stop, layout = args
    return [synthetic.make_record(task, seed, i, layout=layout) for i in range(start, stop)]


def synthetic_records(task: str, n: int, seed: int = 0, workers: int = 1, chunk: int = 64,
                      layout: str | None = None):
    """Records ``0..n-1`` of the synthetic ``task`` in order; identical for any ``workers``. ``layout``: the
    scene layout, default ``synthetic.DEFAULT_LAYOUT`` (the shipped model's)."""
    synthetic.check_task(task)
    if n < 0:
        raise synthetic.SyntheticError(f"n must be >= 0, got {n}")
    layout = synthetic.get_layout(layout or synthetic.DEFAULT_LAYOUT).name
    jobs = [(task, seed, s, min(n, s + chunk), layout) for s in range(0, n, chunk)]
    if workers <= 1:  # one record at a time, so that a progress count (write_synthetic's done) moves by one
        for _, _, start, stop, _ in jobs:
            for i in range(start, stop):
                yield synthetic.make_record(task, seed, i, layout=layout)
        return
    with ProcessPoolExecutor(max_workers=workers) as ex:
        for recs in ex.map(_synthetic_chunk, jobs):
            yield from recs


def write_synthetic(out_dir: str | os.PathLike, task: str, n: int, seed: int = 0, shard_size: int = 256,
                    workers: int = 1, layout: str | None = None, done=None) -> list[Path]:
    """Generate ``n`` synthetic samples of ``task`` into Parquet shards under ``out_dir``; ``done(k)`` (optional) as
    the k-th scene is drawn (a progress line's count, ``pipeline.progress.Stage``)."""
    layout = synthetic.get_layout(layout or synthetic.DEFAULT_LAYOUT).name
    records = synthetic_records(task, n, seed, workers, layout=layout)
    if done is not None:
        records = _counted(records, done)
    return write_shards(records, out_dir, shard_size, prefix=task,
                        extra={"task": task, "seed": seed, "source": "synthetic", "layout": layout})


def _counted(records, done):
    for k, r in enumerate(records, 1):
        done(k)
        yield r


# default sizes of the embedded job's synthetic shards (the paper's sample counts for the real datasets)


def write_synthetic_shards(task: str, out_dir: str | os.PathLike, n: int | None = None, seed: int | None = None,
                           shard_size: int = 256, workers: int = 1, layout: str | None = None,
                           done=None) -> list[Path]:
    """The embedded default's shards: held-out synthetic samples (seed ``synthetic.HELDOUT_SEED``, never
    seen in training) of ``task``; ``n`` defaults to the task's ``embedded_size`` (``pipeline/tasks/``)."""
    synthetic.check_task(task)
    n = TASKS[task].embedded_size if n is None else n
    seed = synthetic.HELDOUT_SEED if seed is None else seed
    return write_synthetic(out_dir, task, n, seed, shard_size, workers, layout, done)

