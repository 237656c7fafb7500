"""Atomic file writes: the one helper every writer in the project uses (output parts, input shards,
calibration files, training checkpoints).

A file appears under its final name only once it is complete: it is written to a hidden ``.tmp-*`` file in
the same directory, flushed and fsynced, then renamed (``os.replace`` is atomic on POSIX). Readers
(pyarrow, pandas, safetensors) therefore see either no file or a whole one, whatever kills the writer.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a hidden temporary file beside ``path``; on success it is flushed, fsynced and renamed onto
    ``path``, so ``path`` is either absent or complete. On error the temporary is removed."""
    path = Path(path)
    tmp = path.parent / f".tmp-{uuid.uuid4().hex}-{path.name}"
    try:
        with open(tmp, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def atomic_write_bytes(data: bytes, path: str | os.PathLike) -> Path:
    with atomic_path(path, "wb") as fh:
        fh.write(data)
    return Path(path)


def atomic_write_text(text: str, path: str | os.PathLike) -> Path:
    with atomic_path(path, "w") as fh:
        fh.write(text)
    return Path(path)


def fsync_dir(d: str | os.PathLike) -> None:
    """Make a rename in ``d`` durable (best effort: some filesystems refuse to fsync a directory)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
