"""The job on a cluster of several Ray nodes: three raylets of 1 CPU each on 127.0.0.1 (tests/ray_cluster.py,
``ray.cluster_utils.Cluster`` in a helper process), the driver joining with ``--ray-address``.

1. Spread: 3 actors land one per node, and every row names the node that computed it (``node_id``).
2. A job that no node can hold (2 CPUs per actor on 1-CPU nodes) fails at once, in one line.
3. A worker node SIGKILLed mid-job (raylet, agents and workers): the job finishes on the other two with
   exactly N x M rows and reports the loss in one line.
4. The head node SIGKILLed mid-job, then the whole cluster: the driver says so and ends non-zero, every part
   on disk is whole, and the same command on a new cluster computes only the missing rows.

The engine is the fake one, held at a gate file (``GatedFakeEngine``: each actor lets K batches through, then
waits for ``<gate>``), so each fault lands at a known point; the tests wait on files and log lines, never on
time. The driver writes every part itself (``PartWriter`` in the driver process), so the node that holds the
output writer is the driver's: here the head (a driver joins the head's raylet), case 4.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from tests.pipeline_helpers import PY, REPO, fake_model_dir, synthetic_records, write_shard
from tests.ray_cluster import LocalRayCluster

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

METHODS = ["full", "rcr"]
GATED = "tests.pipeline_helpers:GatedFakeEngine"


class Job:
    """``python jobs/detailcaps.py --ray-address <cluster>`` in a subprocess; its output read line by line."""

    def __init__(self, cluster: LocalRayCluster, tmp: Path, *extra: str, env: dict | None = None):
        self.out = tmp / "out"
        cmd = [PY, "jobs/detailcaps.py", "--ray-address", cluster.address, "--model", str(fake_model_dir(tmp)),
               "--shards", str(tmp / "shards"), "--methods", ",".join(METHODS), "--output-dir", str(self.out),
               "--mlflow-uri", f"sqlite:///{tmp / 'mlflow.db'}", "--engine", GATED, "--batch-size", "1",
               "--num-actors", "3", "--no-summary", "--progress-every-s", "1000", *extra]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env={**cluster.env(), **(env or {})}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()
        with self.cond:
            self.lines.append("")  # EOF
            self.cond.notify_all()

    def log(self) -> str:
        return "".join(self.lines)

    def wait_line(self, text: str) -> str:
        """The first output line containing ``text``; fail (with the log) if the job's output ends first."""
        with self.cond:
            while True:
                hit = [ln for ln in self.lines if text in ln]
                if hit:
                    return hit[0]
                assert not self.lines or self.lines[-1] != "", f"the job ended before {text!r}:\n{self.log()[-5000:]}"
                self.cond.wait()

    def wait_until(self, cond) -> None:
        """Until ``cond()`` (files on disk) holds; fail (with the log) if the job exits first."""
        while not cond():
            assert self.proc.poll() is None, f"the job exited ({self.proc.returncode}):\n{self.log()[-5000:]}"
            time.sleep(0.2)

    def finish(self, timeout: float = 300) -> int:
        rc = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=60)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _shards(tmp: Path, n: int) -> list[str]:
    recs = synthetic_records("detailcaps", n)
    write_shard(tmp / "shards" / "s0.parquet", recs)
    return [r["sample_id"] for r in recs]


def _parts(out: Path) -> list[Path]:
    return sorted(out.glob("part-*.parquet"))


def _waiting(gate: Path) -> list[int]:
    """Pids of the actors held at the gate (``GatedFakeEngine`` touches ``<gate>.waiting.<pid>``)."""
    return [int(p.name.rsplit(".", 1)[1]) for p in gate.parent.glob(f"{gate.name}.waiting.*")]


def _exact(out: Path, ids: list[str]) -> pd.DataFrame:
    df = pd.read_parquet(out)
    keys = list(zip(df["sample_id"], df["method"]))
    assert len(keys) == len(set(keys)), "duplicated (sample_id, method) rows"
    assert set(keys) == {(s, m) for s in ids for m in METHODS}, "rows lost"
    return df


def _node_table(df: pd.DataFrame, cluster: LocalRayCluster) -> dict[str, int]:
    """node index (h = head) and id -> rows; printed for the record."""
    names = {n["node_id"]: f"node {n['index']}{' (head)' if n['index'] == 0 else ''} {n['node_id'][:12]}"
             for n in cluster.nodes}
    table = {names.get(k, k): int(v) for k, v in df.groupby("node_id").size().items()}
    print("rows per node:", table)
    return table


@pytest.fixture(scope="module")
def cluster3(tmp_path_factory):
    """3 nodes x 1 CPU whose actors wait at ``<tmp>/gate`` from their first batch on (spread test)."""
    tmp = tmp_path_factory.mktemp("cluster3")
    c = LocalRayCluster(tmp, cpus=[1, 1, 1], env={"RCR_TEST_GATE": str(tmp / "gate"), "RCR_TEST_GATE_AFTER": "0"})
    c.start()
    try:
        yield c
    finally:
        c.stop()


def test_three_actors_spread_one_per_node_and_rows_name_their_node(cluster3, tmp_path):
    ids = _shards(tmp_path, 6)
    gate = Path(cluster3.extra_env["RCR_TEST_GATE"])
    job = Job(cluster3, tmp_path)
    try:
        plan = job.wait_line("[rcr-job] ray: ")
        assert "3 node(s): 3 x {CPU: 1, GPU: 0}; 3 actor(s) x (num_gpus=0, num_cpus=0.375" in plan, plan
        job.wait_until(lambda: len(_waiting(gate)) == 3)  # each actor holds its first batch
        actor_nodes = sorted(cluster3.node_of(pid) for pid in _waiting(gate))
        assert actor_nodes == [0, 1, 2], f"actors per node: {actor_nodes}"
        socks = cluster3.listening()  # the GCS, the raylets, the agents, the workers: all on loopback
        assert len({pid for _, _, pid in socks}) >= 6, socks
        assert all(addr in ("127.0.0.1", "::ffff:127.0.0.1") for addr, _, _ in socks), socks
        gate.touch()
        assert job.finish() == 0, job.log()[-5000:]
    finally:
        job.kill()
    df = _exact(job.out, ids)
    table = _node_table(df, cluster3)
    assert set(df["node_id"]) == {n["node_id"] for n in cluster3.nodes}, table
    assert sum(table.values()) == len(ids) * len(METHODS)


def test_a_job_no_node_can_hold_fails_at_once_in_one_line(cluster3, tmp_path):
    _shards(tmp_path, 3)
    r = subprocess.run([PY, "jobs/detailcaps.py", "--ray-address", cluster3.address, "--model",
                        str(fake_model_dir(tmp_path)), "--shards", str(tmp_path / "shards"), "--output-dir",
                        str(tmp_path / "out"), "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}", "--engine", GATED,
                        "--methods", ",".join(METHODS), "--num-actors", "3", "--cpus-per-actor", "2", "--no-summary"],
                       cwd=REPO, env=cluster3.env(), capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if "cannot be placed" in ln]
    assert len(lines) == 1, r.stderr
    print(lines[0])
    assert "field 'cpus_per_actor'" in lines[0] and "3 actor(s) x {CPU: 2, GPU: 0}" in lines[0]
    assert "3 node(s): 3 x {CPU: 1, GPU: 0}" in lines[0]
    assert "progress:" not in r.stdout and not _parts(tmp_path / "out")  # the model stage never started
    record = json.loads(next((tmp_path / "out" / "_runs").glob("*.json")).read_text())
    assert record["status"] == "failed" and "cannot be placed" in record["error"]


def test_worker_node_killed_mid_job_finishes_on_the_others(tmp_path):
    """Each actor lets one batch through and holds its second at the gate; node 2 (a worker) is SIGKILLed
    with its actor holding a batch. Its actor restarts on node 0 or 1 and redoes that batch."""
    ids = _shards(tmp_path, 9)
    gate = tmp_path / "gate"
    cluster = LocalRayCluster(tmp_path, cpus=[1, 1, 1],
                              env={"RCR_TEST_GATE": str(gate), "RCR_TEST_GATE_AFTER": "1"}).start()
    job = None
    try:
        job = Job(cluster, tmp_path)
        job.wait_until(lambda: len(_waiting(gate)) == 3 and len(_parts(job.out)) >= 3)
        held = {cluster.node_of(pid): pid for pid in _waiting(gate)}
        assert sorted(held) == [0, 1, 2], held
        before = {p.name for p in _parts(job.out)}
        killed = cluster.kill_node(2)
        print("node 2 killed:", killed)
        assert held[2] in killed["workers"]  # the actor holding a batch died with its node
        lost = cluster.nodes[2]["node_id"]
        line = job.wait_line("left the cluster")
        print(line.strip())
        assert f"node {lost[:12]} (127.0.0.1) left the cluster; its actors restart on the remaining 2 node(s)" in line
        gate.touch()
        assert job.finish() == 0, job.log()[-5000:]
    finally:
        if job is not None:
            job.kill()
        cluster.stop()
    assert sum("left the cluster" in ln for ln in job.lines) == 1
    df = _exact(job.out, ids)
    _node_table(df, cluster)
    after = pd.concat([pd.read_parquet(p) for p in _parts(job.out) if p.name not in before])
    print(f"rows: {len(df) - len(after)} written before the kill, {len(after)} after, {len(df)} in all")
    assert lost not in set(after["node_id"])  # computed on the remaining nodes


def test_head_node_killed_then_a_new_cluster_resumes(tmp_path):
    """The head (GCS, its raylet and workers) is SIGKILLed while every actor holds a batch at a gate that
    never opens; then the other two nodes. The driver says the head is lost and Ray ends it (its GCS
    reconnect timeout, shortened here). On a new cluster, the same command computes only the missing rows."""
    ids = _shards(tmp_path, 9)
    gate = tmp_path / "gate"
    cluster = LocalRayCluster(tmp_path, cpus=[1, 1, 1],
                              env={"RCR_TEST_GATE": str(gate), "RCR_TEST_GATE_AFTER": "1"}).start()
    job = None
    try:
        job = Job(cluster, tmp_path, env={"RAY_gcs_rpc_server_reconnect_timeout_s": "20"})
        job.wait_until(lambda: len(_waiting(gate)) == 3 and len(_parts(job.out)) >= 3)
        cluster.kill_node(0)
        line = job.wait_line("is unreachable")
        print(line.strip())
        assert f"the Ray head (GCS {cluster.address}) is unreachable: the cluster is lost" in line
        assert job.finish() != 0, job.log()[-5000:]
    finally:
        if job is not None:
            job.kill()
        cluster.stop()  # the rest of the cluster: nothing of it is left
    assert sum("is unreachable" in ln for ln in job.lines) == 1
    first = {p.name: pd.read_parquet(p) for p in _parts(job.out)}  # every part reads back whole
    done = pd.concat(first.values())
    assert len(done) == len(set(zip(done["sample_id"], done["method"]))) >= 3 * len(METHODS)
    assert f"The {len(done)} row(s) written so far are in whole part files" in line

    fresh = LocalRayCluster(tmp_path / "second", cpus=[1, 1, 1]).start()
    again = None
    try:
        again = Job(fresh, tmp_path)
        assert again.finish() == 0, again.log()[-5000:]
    finally:
        if again is not None:
            again.kill()
        fresh.stop()
    total = len(ids) * len(METHODS)
    assert f"{len(done)} already in the output dir, {total - len(done)} to compute" in again.log()
    df = _exact(job.out, ids)
    new = pd.concat([pd.read_parquet(p) for p in _parts(job.out) if p.name not in first])
    assert set(zip(new["sample_id"], new["method"])) == set(zip(df["sample_id"], df["method"])) - set(
        zip(done["sample_id"], done["method"]))
    print(f"rows: {len(done)} written before the head was lost, {len(new)} by the new cluster, {len(df)} in all")
