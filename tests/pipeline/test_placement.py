"""The resource plan per node (pipeline/run/placement.py) and the driver's watch for lost nodes and a lost head,
without Ray: node shapes are given, and the watch reads a stand-in for ``ray.nodes()``."""

from __future__ import annotations

import socket
import threading

import pytest

from pipeline.run import placement
from pipeline.run.config import ConfigError, JobConfig
from pipeline.run.placement import READER_CPUS, Node, plan_actors


def _cfg(**kw) -> JobConfig:
    return JobConfig.from_dict({"model": "embedded", **kw})


def _nodes(*shapes: tuple[float, float]) -> list[Node]:
    return [Node(f"n{i}", "127.0.0.1", c, g) for i, (c, g) in enumerate(shapes)]


def _placed(nodes: list[Node], n: int, cpus: float, gpus: float) -> bool:
    """Whether n actors of this request, laid out one per node in turn as Ray's SPREAD does, each leave a read
    task room on their node."""
    counts = [0] * len(nodes)
    for i in range(n):
        counts[i % len(nodes)] += 1
    return all(k * cpus + READER_CPUS <= x.cpus + 1e-9 and k * gpus <= x.gpus for k, x in zip(counts, nodes))


def test_three_one_cpu_nodes_hold_three_actors_and_survive_losing_one():
    nodes = _nodes((1, 0), (1, 0), (1, 0))
    plan = plan_actors(_cfg(num_actors=3), nodes)
    assert plan.num_gpus == 0 and plan.torch_threads == 1 and plan.survives_node_loss
    assert _placed(nodes, 3, plan.num_cpus, 0)  # one per node, with a read task beside each
    assert _placed(nodes[:2], 3, plan.num_cpus, 0)  # and still after a node is lost
    # the largest such request: a bigger one no longer fits 3 actors on 2 nodes
    assert not _placed(nodes[:2], 3, plan.num_cpus + 0.01, 0)


def test_one_node_gets_the_largest_request_that_fits():
    nodes = _nodes((3, 0))
    plan = plan_actors(_cfg(num_actors=3), nodes)
    assert not plan.survives_node_loss
    assert _placed(nodes, 3, plan.num_cpus, 0) and not _placed(nodes, 3, plan.num_cpus + 0.01, 0)


def test_gpu_workers_one_actor_per_gpu_beside_a_cpu_head():
    nodes = _nodes((8, 0), (8, 1), (8, 1), (8, 1), (8, 1))
    plan = plan_actors(_cfg(num_actors=4), nodes)
    assert (plan.num_gpus, plan.num_cpus, plan.torch_threads) == (1.0, 1.0, 4)
    assert not plan.survives_node_loss  # a lost GPU worker's actor waits for a new node


@pytest.mark.parametrize("flags, shapes, field, want", [
    ({"num_actors": 3, "cpus_per_actor": 2}, [(1, 0)] * 3, "cpus_per_actor",
     "3 actor(s) x {CPU: 2, GPU: 0} and a read task {CPU: 0.25} do not fit on the cluster's 3 node(s): "
     "3 x {CPU: 1, GPU: 0}"),
    ({"num_actors": 5}, [(8, 0), (8, 1), (8, 1)], "num_actors", "5 actor(s) x {CPU: 1, GPU: 1}"),
    ({"num_actors": 1, "gpus_per_actor": 2}, [(8, 1), (8, 1)], "gpus_per_actor",
     "1 actor(s) x {CPU: 1, GPU: 2} and a read task {CPU: 0.25} do not fit on the cluster's 2 node(s): "
     "2 x {CPU: 8, GPU: 1}"),
    ({"num_actors": 40}, [(1, 0)] * 2, "num_actors", "40 actor(s) x {CPU: 0.1, GPU: 0}"),
])
def test_a_plan_no_node_can_hold_names_the_field_the_request_and_the_shapes(flags, shapes, field, want):
    with pytest.raises(ConfigError) as e:
        plan_actors(_cfg(**flags), _nodes(*shapes))
    assert e.value.field == field and want in str(e.value) and "\n" not in str(e.value)


def test_actors_that_fill_a_node_leave_the_read_task_to_another():
    # 2 actors of 1 CPU on two 1-CPU nodes leave no room for a read task; a third node gives it one
    with pytest.raises(ConfigError):
        plan_actors(_cfg(num_actors=2, cpus_per_actor=1), _nodes((1, 0), (1, 0)))
    plan_actors(_cfg(num_actors=2, cpus_per_actor=1), _nodes((1, 0), (1, 0), (0.5, 0)))


class _FakeRay:
    """``ray.nodes()`` from a list the test changes; counts the calls, so a test can wait for more polls."""

    def __init__(self, nodes: list[Node]):
        self.nodes_now = list(nodes)
        self.calls = 0
        self.cond = threading.Condition()

    def nodes(self):
        with self.cond:
            self.calls += 1
            self.cond.notify_all()
            return [{"NodeID": n.node_id, "NodeManagerAddress": n.address, "Alive": True,
                     "Resources": {"CPU": n.cpus, "GPU": n.gpus}} for n in self.nodes_now]

    def wait_calls(self, k: int) -> None:
        with self.cond:
            target = self.calls + k
            while self.calls < target:
                self.cond.wait(timeout=30)


@pytest.fixture
def fast_poll(monkeypatch):
    monkeypatch.setattr(placement, "NODE_POLL_S", 0.01)


def test_the_watch_reports_each_lost_node_once(fast_poll):
    nodes = _nodes((1, 0), (1, 0), (1, 0))
    plan = plan_actors(_cfg(num_actors=3), nodes)
    ray, lines = _FakeRay(nodes), []
    with placement.watch_nodes(ray, nodes, plan, 3, lines.append, None, lambda: 0):
        ray.wait_calls(2)
        assert lines == []
        ray.nodes_now = nodes[:2]
        ray.wait_calls(3)  # the poll that sees the loss, and two more
    assert lines == [placement.loss_line(nodes[2], nodes[:2], plan, 3)]
    assert lines[0].startswith("node n2 (127.0.0.1) left the cluster; its actors restart on the remaining "
                               "2 node(s): 2 x {CPU: 1, GPU: 0}")


def test_a_loss_the_remaining_nodes_cannot_absorb_says_the_job_waits():
    nodes = _nodes((8, 0), (8, 1), (8, 1))
    plan = plan_actors(_cfg(num_actors=2), nodes)
    line = placement.loss_line(nodes[2], nodes[:2], plan, 2)
    assert "the remaining 2 node(s): 1 x {CPU: 8, GPU: 1} + 1 x {CPU: 8, GPU: 0} cannot hold 2 actor(s)" in line
    assert "the job waits for a node to join" in line and "computes only the missing rows" in line


def test_reachable_is_a_tcp_connect():
    gcs = socket.socket()
    gcs.bind(("127.0.0.1", 0))
    gcs.listen()
    address = f"127.0.0.1:{gcs.getsockname()[1]}"
    assert placement.reachable(address)
    gcs.close()
    assert not placement.reachable(address)


def test_the_watch_says_once_that_the_head_is_gone(fast_poll, monkeypatch):
    nodes = _nodes((1, 0))
    plan = plan_actors(_cfg(num_actors=1), nodes)
    up, probes = [True], [0]
    cond = threading.Condition()

    def reachable(address):
        with cond:
            probes[0] += 1
            cond.notify_all()
            return up[0]

    def wait_probes(k):
        with cond:
            target = probes[0] + k
            while probes[0] < target:
                cond.wait(timeout=30)

    monkeypatch.setattr(placement, "reachable", reachable)
    ray, lines = _FakeRay(nodes), []
    with placement.watch_nodes(ray, nodes, plan, 1, lines.append, "127.0.0.1:6379", lambda: 6):
        ray.wait_calls(1)  # the head answered: the nodes were read
        up[0] = False
        wait_probes(4)  # the probe that finds it gone, and three more
    assert lines == [placement.head_lost_line("127.0.0.1:6379", 6)]
    assert "the Ray head (GCS 127.0.0.1:6379) is unreachable" in lines[0] and "The 6 row(s) written so far" in lines[0]


def test_the_head_is_reported_while_a_nodes_call_hangs_on_it(fast_poll, monkeypatch):
    """A ray.nodes() call in flight when the GCS dies waits for it until Ray ends the driver: the head's check
    must not sit behind that call."""
    nodes = _nodes((1, 0))
    plan = plan_actors(_cfg(num_actors=1), nodes)
    release, in_call = threading.Event(), threading.Event()

    class _HangingRay:
        def nodes(self):
            in_call.set()
            release.wait(timeout=60)
            return [{"NodeID": n.node_id, "NodeManagerAddress": n.address, "Alive": True,
                     "Resources": {"CPU": n.cpus}} for n in nodes]

    lost = threading.Event()
    monkeypatch.setattr(placement, "reachable", lambda address: not in_call.is_set())
    lines = []

    def say(line):
        lines.append(line)
        lost.set()

    with placement.watch_nodes(_HangingRay(), nodes, plan, 1, say, "127.0.0.1:6379", lambda: 2):
        assert lost.wait(timeout=60), "the head's loss was not reported while ray.nodes() hung"
        release.set()
    assert lines == [placement.head_lost_line("127.0.0.1:6379", 2)]
