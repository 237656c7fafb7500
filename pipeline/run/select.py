"""The read stage's row filter: which input rows a run computes, and with which methods.

It runs in Ray Data's read tasks, which import the module of the function they run. This module imports pyarrow
only (not torch, transformers or the rest of the pipeline), so a read worker stays a few hundred MB instead of
the ~1 GB a worker that imports torch holds (what Ray Data's memory detector warned about on the read stage).
"""

from __future__ import annotations

import hashlib

import pyarrow as pa

METHODS_COLUMN = "_methods"  # the methods still missing for a sample (resume): added here, read by the actor


def fingerprint_row(row: dict) -> str:
    """Content hash of one input row (to tell the kept occurrence of a duplicated id from the others)."""
    h = hashlib.sha1()
    for k in ("task", "prompt", "source"):
        h.update(repr(row.get(k)).encode())
    for img in row.get("images") or []:
        h.update(len(img or b"").to_bytes(8, "little"))
        h.update(img or b"")
    for r in row.get("references") or []:
        h.update(repr(r).encode())
    return h.hexdigest()


def select_planned(batch: pa.Table, todo: dict[str, list[str]], dup_accept: dict[str, str]) -> pa.Table:
    """Keep planned rows only (the first occurrence of a duplicated id); tag each with its missing methods."""
    ids = batch.column("sample_id").to_pylist()
    keep, methods = [], []
    for i, sid in enumerate(ids):
        ok = sid in todo
        if ok and sid in dup_accept:
            ok = fingerprint_row(batch.slice(i, 1).to_pylist()[0]) == dup_accept[sid]
        if ok:
            keep.append(i)
            methods.append(todo[sid])
    out = batch.take(pa.array(keep, pa.int64()))
    return out.append_column(METHODS_COLUMN, pa.array(methods, pa.list_(pa.string())))
