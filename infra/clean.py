"""`infra/local_cluster.sh clean`: remove what the project created for one runs directory, and nothing else.

    python infra/clean.py RUNS_DIR

1. The Ray sessions listed in RUNS_DIR/ray-sessions: the local cluster's head sessions (infra/local_cluster.sh)
   and the private sessions of plain `python jobs/...` runs (pipeline/run/ray_local.py). Each is a
   `session_*` directory. If a running process names one on its command line (a job of this runs directory
   still runs), nothing at all is removed and the exit status is 1.
2. In the directory that held them (the project's Ray temp dir, e.g. /tmp/rcr-ray-<uid>): the links Ray keeps
   there that point into a removed session (`session_latest`, ...), and the directory itself once nothing else
   is left in it (but the `ray_current_cluster` file `ray start --temp-dir` writes there).
3. RUNS_DIR itself: every job's output, the generated shards and dataset copies, the MLflow store, the local
   cluster's state, and the lmms-eval tasks that `python -m pipeline.lmms.tasks` writes there by default with the
   Arrow copy lmms-eval's `datasets` makes of them (`lmms-tasks/`, `lmms-tasks/hf-datasets/`).
4. The builds of rcr's fused CPU kernels (rcr/fused.py: `rcr_ops_<hash>` directories) in torch's extension cache:
   $TORCH_EXTENSIONS_DIR, else `torch_extensions/<python>_<accelerator>/` in $XDG_CACHE_HOME or ~/.cache; then
   those directories themselves where nothing else is left in them. A later job builds the kernels again (about a
   minute).

Other sessions in the temp dir (another runs directory's, another user's cluster), Ray's shared /tmp/ray and other
extensions in torch's cache are never touched. One line is printed per thing removed, with its size, then the total.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path

SESSIONS_FILE = "ray-sessions"  # pipeline/run/ray_local.py writes it too
KERNEL_PREFIX = "rcr_ops_"  # rcr/fused.py names its builds rcr_ops_<hash of the sources and flags>


def say(msg: str) -> None:
    print(f"[local-cluster] {msg}", flush=True)


def size_of(path: Path) -> int:
    """Bytes on disk under ``path`` (``du``'s count: allocated blocks), links not followed: what removing it frees."""
    total = path.lstat().st_blocks * 512
    if path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                with contextlib.suppress(OSError):  # gone meanwhile
                    total += (Path(root) / name).lstat().st_blocks * 512
    return total


def human(n: int) -> str:
    """``0 B``, ``812 kB``, ``392 MB``, ``1.2 GB`` (powers of 1000)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            v = n / scale
            return f"{v:.1f} {unit}" if v < 10 else f"{v:.0f} {unit}"
    return f"{n} B"


class Removed:
    """Removes a path, with one line naming it and its size, and keeps the total."""

    def __init__(self):
        self.bytes = 0
        self.count = 0

    def __call__(self, path: Path, what: str, empty: bool = False) -> None:
        """``empty``: a directory that must be empty (removed only if it still is)."""
        n = size_of(path)
        if empty:
            path.rmdir()
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        self.bytes += n
        self.count += 1
        say(f"removed {what} {path} ({human(n)})")


def recorded_sessions(runs: Path) -> list[Path]:
    """The session directories listed for ``runs`` that still exist (a plain `session_*` directory each)."""
    f = runs / SESSIONS_FILE
    lines = f.read_text().split() if f.is_file() else []
    out = []
    for line in dict.fromkeys(lines):  # in order, once each
        p = Path(line)
        if p.is_absolute() and p.name.startswith("session_") and p.is_dir() and not p.is_symlink():
            out.append(p)
    return out


def users_of(paths: list[Path]) -> dict[Path, list[int]]:
    """Running processes whose command line names one of ``paths`` (Ray's GCS, raylet and workers name their
    session directory)."""
    marks = {p: str(p).encode() for p in paths}
    found: dict[Path, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        for p, m in marks.items():
            if m in cmd:
                found.setdefault(p, []).append(int(proc.name))
    return found


def tidy_temp_dir(root: Path, removed: list[Path], remove: Removed) -> None:
    """Links Ray keeps in the temp dir that point into a removed session (``session_latest``,
    ``prom_metrics_service_discovery.json``), then the directory itself when nothing but Ray's
    ``ray_current_cluster`` file is left in it."""
    for link in root.iterdir():
        if link.is_symlink():
            target = Path(os.readlink(link))
            if any(target == s or s in target.parents for s in removed):
                link.unlink()
    if root.is_dir() and all(c.name == "ray_current_cluster" for c in root.iterdir()):
        remove(root, "the project's Ray temp dir, nothing else left in it:")


def kernel_builds() -> list[Path]:
    """rcr's fused-kernel build directories in torch's extension cache, where ``torch.utils.cpp_extension`` puts
    them (``_get_build_directory``): ``$TORCH_EXTENSIONS_DIR/<name>``, else
    ``<cache>/torch_extensions/<python>_<accelerator>/<name>``."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return sorted(p for p in Path(root).glob(f"{KERNEL_PREFIX}*") if p.is_dir() and not p.is_symlink())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"
    return sorted(p for p in cache.glob(f"*/{KERNEL_PREFIX}*") if p.is_dir() and not p.is_symlink())


def remove_kernel_builds(remove: Removed) -> None:
    builds = kernel_builds()
    for p in builds:
        remove(p, "the fused kernels' build")
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return  # a directory the user named: kept
    for d in dict.fromkeys(p.parent for p in builds):  # <python>_<accelerator>, then torch_extensions
        for empty in (d, d.parent):
            if empty.is_dir() and not any(empty.iterdir()):
                remove(empty, "torch's extension cache directory, nothing else left in it:", empty=True)


def refuse_runs_dir(runs: Path) -> str | None:
    """Why ``runs`` must not be removed whole (a root, the home directory, a directory holding this checkout)."""
    repo = Path(__file__).resolve().parents[1]
    if runs == Path(runs.anchor) or runs == Path.home().resolve() or repo.is_relative_to(runs):
        return f"{runs} is not a runs directory of its own (RCR_RUNS_DIR): not removing it"
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):  # --help too: never a runs directory to remove
        print(__doc__, file=sys.stderr)
        return 0 if argv in (["-h"], ["--help"]) else 2
    runs = Path(argv[0]).expanduser().resolve()
    why = refuse_runs_dir(runs)
    if why:
        print(f"[local-cluster] error: {why}", file=sys.stderr)
        return 1
    sessions = recorded_sessions(runs)
    busy = users_of(sessions)
    if busy:
        for p, pids in busy.items():
            print(f"[local-cluster] error: Ray session {p} is in use by pid(s) {', '.join(map(str, pids[:5]))} "
                  "(a job of this runs directory still runs): stop it first; nothing was removed", file=sys.stderr)
        return 1
    remove = Removed()
    for p in sessions:
        remove(p, "Ray session")
    for root in dict.fromkeys(p.parent for p in sessions):
        tidy_temp_dir(root, sessions, remove)
    if runs.exists():
        remove(runs, "the runs directory (job outputs, shards, MLflow store, lmms-eval tasks)")
    remove_kernel_builds(remove)
    say(f"removed {remove.count} item(s), {human(remove.bytes)} in all" if remove.count else
        f"nothing to remove: no runs directory at {runs}, no Ray session or kernel build of the project")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
