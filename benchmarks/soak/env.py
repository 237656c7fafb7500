"""What the soak's jobs run on, all on 127.0.0.1 and private to the soak: the local cluster (``infra/local_cluster.sh``
with the soak's own runs directory and Ray temp dir), a 2-node cluster (``tests/ray_cluster.py``), an MLflow server
per store (``infra/mlflow_server.sh``), and a size-capped tmpfs for the disk-full fault. Each is stopped by the pids
it started, never by a process name."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.soak import procs

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
BIN = str(Path(PY).parent)
# Ray starts its workers (the actors) 15 steps nicer than the raylet; under the soak's own `nice -n 10` that is 19, and
# on a shared machine the actors then barely run. At 0 they run at the soak's niceness.
WORKER_NICENESS = {"RAY_worker_niceness": "0"}


def base_env(runs: Path, ray_tmp: Path) -> dict:
    """A job's environment: this checkout's code, the soak's runs directory (shards, Ray session list) and Ray temp
    dir; no cluster address (a plain job starts its own Ray)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), RCR_RUNS_DIR=str(runs), RCR_RAY_TMP=str(ray_tmp),
               PATH=f"{BIN}:{os.environ.get('PATH', '')}", RAY_USAGE_STATS_ENABLED="0", **WORKER_NICENESS)
    for k in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "MLFLOW_TRACKING_URI"):
        env.pop(k, None)
    return env


def wait_http(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 180) -> None:
    """Until ``url`` answers (any HTTP status); fail if ``proc`` exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=5).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited ({proc.returncode})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer in {timeout_s:.0f}s")
        time.sleep(0.5)


class LocalCluster:
    """``infra/local_cluster.sh start`` on the soak's runs directory (Ray only: each trial has its own MLflow
    server), for the submitted jobs; ``infra/submit.py`` submits to it as the quickstart does."""

    def __init__(self, runs: Path, ray_tmp: Path, log: Path):
        self.runs, self.ray_tmp, self.log = runs, ray_tmp, log
        self.state = runs / "local-cluster"

    def _script(self, verb: str) -> None:
        env = dict(base_env(self.runs, self.ray_tmp), RCR_NO_MLFLOW="1", RCR_NUM_CPUS="2", PYTHON=PY)
        with open(self.log, "a") as log:
            r = subprocess.run(["bash", str(REPO / "infra" / "local_cluster.sh"), verb], cwd=REPO, env=env,
                               stdout=log, stderr=subprocess.STDOUT, check=False, timeout=900)
        if r.returncode != 0:
            raise RuntimeError(f"infra/local_cluster.sh {verb} failed ({r.returncode}); see {self.log}")

    def start(self) -> LocalCluster:
        self._script("start")
        return self

    def stop(self) -> None:
        self._script("stop")

    def root(self) -> int | None:
        p = self.state / "ray.pid"
        return int(p.read_text()) if p.is_file() and p.read_text().strip() else None

    def alive(self) -> bool:
        return (r := self.root()) is not None and procs.alive(r)

    def pids(self) -> list[int]:
        """The head's `ray start` process and every process under it (GCS, raylet, workers, job drivers)."""
        r = self.root()
        return [r, *procs.descendants(r)] if r is not None and procs.alive(r) else []

    def env(self) -> dict:
        """For infra/submit.py: the job server's address and the cluster's token (the cluster's env file)."""
        env = base_env(self.runs, self.ray_tmp)
        for line in (self.state / "env").read_text().splitlines():
            k, _, v = line.removeprefix("export ").partition("=")
            env[k] = v
        env.pop("MLFLOW_TRACKING_URI", None)
        env["RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES"] = ""  # .rayignore leaves them out (quickstart.sh)
        return env


class TwoNodes:
    """A head and one worker node of 1 CPU each (``tests/ray_cluster.py``), for the raylet fault; the job joins it
    with ``--ray-address``. Replaced after each such trial: its worker node is gone."""

    def __init__(self, tmp: Path, runs: Path, ray_tmp: Path):
        from tests.ray_cluster import LocalRayCluster

        self.runs, self.ray_tmp = runs, ray_tmp
        self.cluster = LocalRayCluster(tmp, cpus=[1, 1])

    def start(self) -> TwoNodes:
        self.cluster.start()
        return self

    def stop(self) -> None:
        self.cluster.stop()

    def env(self) -> dict:
        return {**base_env(self.runs, self.ray_tmp), **{k: v for k, v in self.cluster.env().items()
                                                        if k.startswith("RAY_")}}

    def worker_raylet(self) -> int:
        return self.cluster.nodes[1]["raylet_pid"]

    def pids(self) -> list[int]:
        root = self.cluster.proc.pid
        return [root, *procs.descendants(root)]


class MlflowServer:
    """``infra/mlflow_server.sh STORE PORT`` (the local cluster's server) on one trial's store, in its own session:
    SIGKILLed as a group, restarted on the same store and port."""

    def __init__(self, store: Path, port: int, log: Path):
        self.store, self.port, self.log = store, port, log
        self.proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MlflowServer:
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(["bash", str(REPO / "infra" / "mlflow_server.sh"), str(self.store),
                                          str(self.port)], env=dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}"),
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_http(f"{self.uri}/health", self.proc)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            pids = [self.proc.pid, *procs.descendants(self.proc.pid)]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            procs.kill_all(pids)
            self.proc.wait()


class Tmpfs:
    """A size-capped tmpfs for one trial's output dir: :meth:`fill` makes it full (a filler file up to ENOSPC),
    :meth:`free` gives the space back."""

    def __init__(self, path: Path, size_mb: int = 64):
        self.path, self.size_mb = path, size_mb
        self.mounted = False

    @staticmethod
    def available(scratch: Path) -> str | None:
        """None if this machine lets the soak mount a tmpfs, else why not."""
        probe = scratch / "tmpfs-probe"
        probe.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)], capture_output=True,
                           text=True, check=False)
        if r.returncode != 0:
            return (r.stderr or r.stdout).strip() or f"mount exited {r.returncode}"
        subprocess.run(["umount", str(probe)], check=False)
        return None

    def mount(self) -> Tmpfs:
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m", "tmpfs", str(self.path)], check=True)
        self.mounted = True
        return self

    def fill(self) -> None:
        block = b"\0" * 2**20
        with contextlib.suppress(OSError), open(self.path / ".filler", "wb") as f:
            while True:
                f.write(block)
                f.flush()

    def free(self) -> None:
        (self.path / ".filler").unlink(missing_ok=True)

    def copy_out(self, dest: Path) -> None:
        """Keep the output dir of a failed trial (the mount goes away)."""
        shutil.copytree(self.path, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".filler"))

    def umount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False)
            self.mounted = False
