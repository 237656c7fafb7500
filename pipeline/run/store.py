"""Output store: atomic Parquet parts, resume bookkeeping, and the shard scan that plans a job.

Layout of an output directory (``pd.read_parquet(output_dir)`` reads it as is)::

    <output_dir>/
      part-<run_id>-00000.parquet    one file per evaluated batch, OUTPUT_SCHEMA, keyed on (sample_id, method)
      part-<run_id>-00001.parquet
      _runs/<run_id>.json            what each run planned and wrote (ignored by Parquet readers: leading "_")
      _lock                          held (``fcntl.flock``) by the one job writing here; names its pid and host
      _corrupt/<part>.parquet        parts found unreadable at a job's start, moved aside (their rows are redone)

A part file appears under its final name only once it is complete: it is written to a hidden
``.tmp-*`` file in the same directory, flushed and fsynced, then renamed (``os.replace`` is atomic on
POSIX). Readers (pyarrow, pandas) skip names starting with ``.`` or ``_``, so a killed job never leaves a
half-written part that a reader or a resume would see.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.run.config import ConfigError
from pipeline.run.select import fingerprint_row
from pipeline.schema import INPUT_SCHEMA, type_matches
from rcr.fileio import atomic_path, atomic_write_text

PART_PREFIX = "part-"
RUNS_DIR = "_runs"
LOCK_FILE = "_lock"
CORRUPT_DIR = "_corrupt"
TMP_PREFIX = ".tmp-"  # rcr.fileio.atomic_path's temporaries


class PartWriteError(OSError):
    """A part file could not be written (e.g. the disk is full); the message names the output directory."""


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


def atomic_write_table(table: pa.Table, path: str | os.PathLike) -> Path:
    """Write ``table`` to ``path`` so that the file is either absent or complete."""
    with atomic_path(path) as fh:
        # page checksums let a later job tell a part damaged on disk from a good one (OutputStore.set_aside_corrupt)
        pq.write_table(table, fh, compression="zstd", write_page_checksum=True)
    return Path(path)


class OutputStore:
    """The Parquet parts of one output directory, keyed on (sample_id, method)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self._lock_fh = None  # the open _lock file while this process holds the directory

    # ------------------------------------------------------------------ one job at a time

    def acquire(self) -> None:
        """Take the directory's lock for this process (released when it exits, however it exits), or raise
        ConfigError naming the job that holds it. Two jobs writing one directory would each plan the same
        missing rows and write them twice."""
        if self._lock_fh is not None:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        fh = open(self.root / LOCK_FILE, "a+")  # noqa: SIM115 - kept open: the lock lives as long as this file
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            fh.close()
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            raise ConfigError("output_dir", f"{self.root} is in use by another job ({holder}; lock file "
                                            f"{self.root / LOCK_FILE}). Wait for it to finish, or pass another "
                                            "--output-dir") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
        fh.flush()
        self._lock_fh = fh

    def release(self) -> None:
        if self._lock_fh is not None:
            fcntl.flock(self._lock_fh.fileno(), fcntl.LOCK_UN)
            self._lock_fh.close()
            self._lock_fh = None

    def remove_stale_temps(self) -> list[str]:
        """Delete the hidden temporaries of a writer that was killed mid-write (call while holding the lock)."""
        gone = []
        for p in self.root.glob(f"{TMP_PREFIX}*"):
            p.unlink(missing_ok=True)
            gone.append(p.name)
        return gone

    def set_aside_corrupt(self) -> list[str]:
        """Move every part that does not read back whole (truncated, bad page checksum, not Parquet) to
        ``_corrupt/``, where readers and the resume ignore it, so its rows are planned again. Returns the
        names moved. Call while holding the lock."""
        bad = []
        for f in self.part_files():
            try:
                pq.read_table(f, page_checksum_verification=True)
            except Exception:  # noqa: BLE001 - whatever pyarrow raises, the file cannot be used
                (self.root / CORRUPT_DIR).mkdir(exist_ok=True)
                os.replace(f, self.root / CORRUPT_DIR / f.name)
                bad.append(f.name)
        return bad

    def part_files(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob(f"{PART_PREFIX}*.parquet") if p.is_file())

    def existing_keys(self, config_hash: str | None = None) -> set[tuple[str, str]]:
        """Keys already written. With ``config_hash``, refuse a directory that holds another config's rows."""
        keys: set[tuple[str, str]] = set()
        other: dict[str, Path] = {}
        for f in self.part_files():
            t = pq.read_table(f, columns=["sample_id", "method", "config_hash"])
            if config_hash is not None:
                for h in set(t.column("config_hash").to_pylist()):
                    if h != config_hash:
                        other.setdefault(h, f)
            keys.update(zip(t.column("sample_id").to_pylist(), t.column("method").to_pylist()))
        if other:
            h, f = next(iter(other.items()))
            raise ConfigError(
                "output_dir",
                f"{self.root} holds rows of another config (config_hash {h}, e.g. in {f.name}; this job's is "
                f"{config_hash}). A resume only continues the same config: pass a new --output-dir, or rerun "
                "with the same model (and weights), task, max_new_tokens, dtype and rcr settings.")
        return keys

    def write_part(self, table: pa.Table, run_id: str, seq: int) -> Path:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            return atomic_write_table(table, self.root / f"{PART_PREFIX}{run_id}-{seq:05d}.parquet")
        except OSError as e:  # the temporary is already removed: nothing partial is left under a part name
            raise PartWriteError(e.errno, f"cannot write a part file in {self.root}: "
                                          f"{e.strerror or e}") from e

    def read(self, columns: list[str] | None = None) -> pa.Table | None:
        files = self.part_files()
        if not files:
            return None
        return pa.concat_tables([pq.read_table(f, columns=columns) for f in files], promote_options="default")

    def write_run_record(self, run_id: str, record: dict) -> Path:
        d = self.root / RUNS_DIR
        d.mkdir(parents=True, exist_ok=True)
        return atomic_write_text(json.dumps(record, indent=1, default=str), d / f"{run_id}.json")


# ---------------------------------------------------------------------- shards and planning


@dataclass
class ShardRow:
    """One input row's place: its key in the output (``key``) and where it lives."""

    key: str  # the output sample_id: the input's, or a derived one for a bad row (duplicate / missing id)
    sample_id: str | None  # as in the shard
    file: str
    row: int
    error: str | None = None  # set for rows the driver rejects without model work


@dataclass
class Plan:
    rows: list[ShardRow]  # input rows in scope (after limit), shard order
    methods: list[str]
    todo: dict[str, list[str]] = field(default_factory=dict)  # sample_id -> methods to compute (model work)
    driver_errors: list[ShardRow] = field(default_factory=list)  # rows rejected by the driver, needing rows
    dup_accept: dict[str, str] = field(default_factory=dict)  # duplicated sample_id -> fingerprint kept
    n_existing: int = 0

    @property
    def n_pairs(self) -> int:
        return len(self.rows) * len(self.methods)

    @property
    def n_todo_pairs(self) -> int:
        return sum(len(v) for v in self.todo.values()) + sum(len(self.missing_for(r.key)) for r in self.driver_errors)

    def missing_for(self, key: str) -> list[str]:
        return self._missing.get(key, [])

    _missing: dict[str, list[str]] = field(default_factory=dict)


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


def make_plan(rows: list[ShardRow], methods: list[str], existing: set[tuple[str, str]],
              dup_accept: dict[str, str]) -> Plan:
    plan = Plan(rows=rows, methods=list(methods), dup_accept=dup_accept)
    for r in rows:
        missing = [m for m in methods if (r.key, m) not in existing]
        plan.n_existing += len(methods) - len(missing)
        if not missing:
            continue
        plan._missing[r.key] = missing
        if r.error is not None:
            plan.driver_errors.append(r)
        else:
            plan.todo[r.key] = missing
    return plan
