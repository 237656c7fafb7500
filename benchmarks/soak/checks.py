"""The soak's invariants, read with pyarrow and sqlite3 directly: nothing here goes through the pipeline's own
readers (``pipeline/run/store.py``, MLflow's client, ``pipeline/analysis``), so a bug there cannot hide itself.

(a) exactly N x M rows, each (sample, method) once; (b) every row's output ids equal the fault-free reference's;
(c) nothing partial or temporary in the output dir, and no run record left ``running``; (d) the MLflow store: no
run RUNNING, one current parent FINISHED with one child per method, metrics equal to the reference store's (timing
metrics aside), the same artifacts, and ``PRAGMA integrity_check`` ok; (e) every nonzero exit printed one line
naming what happened, no traceback.
"""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path
from urllib.parse import unquote, urlparse

import pyarrow.parquet as pq

# metrics that are wall times or rates of them: they differ between any two runs
TIMING = re.compile(r"tokens_per_s|prefill_s|decode_s|wall")

# the one line a nonzero exit must print (the job's, infra/submit.py's): what happened, in words
ONE_LINERS = re.compile(
    r"\[rcr-job\] interrupted|\[rcr-job\] writing the output failed|\[rcr-job\] the job stopped:"
    r"|\[rcr-job\] MLflow logging failed|\[rcr-job\] the Ray pipeline failed|\[rcr-job\] the Ray head .* unreachable"
    r"|\[rcr-job\] could not start or join Ray|\[submit\] job \S+ (failed|stopped)|\[submit\] lost"
    r"|\[rcr-job\] config error|\[rcr-job\] the job's driver .* ended without a word")


def rows(out: Path) -> tuple[list[tuple[str, str]], dict[tuple[str, str], tuple]]:
    """Every row's key, in file order (duplicates kept), and key -> (output ids, error)."""
    keys, content = [], {}
    for f in sorted(out.glob("part-*.parquet")):
        t = pq.read_table(f, columns=["sample_id", "method", "output_ids", "error"]).to_pydict()
        for s, m, ids, err in zip(t["sample_id"], t["method"], t["output_ids"], t["error"]):
            keys.append((s, m))
            content[(s, m)] = (tuple(ids or ()), err)
    return keys, content


def check_rows(out: Path, reference: dict[tuple[str, str], tuple]) -> list[str]:
    """(a) and (b) against the reference's key -> (output ids, error)."""
    bad = []
    keys, content = rows(out)
    dup = len(keys) - len(set(keys))
    lost, extra = set(reference) - set(keys), set(keys) - set(reference)
    if dup or lost or extra or len(keys) != len(reference):
        bad.append(f"(a) {len(keys)} rows for {len(reference)} keys: {dup} duplicated, {len(lost)} lost "
                   f"(e.g. {sorted(lost)[:2]}), {len(extra)} not planned")
    differ = [k for k in set(keys) & set(reference) if content[k] != reference[k]]
    if differ:
        bad.append(f"(b) {len(differ)} row(s) differ from the fault-free reference, e.g. {sorted(differ)[0]}")
    return bad


def check_files(out: Path) -> list[str]:
    """(c): only whole parts (page checksums verified), the lock, and run records that are JSON and not running."""
    bad = []
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out).as_posix()
        if p.is_dir() and rel == "_runs":
            continue
        if rel == "_lock":
            continue
        if re.fullmatch(r"part-[^/]+\.parquet", rel):
            try:
                pq.read_table(p, page_checksum_verification=True)
            except Exception as e:  # noqa: BLE001 - any reader error: the part is not whole
                bad.append(f"(c) {rel} does not read back whole ({type(e).__name__})")
            continue
        if re.fullmatch(r"_runs/[^/]+\.json", rel):
            try:
                status = json.loads(p.read_text()).get("status")
            except ValueError:
                bad.append(f"(c) {rel} is not JSON")
                continue
            if status == "running":
                bad.append(f"(c) {rel} is left 'running'")
            continue
        bad.append(f"(c) {rel} left in the output dir")
    return bad


def _db(store: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{store / 'mlflow.db'}?mode=ro", uri=True)


def store_summary(store: Path) -> dict:
    """What (d) compares: the current parent's and its children's metrics (timing aside, children by method) and the
    parent's artifact files; plus every problem found on the way."""
    bad = []
    with _db(store) as db:
        integrity = db.execute("PRAGMA integrity_check").fetchall()
        if integrity != [("ok",)]:
            bad.append(f"(d) PRAGMA integrity_check: {integrity[:3]}")
        runs = {r[0]: {"status": r[1], "stage": r[2], "artifacts": r[3]} for r in
                db.execute("SELECT run_uuid, status, lifecycle_stage, artifact_uri FROM runs")}
        for rid, key, value in db.execute("SELECT run_uuid, key, value FROM tags"):
            runs[rid].setdefault("tags", {})[key] = value
        metrics: dict[str, dict[str, float]] = {}
        for rid, key, value in db.execute("SELECT run_uuid, key, value FROM latest_metrics"):
            if not TIMING.search(key):
                metrics.setdefault(rid, {})[key] = value
    running = [rid for rid, r in runs.items() if r["status"] == "RUNNING"]
    if running:
        bad.append(f"(d) {len(running)} run(s) left RUNNING")
    active = {rid: r for rid, r in runs.items() if r["stage"] == "active"}
    parents = [rid for rid, r in active.items() if r.get("tags", {}).get("rcr.role") == "parent"]
    current = [rid for rid in parents if "rcr.superseded_by" not in active[rid].get("tags", {})]
    if len(parents) != 1 or len(current) != 1:
        bad.append(f"(d) {len(parents)} parent run(s), {len(current)} current (want one)")
        return {"bad": bad}
    pid = current[0]
    parent = active[pid]
    if parent["status"] != "FINISHED" or parent["tags"].get("rcr.complete") != "1":
        bad.append(f"(d) the parent is {parent['status']}, complete={parent['tags'].get('rcr.complete')}")
    children = {rid: r for rid, r in active.items() if r.get("tags", {}).get("mlflow.parentRunId") == pid}
    others = set(active) - {pid} - set(children)
    if others:
        bad.append(f"(d) {len(others)} active run(s) neither the parent nor its children")
    methods = sorted(r["tags"].get("rcr.method", "?") for r in children.values())
    if any(r["status"] != "FINISHED" for r in children.values()):
        bad.append("(d) a method run is not FINISHED")
    return {"bad": bad, "methods": methods, "parent": metrics.get(pid, {}),
            "children": {r["tags"].get("rcr.method"): metrics.get(rid, {}) for rid, r in children.items()},
            "artifacts": _artifacts(parent["artifacts"])}


def _artifacts(uri: str) -> list[str]:
    root = Path(unquote(urlparse(uri).path))
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) if root.is_dir() else []


def check_store(store: Path, reference: dict, methods: list[str]) -> list[str]:
    """(d) against the reference store's :func:`store_summary`."""
    got = store_summary(store)
    bad = got["bad"]
    if "methods" not in got:
        return bad
    if got["methods"] != sorted(methods):
        bad.append(f"(d) method runs {got['methods']}, want one per method {sorted(methods)}")
    if got["parent"] != reference["parent"]:
        diff = sorted(k for k in set(got["parent"]) | set(reference["parent"])
                      if got["parent"].get(k) != reference["parent"].get(k))
        bad.append(f"(d) parent metrics differ from the fault-free store's: {diff[:4]}")
    for m, ref in reference["children"].items():
        if got["children"].get(m) != ref:
            bad.append(f"(d) {m}'s metrics differ from the fault-free store's")
    if got["artifacts"] != reference["artifacts"]:
        bad.append(f"(d) parent artifacts differ: {sorted(set(got['artifacts']) ^ set(reference['artifacts']))[:4]}")
    return bad


def check_exit(returncode: int, log: str, killed: bool) -> list[str]:
    """(e) for one run of the command: a nonzero exit (other than the command itself SIGKILLed, which cannot
    print) names what happened in one known line and prints no traceback."""
    if returncode == 0 or killed:
        return []
    bad = []
    if "Traceback (most recent call last)" in log:
        first = log[log.index("Traceback (most recent call last)"):].splitlines()
        last = next((ln for ln in reversed(first[:60]) if ln and not ln.startswith(" ")), first[-1])
        bad.append(f"(e) exit {returncode} printed a traceback ({last.strip()[:120]})")
    if not ONE_LINERS.search(log):
        tail = [ln for ln in log.splitlines() if ln.strip()][-1:] or ["<no output>"]
        bad.append(f"(e) exit {returncode} without a line naming what happened (last line: {tail[0][:120]})")
    return bad
