"""`infra/local_cluster.sh clean` (infra/clean.py): it removes what the project's commands wrote, says what with its
size, and touches nothing else. The quickstart's own clean-up, after a real cluster and job, is in
test_pipeline_infra.py."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tests.pipeline_helpers import PY, REPO

CLEAN = ["bash", str(REPO / "infra" / "local_cluster.sh"), "clean"]


def _env(**kw) -> dict:
    env = dict(os.environ, PATH=f"{Path(PY).parent}:{os.environ.get('PATH', '')}", **kw)
    env.pop("RAY_ADDRESS", None)
    return env


def _human():
    """infra/clean.py's size format (infra/ is not a package)."""
    spec = importlib.util.spec_from_file_location("clean", REPO / "infra" / "clean.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.human


def _files(root: Path) -> dict[str, str]:
    """Every file under ``root`` (links as links) -> a digest of its content."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(root))] = f"-> {os.readlink(p)}"
        elif p.is_file():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _write(path: Path, data: bytes = b"x" * 4096) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_clean_on_a_home_where_the_projects_commands_ran(tmp_path, monkeypatch):
    """A HOME (no RCR_RUNS_DIR, no cache variables: every default) where the project's commands wrote, beside the
    user's own files. For real: the README's lmms-eval task command. As they lie on disk: lmms-eval's copy of the
    tasks' data, a job's output and its Ray session, and the fused kernels' build in torch's extension cache.
    `clean` removes exactly the project's, one line each with its size, then the total; every other file is as it
    was. (The quickstart test in test_pipeline_infra.py cleans up after a real cluster and job.)"""
    home, ray_tmp = tmp_path / "home", tmp_path / "rcr-ray"
    env = _env(HOME=str(home), RCR_RAY_TMP=str(ray_tmp))
    for k in ("RCR_RUNS_DIR", "TORCH_EXTENSIONS_DIR", "XDG_CACHE_HOME", "HF_HOME", "HF_DATASETS_CACHE",
              "LMMS_EVAL_DATASETS_CACHE"):
        env.pop(k, None)
    # the user's own files, some next to or named like the project's
    theirs = ["notes.md", "rcr-runs-old/results.csv", ".cache/huggingface/hub/models--org--m/blobs/abc",
              ".cache/huggingface/datasets/parquet/default-0123456789abcdef/0.0.0/h/parquet-train.arrow",
              ".cache/torch_extensions/py311_cpu/someone_elses_op/someone_elses_op.so",
              ".cache/matplotlib/fontlist-v390.json",
              "work/tasks/rcr_detailcaps.yaml"]  # tasks written where the user named (OUT): theirs
    for name in theirs:
        _write(home / name, os.urandom(2048))
    before = _files(home)

    # the README's lmms-eval task command (its defaults: HOME's runs directory), in this process
    from pipeline.lmms.tasks import main as lmms_tasks

    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("RCR_RUNS_DIR", raising=False)
    assert lmms_tasks(["--n", "1"]) == 0
    tasks = home / "rcr-runs" / "lmms-tasks"
    assert (tasks / "rcr_detailcaps.yaml").is_file() and (tasks / "rcr_textcaps.yaml").is_file()
    # lmms-eval's Arrow copy of their data, where their YAML sends it (tests/pipeline/test_lmms_eval.py loads it)
    _write(tasks / "hf-datasets" / "parquet" / "default-fedcba9876543210" / "0.0.0" / "h" / "parquet-test.arrow")
    # a job's output and its Ray session (listed, as the driver lists it), the fused kernels' build
    runs = home / "rcr-runs"
    (runs / "detailcaps-embedded").mkdir()
    pq.write_table(pa.table({"sample_id": ["a"], "method": ["full"]}), runs / "detailcaps-embedded" / "p.parquet")
    session = ray_tmp / "session_2026-01-01_00-00-00_000000_1"
    _write(session / "logs" / "raylet.out")
    (runs / "ray-sessions").write_text(f"{session}\n")
    kernels = home / ".cache" / "torch_extensions" / "py311_cpu" / "rcr_ops_0123456789ab"
    _write(kernels / "rcr_ops_0123456789ab.so")
    du = int(subprocess.run(["du", "-sB1", str(runs)], capture_output=True, text=True, check=True).stdout.split()[0])

    r = subprocess.run(CLEAN, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert _files(home) == before  # the user's files, each as it was, and nothing of the project's left
    assert not runs.exists() and not session.exists() and not ray_tmp.exists()
    human = _human()
    assert f"removed the runs directory (job outputs, shards, MLflow store, lmms-eval tasks) {runs} ({human(du)})" \
        in out, out
    assert re.search(rf"removed Ray session {re.escape(str(session))} \(\d+(\.\d)? kB\)", out), out
    assert re.search(rf"removed the fused kernels' build {re.escape(str(kernels))} \(\d+(\.\d)? kB\)", out), out
    assert re.search(r"^\[local-cluster\] removed 4 item\(s\), \d+(\.\d)? (kB|MB) in all$", out, re.M), out
    # a second clean finds nothing of the project's, and says so
    r = subprocess.run(CLEAN, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and "nothing to remove" in r.stdout, r.stdout + r.stderr
    assert _files(home) == before


def test_clean_removes_the_projects_sessions_and_runs_dir_and_nothing_else(tmp_path):
    """`local_cluster.sh clean`: the Ray sessions listed in the runs directory go, then the runs directory; a
    session of another runs directory in the same temp dir, and another Ray root (as /tmp/ray), stay. A listed
    session that a running process still uses stops the whole clean-up before anything is removed."""
    project_tmp, other_root, runs = tmp_path / "rcr-ray", tmp_path / "ray", tmp_path / "runs"
    ours_a, ours_b = project_tmp / "session_a", project_tmp / "session_b"
    theirs, shared = project_tmp / "session_c", other_root / "session_d"
    for d in (ours_a, ours_b, theirs, shared):
        (d / "logs").mkdir(parents=True)
    (project_tmp / "session_latest").symlink_to(ours_b)
    (runs / "detailcaps-embedded").mkdir(parents=True)
    (runs / "ray-sessions").write_text(f"{ours_a}\n{ours_b}\n")
    # torch's extension cache (TORCH_EXTENSIONS_DIR unset: <XDG_CACHE_HOME>/torch_extensions/<python>_<accelerator>)
    exts = tmp_path / "cache" / "torch_extensions"
    kernels, other_ext = exts / "py311_cpu" / "rcr_ops_0123456789ab", exts / "py311_cpu" / "someone_elses_op"
    for d in (kernels, other_ext):
        d.mkdir(parents=True)
        (d / "lib.so").write_bytes(b"\x7fELF")
    env = _env(RCR_RUNS_DIR=str(runs), RCR_RAY_TMP=str(project_tmp))
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    env.pop("TORCH_EXTENSIONS_DIR", None)
    clean = ["bash", str(REPO / "infra" / "local_cluster.sh"), "clean"]
    user = subprocess.Popen([PY, "-c", "import sys; sys.stdin.read()", f"--session-dir={ours_b}"],
                            stdin=subprocess.PIPE)  # names its session as Ray's processes do
    try:
        r = subprocess.run(clean, env=env, capture_output=True, text=True, timeout=120, check=False)
    finally:
        user.stdin.close()
        user.wait(timeout=60)
    assert r.returncode == 1 and f"{ours_b} is in use by pid(s) {user.pid}" in r.stderr, r.stdout + r.stderr
    assert all(p.exists() for p in (ours_a, ours_b, runs, theirs, shared, kernels))

    r = subprocess.run(clean, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not ours_a.exists() and not ours_b.exists() and not runs.exists()
    assert theirs.is_dir() and shared.is_dir() and not (project_tmp / "session_latest").is_symlink()
    assert not kernels.exists() and (other_ext / "lib.so").is_file()  # rcr's kernels' build only
    # once the last session of the temp dir is the project's, the temp dir goes with it
    runs.mkdir()
    (runs / "ray-sessions").write_text(f"{theirs}\n")
    r = subprocess.run(clean, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not project_tmp.exists() and not runs.exists() and shared.is_dir()


def test_clean_py_help_prints_its_usage_and_removes_nothing(tmp_path):
    (tmp_path / "--help").mkdir()  # were "--help" read as a runs directory, this would go
    r = subprocess.run([PY, str(REPO / "infra" / "clean.py"), "--help"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 0 and "python infra/clean.py RUNS_DIR" in r.stderr, r.stdout + r.stderr
    assert (tmp_path / "--help").is_dir() and r.stdout == ""
