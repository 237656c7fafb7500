"""The output store: atomic Parquet parts, the directory's lock, resume bookkeeping (the keys already written).

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
import json
import os
import socket
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rcr.config import ConfigError
from rcr.fileio import atomic_path, atomic_write_text

PART_PREFIX = "part-"
RUNS_DIR = "_runs"
LOCK_FILE = "_lock"
CORRUPT_DIR = "_corrupt"
TMP_PREFIX = ".tmp-"  # rcr.fileio.atomic_path's temporaries


class PartWriteError(OSError):
    """A part file could not be written (e.g. the disk is full); the message names the output directory."""


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

    def run_keys(self, run_id: str) -> set[tuple[str, str]]:
        """The keys in the parts run ``run_id`` renamed into place."""
        keys: set[tuple[str, str]] = set()
        for f in self.root.glob(f"{PART_PREFIX}{run_id}-*.parquet"):
            t = pq.read_table(f, columns=["sample_id", "method"])
            keys.update(zip(t.column("sample_id").to_pylist(), t.column("method").to_pylist()))
        return keys

    def mark_dead_runs(self) -> list[str]:
        """Run records still ``running`` when a job takes the lock belong to jobs that ended without a word (SIGKILL,
        a lost node or cluster): mark them ``died``. Call while holding the lock. Returns their run ids."""
        dead = []
        for p in sorted((self.root / RUNS_DIR).glob("*.json")):
            try:
                rec = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            if rec.get("status") == "running":
                rec.update(status="died", error="the job ended without updating this record (killed, or its node or "
                                                "cluster was lost); found by the next job on this directory at "
                                                + time.strftime("%Y-%m-%dT%H:%M:%S"))
                self.write_run_record(p.stem, rec)
                dead.append(p.stem)
        return dead

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
