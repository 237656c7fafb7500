"""Several Ray nodes on 127.0.0.1, for the multi-node tests and benchmark.

``ray.cluster_utils.Cluster`` (what Ray's own tests use) starts a head and worker nodes, each a raylet with
its own resources, all in one process tree. It runs here in a helper process of its own (``python -m
tests.ray_cluster SPEC``), started in a new session, so that the single-node address mode
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: every node's address is 127.0.0.1 and every socket binds there) and
a private temp dir and token are set before Ray is imported, whatever the test process imported already.
The test talks to it over stdin/stdout, one JSON line per command::

    cluster = LocalRayCluster(tmp_path, cpus=[1, 1, 1]).start()   # node 0 is the head
    job = subprocess.Popen([... "--ray-address", cluster.address], env=cluster.env())
    cluster.kill_node(2)         # its raylet, agents and workers, SIGKILLed; returns their pids, all gone
    cluster.stop()               # the helper shuts the nodes down; leftovers are killed by pid

Nothing here calls ``ray stop`` (it would stop every Ray on the machine): every process is the helper's
child, found by the cluster's private temp dir, and stopped by its pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.pipeline_helpers import PY, REPO
from tests.ray_head import free_port, kill_leftovers

# Node death is noticed by the GCS's health checks: every 1 s, dead after 3 misses (Ray's defaults: 3 s x 5)
HEALTH_CHECK = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000,
                "health_check_failure_threshold": 3}


class LocalRayCluster:
    """A head and worker nodes on 127.0.0.1 with ``cpus[i]`` CPUs each (node 0 is the head), in a helper
    process; see the module docstring."""

    def __init__(self, tmp: Path, cpus: list[float], object_store_mb: int = 100, env: dict | None = None):
        self.tmp = Path(tmp)
        self.cpus = list(cpus)
        self.extra_env = dict(env or {})  # e.g. a test gate: the raylets hand their environment to the workers
        self.object_store_mb = object_store_mb
        # short: Ray's unix socket paths are limited to 107 bytes
        self.temp_dir = Path("/tmp") / f"rcrc{os.getpid()}_{free_port()}"
        self.token = secrets.token_hex(32)
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.nodes: list[dict] = []  # per node: index, node_id, raylet_pid, cpus
        self.log = self.tmp / "ray-cluster.log"

    def env(self) -> dict:
        """The environment for a process that joins the cluster (a job's driver): the same token, the
        single-node address mode and the private temp dir (where Ray writes the cluster's address file)."""
        env = dict(os.environ, PYTHONPATH=str(REPO), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token,
                   RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_TMPDIR=str(self.temp_dir),
                   RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1", **self.extra_env)
        for k in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH"):
            env.pop(k, None)
        return env

    def start(self, timeout: float = 180) -> LocalRayCluster:
        spec = {"cpus": self.cpus, "object_store_mb": self.object_store_mb}
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        # the head's two Prometheus endpoints have fixed default ports: private ones, as for every other port
        env = dict(self.env(), DASHBOARD_METRIC_PORT=str(free_port()), AUTOSCALER_METRIC_PORT=str(free_port()))
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([PY, "-m", "tests.ray_cluster", json.dumps(spec)], cwd=REPO, env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                         start_new_session=True)
        try:
            info = self._reply(timeout)
        except BaseException:
            self.stop()
            raise
        self.address, self.nodes = info["address"], info["nodes"]
        return self

    def _reply(self, timeout: float) -> dict:
        """The helper's next JSON line; fail with its log if it exits instead."""
        line = self.proc.stdout.readline()  # the helper answers every command, or exits
        if not line:
            self.proc.wait(timeout=timeout)
            raise RuntimeError(f"the cluster helper exited ({self.proc.returncode}):\n{self.log.read_text()[-4000:]}")
        return json.loads(line)

    def _command(self, cmd: str, timeout: float = 120) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._reply(timeout)

    def kill_node(self, index: int) -> dict:
        """SIGKILL node ``index``: its raylet and agents (``Cluster.remove_node(allow_graceful=False)``) and the
        workers the raylet started (by pid, those that outlived it). Returns ``{"raylet_pid", "workers",
        "workers_left_by_remove_node"}``; every pid in it is gone when this returns."""
        out = self._command(f"kill {index}")
        if "error" in out:
            raise RuntimeError(out["error"])
        return out

    def node_of(self, pid: int) -> int | None:
        """The index of the node whose raylet started ``pid`` (an actor's worker), from the parent chain."""
        raylets = {n["raylet_pid"]: n["index"] for n in self.nodes}
        while pid > 1:
            if pid in raylets:
                return raylets[pid]
            try:
                pid = _ppid(pid)
            except (OSError, ValueError, IndexError):
                return None
        return None

    def own_pids(self) -> list[int]:
        """Processes that name this cluster's private temp dir (raylets, agents, workers, the GCS)."""
        mark = str(self.temp_dir).encode()
        pids = []
        for p in Path("/proc").iterdir():
            if not p.name.isdigit() or int(p.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if mark in (p / "cmdline").read_bytes():
                    pids.append(int(p.name))
        return pids

    def listening(self) -> list[tuple[str, int, int]]:
        """(address, port, pid) of every TCP socket that a process of this cluster listens on (``ss -ltnpH``)."""
        pids = set(self.own_pids()) | ({self.proc.pid} if self.proc else set())
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True, timeout=30).stdout
        socks = []
        for line in out.splitlines():
            addr, _, port = line.split()[3].rpartition(":")
            socks += [(addr.strip("[]"), int(port), int(p)) for p in re.findall(r"pid=(\d+)", line) if int(p) in pids]
        return socks

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.write("stop\n")
                self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the helper's own session: only what it started
                self.proc.wait(timeout=10)
        kill_leftovers(self.own_pids, self.temp_dir)


# ---------------------------------------------------------------------- the helper process


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                children.setdefault(_ppid(int(p.name)), []).append(int(p.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _serve(spec: dict) -> None:
    import ray
    from ray.cluster_utils import Cluster

    # every node's temp dir is $RAY_TMPDIR/ray (Ray's default), where Cluster also writes the address file
    common = {"node_ip_address": "127.0.0.1", "num_gpus": 0, "object_store_memory": spec["object_store_mb"] * 2**20}
    cluster = Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args={
        **common, "num_cpus": spec["cpus"][0], "include_dashboard": False, "dashboard_port": free_port(),
        "dashboard_agent_listen_port": free_port(), "ray_client_server_port": free_port(),
        "_system_config": HEALTH_CHECK})
    nodes = [cluster.head_node] + [cluster.add_node(**common, num_cpus=c) for c in spec["cpus"][1:]]
    cluster.wait_for_nodes()

    def raylet_pid(node) -> int:
        return node.all_processes["raylet"][0].process.pid  # ray_constants.PROCESS_TYPE_RAYLET

    def say(obj: dict) -> None:
        print(json.dumps(obj), flush=True)

    say({"address": cluster.address, "nodes": [
        {"index": i, "node_id": n.node_id, "raylet_pid": raylet_pid(n), "cpus": spec["cpus"][i]}
        for i, n in enumerate(nodes)]})
    for line in sys.stdin:  # until "stop" or the test process goes away (EOF)
        cmd = line.split()
        if cmd[:1] == ["stop"]:
            break
        if cmd[:1] == ["kill"]:
            node = nodes[int(cmd[1])]
            rpid = raylet_pid(node)
            workers = _descendants(rpid)
            cluster.remove_node(node, allow_graceful=False)
            left = [p for p in workers if _alive(p)]
            for p in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            while any(_alive(p) for p in [rpid, *workers]):
                time.sleep(0.05)
            say({"raylet_pid": rpid, "workers": workers, "workers_left_by_remove_node": left})
            continue
        say({"error": f"unknown command {line.strip()!r}"})
    for node in list(cluster.worker_nodes):
        cluster.remove_node(node, allow_graceful=False)
    if cluster.head_node is not None:
        cluster.remove_node(cluster.head_node, allow_graceful=False)
    ray.shutdown()


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
