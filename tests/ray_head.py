"""A local Ray head on 127.0.0.1 for the job tests, with private ports and temp dir, stopped by its own pid;
and the port pickers every test that starts a service uses."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.pipeline_helpers import PY, REPO

RAY = str(Path(PY).parent / "ray")

# The tests' own code for a submitted job (its engines, e.g. tests.pipeline_helpers:GatedFakeEngine): the working
# directory is packaged with the project's packages only (.rayignore), so the tests package travels as a py_module.
TESTS_RUNTIME_ENV = {"py_modules": [str(REPO / "tests")], "excludes": ["__pycache__"]}


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports the OS hands out as free now (from its ephemeral range).

    All sockets stay bound until every port is picked, so the same port is never returned twice."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def worker_port_block(size: int, rng: random.Random) -> int:
    """First port of ``size`` consecutive free ports *below* the OS ephemeral range.

    Ray refuses to start when its worker-port range contains a port given to another component, and the
    other components' ports come from the ephemeral range (``free_ports``), so a block below it can never
    collide with them."""
    try:
        eph_lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        eph_lo = 32768
    for _ in range(50):
        lo = rng.randrange(10000, max(10001, eph_lo - size))
        if all(_bindable(p) for p in range(lo, lo + size)):
            return lo
    raise RuntimeError(f"no {size} consecutive free ports below {eph_lo}")


def kill_leftovers(own_pids, temp_dir: Path) -> None:
    """SIGKILL what a stopped Ray head or cluster left (``own_pids()``: the processes it started; its workers
    outlive their raylet for a moment), then remove its private temp dir."""
    import shutil

    for _ in range(20):
        left = own_pids()
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
    shutil.rmtree(temp_dir, ignore_errors=True)


class _PortClash(RuntimeError):
    """``ray start`` exited at once and its log mentions a port."""


class LocalRayHead:
    """`ray start --head --block` on 127.0.0.1 with private ports and temp dir; stopped by its own pid.

    ``ray stop`` would stop every Ray process on the machine (other people's too), so this never calls it:
    the blocking ``ray start`` process is in its own process group, and stopping it (SIGTERM, then SIGKILL
    to the group) takes down the head it started. Leftovers are found by the private temp dir in their
    command line and killed by pid.
    """

    def __init__(self, tmp: Path, num_cpus: int = 2):
        self.tmp = Path(tmp)
        # the session dir path must stay short (unix socket paths are limited to 107 bytes)
        self.temp_dir = Path("/tmp") / f"rcrt{os.getpid()}_{free_port()}"
        self.num_cpus = num_cpus
        self.proc: subprocess.Popen | None = None
        self.gcs_port, self.dashboard_port = free_ports(2)  # re-picked by start() on a port clash
        self.log = self.tmp / "ray-head.log"
        import secrets

        self.token = secrets.token_hex(32)

    def env(self) -> dict:
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        env["RAY_ADDRESS"] = self.address
        env["PATH"] = f"{Path(PY).parent}:{env.get('PATH', '')}"
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        env["RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES"] = ""  # .rayignore leaves them out
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # single-node mode: every socket on 127.0.0.1 (docs/cluster.md)
        # Ray 2.60 token auth, with a private token: independent of ~/.ray/auth_token (which any local
        # ray.init() creates, and which would otherwise switch a plain `ray start` into token mode)
        env["RAY_AUTH_MODE"] = "token"
        env["RAY_AUTH_TOKEN"] = self.token
        env.pop("RAY_AUTH_TOKEN_PATH", None)
        return env

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def start(self, timeout: float = 180, attempts: int = 3) -> LocalRayHead:
        """Start the head; a port taken between picking and binding (another process on the machine)
        makes ``ray start`` exit at once, and is retried with fresh ports."""
        rng = random.Random()
        for attempt in range(attempts):
            if attempt:
                self.gcs_port, self.dashboard_port = free_ports(2)
            try:
                return self._start_once(timeout, rng)
            except _PortClash:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float, rng: random.Random) -> LocalRayHead:
        ports = free_ports(7)
        lo = worker_port_block(401, rng)
        cmd = [RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
               "--port", str(self.gcs_port), "--dashboard-host", "127.0.0.1",
               "--dashboard-port", str(self.dashboard_port), "--include-dashboard", "true",
               "--num-cpus", str(self.num_cpus), "--num-gpus", "0", "--temp-dir", str(self.temp_dir),
               "--ray-client-server-port", str(ports[0]), "--node-manager-port", str(ports[1]),
               "--object-manager-port", str(ports[2]), "--dashboard-agent-listen-port", str(ports[3]),
               "--dashboard-agent-grpc-port", str(ports[4]), "--metrics-export-port", str(ports[5]),
               "--runtime-env-agent-port", str(ports[6]),
               "--min-worker-port", str(lo), "--max-worker-port", str(lo + 400),
               "--object-store-memory", str(400 * 2**20), "--disable-usage-stats"]
        env = self.env()
        env.pop("RAY_ADDRESS")
        with open(self.log, "w") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, cwd=str(self.tmp))
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                text = self.log.read_text()
                kind = _PortClash if re.search(r"port|address already in use", text, re.I) else RuntimeError
                raise kind(f"ray start exited {self.proc.returncode}:\n{text[-3000:]}")
            if self._dashboard_answers() and self.ray_cli("job", "list", "--address", self.address,
                                                          timeout=60).returncode == 0:
                return self
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"the Ray head did not come up in {timeout}s:\n{self.log.read_text()[-3000:]}")

    def _dashboard_answers(self) -> bool:
        """Any HTTP answer (401 included: Ray 2.60 enables token auth) means the dashboard is up."""
        import urllib.error
        import urllib.request

        try:
            urllib.request.urlopen(f"{self.address}/api/version", timeout=2).close()
            return True
        except urllib.error.HTTPError:
            return True
        except Exception:  # noqa: BLE001
            return False

    def submit(self, args: list[str], cwd: Path = REPO, timeout: float = 600, wait: bool = True,
               runtime_env: dict | None = None) -> subprocess.CompletedProcess | subprocess.Popen:
        # as infra/quickstart.sh submits (infra/submit.py), with the tests' code (plus ``runtime_env``)
        cmd = [PY, str(REPO / "infra" / "submit.py"), "--address", self.address,
               "--runtime-env-json", json.dumps({**TESTS_RUNTIME_ENV, **(runtime_env or {})}),
               "--", "python", *args]
        if wait:
            return subprocess.run(cmd, check=False, cwd=cwd, env=self.env(), capture_output=True, text=True,
                                  timeout=timeout)
        return subprocess.Popen(cmd, cwd=cwd, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    def job_status(self, submission_id: str) -> str:
        r = self.ray_cli("job", "status", "--address", self.address, submission_id, timeout=60)
        text = (r.stdout + r.stderr).lower()  # e.g. "Job 'x' succeeded", "Job 'x' was stopped"
        for state in ("succeeded", "failed", "stopped", "running", "pending"):
            if re.search(rf"job '{re.escape(submission_id.lower())}'[^\n]*{state}", text):
                return state.upper()
        return "UNKNOWN"

    def wait_job(self, submission_id: str, timeout: float = 600) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.job_status(submission_id)
            if state in ("SUCCEEDED", "FAILED", "STOPPED"):
                return state
            time.sleep(2)
        raise TimeoutError(f"job {submission_id} still not finished after {timeout}s")

    def job_logs(self, submission_id: str) -> str:
        return self.ray_cli("job", "logs", "--address", self.address, submission_id, timeout=60).stdout

    def actor_pids(self, class_fragment: str) -> list[int]:
        r = self.ray_cli("list", "actors", "--address", self.address, "--format", "json", "--detail",
                         "--filter", "state=ALIVE", timeout=60)
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-2000:])
        return [a["pid"] for a in json.loads(r.stdout) if class_fragment in (a.get("class_name") or "")]

    def ray_cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([RAY, *args], check=False, env=self.env(), capture_output=True, text=True,
                              timeout=timeout)

    def own_pids(self) -> list[int]:
        """Processes whose command line names this head's private temp dir or GCS port (its raylet, workers...)."""
        marks = (str(self.temp_dir), f"127.0.0.1:{self.gcs_port}", f"--gcs-address=127.0.0.1:{self.gcs_port}")
        pids = []
        for p in Path("/proc").iterdir():
            if not p.name.isdigit() or int(p.name) == os.getpid():
                continue
            try:
                cmdline = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if any(m in cmdline for m in marks):
                pids.append(int(p.name))
        return pids

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=8)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        kill_leftovers(self.own_pids, self.temp_dir)
