"""Where a job's actors run: the resource plan, made per node, and the watch for nodes that leave.

Ray places every actor and every task on one node, so a plan that adds up the cluster's CPUs can ask for
what no node has: on 3 nodes of 1 CPU, 3 actors of 2/3 CPU each leave 1/3 CPU per node, and a read task
that asks for more waits forever. The plan is therefore checked against each alive node's shape (its CPU
and GPU totals, ``ray.nodes()``)::

    nodes = alive_nodes(ray)
    plan = plan_actors(cfg, nodes)   # ConfigError (one line: the request and the node shapes) if it cannot fit
    with watch_nodes(ray, nodes, plan, cfg.num_actors, say, gcs_address, written=lambda: n_rows):
        ...                          # one line per node that leaves while the job runs, one if the head does

* GPU actors ask for ``--gpus-per-actor`` (default 1 where a node has a GPU) and ``--cpus-per-actor``
  (default 1) each.
* CPU actors (no GPU on any node) ask for ``--cpus-per-actor`` or, by default, the largest request up to
  1 CPU with which every actor fits beside a read task (``READER_CPUS``) on each node, counted on the
  cluster less its largest node: when one node is lost, Ray restarts its actors on the others, where they
  fit. With one node, or nodes too small for that, the whole cluster is counted instead.
* Ray Data starts the actor pool with its default scheduling strategy, SPREAD, which places each new actor
  on the next node in turn. With as many actors as nodes, that is one actor per node (the requests above
  leave room for more, so that a lost node's actors find a place).
* ``num_gpus=0``: Ray hides every GPU from such a worker (``CUDA_VISIBLE_DEVICES=""``), so the device is
  chosen inside the actor from what it can see, never here.
"""

from __future__ import annotations

import contextlib
import math
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pipeline.run.config import ConfigError, JobConfig

READER_CPUS = 0.25  # read/select tasks are light; small CPU requests keep them schedulable beside the actors
MIN_ACTOR_CPUS = 0.1  # the smallest default CPU request of a CPU actor
NODE_POLL_S = 2.0  # how often the driver looks for nodes that left
_EPS = 1e-6  # Ray keeps resources to 4 decimals


@dataclass(frozen=True)
class Node:
    """An alive Ray node's shape: what its raylet offers in total."""

    node_id: str
    address: str
    cpus: float
    gpus: float


@dataclass(frozen=True)
class ActorPlan:
    """What each actor asks Ray for, and whether the actors still fit when any one node is lost."""

    num_gpus: float
    num_cpus: float
    torch_threads: int
    survives_node_loss: bool


def alive_nodes(ray) -> list[Node]:
    """The cluster's alive nodes (``ray.nodes()``), in Ray's order."""
    return [Node(n["NodeID"], n.get("NodeManagerAddress", ""), float(n["Resources"].get("CPU", 0.0)),
                 float(n["Resources"].get("GPU", 0.0))) for n in ray.nodes() if n.get("Alive")]


def describe(nodes: list[Node]) -> str:
    """``3 node(s): 3 x {CPU: 1, GPU: 0}``: the shapes, largest first."""
    shapes = Counter((n.cpus, n.gpus) for n in nodes)
    parts = [f"{k} x {{CPU: {c:g}, GPU: {g:g}}}" for (c, g), k in sorted(shapes.items(), reverse=True)]
    return f"{len(nodes)} node(s): {' + '.join(parts) or 'none'}"


def capacity(node: Node, cpus: float, gpus: float, reserve: float = 0.0) -> int:
    """How many actors of ``cpus`` CPUs and ``gpus`` GPUs fit on ``node`` with ``reserve`` CPUs left over."""
    free = node.cpus - reserve + _EPS
    if free < 0:
        return 0
    n = math.floor(free / cpus) if cpus > 0 else math.inf
    if gpus > 0:
        n = min(n, math.floor((node.gpus + _EPS) / gpus))
    return int(min(n, 1 << 30))


def fits(nodes: list[Node], n_actors: int, cpus: float, gpus: float) -> bool:
    """``n_actors`` actors fit on ``nodes``, with room left for a read task on at least one node."""
    full = [capacity(x, cpus, gpus) for x in nodes]
    total = sum(full)
    return any(total - full[j] + capacity(x, cpus, gpus, READER_CPUS) >= n_actors for j, x in enumerate(nodes))


def survives_node_loss(nodes: list[Node], n_actors: int, cpus: float, gpus: float) -> bool:
    return len(nodes) > 1 and all(fits(nodes[:j] + nodes[j + 1:], n_actors, cpus, gpus) for j in range(len(nodes)))


def even_cpus(nodes: list[Node], n_actors: int) -> float | None:
    """The largest CPU request up to 1 with which ``n_actors`` fit on ``nodes``, each node keeping
    ``READER_CPUS`` free; None if not even ``MIN_ACTOR_CPUS`` does."""
    room = [n.cpus - READER_CPUS for n in nodes if n.cpus - READER_CPUS > _EPS]

    def ok(x: float) -> bool:
        return sum(math.floor(r / x + _EPS) for r in room) >= n_actors

    # the answer is one of r/k (a node's room split k ways); feasibility grows as x shrinks: bisect
    cands = sorted({min(1.0, r / k) for r in room for k in range(1, n_actors + 1)})
    cands = [x for x in cands if x >= MIN_ACTOR_CPUS]
    lo, hi = 0, len(cands)  # the first feasible from the top: cands[lo - 1]
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(cands[mid]):
            lo = mid + 1
        else:
            hi = mid
    return math.floor(cands[lo - 1] * 1000) / 1000 if lo else None


def plan_actors(cfg: JobConfig, nodes: list[Node]) -> ActorPlan:
    """The per-actor request for ``cfg.num_actors`` actors on ``nodes``; a ConfigError naming the field to
    change, in one line with the request and the node shapes, when no placement exists."""
    max_gpus = max((n.gpus for n in nodes), default=0.0)
    n_gpu = cfg.gpus_per_actor if cfg.gpus_per_actor is not None else (1.0 if max_gpus >= 1 else 0.0)
    if cfg.cpus_per_actor is not None:
        n_cpu = cfg.cpus_per_actor
    elif n_gpu > 0:
        n_cpu = 1.0
    else:
        biggest = max(range(len(nodes)), key=lambda i: nodes[i].cpus, default=0)
        rest = nodes[:biggest] + nodes[biggest + 1:]
        n_cpu = (even_cpus(rest, cfg.num_actors) if rest else None) or even_cpus(nodes, cfg.num_actors) \
            or MIN_ACTOR_CPUS
    if not fits(nodes, cfg.num_actors, n_cpu, n_gpu):
        raise ConfigError(_field(cfg, nodes, n_cpu, n_gpu), unschedulable(cfg.num_actors, n_cpu, n_gpu, nodes))
    if cfg.torch_threads:
        threads = cfg.torch_threads
    elif n_gpu > 0:
        threads = 4
    else:
        # One thread per CPU actor. Decoding a small model is a long chain of tiny ops, and with 2+ OpenMP
        # threads each op ends in a barrier: measured on 2 shared cores, a 2-sample batch of every method
        # took 1-2 s with 1 thread and ~140 s with 2 (other processes held the cores; the barrier waits on
        # a descheduled thread). Big models on big CPU nodes: pass --torch-threads.
        threads = 1
    return ActorPlan(float(n_gpu), float(round(n_cpu, 3)), int(threads),
                     survives_node_loss(nodes, cfg.num_actors, n_cpu, n_gpu))


def _field(cfg: JobConfig, nodes: list[Node], cpus: float, gpus: float) -> str:
    """The flag to change: the actor count if one actor fits, else the request that no node can hold."""
    if fits(nodes, 1, cpus, gpus):
        return "num_actors"
    if gpus > 0 and not any(capacity(n, 0.0, gpus) for n in nodes):
        return "gpus_per_actor"
    return "cpus_per_actor" if cfg.cpus_per_actor is not None else "num_actors"


def unschedulable(n_actors: int, cpus: float, gpus: float, nodes: list[Node]) -> str:
    return (f"the job cannot be placed: {n_actors} actor(s) x {{CPU: {cpus:g}, GPU: {gpus:g}}} and a read task "
            f"{{CPU: {READER_CPUS:g}}} do not fit on the cluster's {describe(nodes)}; Ray places each actor on one "
            "node: lower --num-actors, --cpus-per-actor or --gpus-per-actor, or add larger nodes")


def loss_line(lost: Node, rest: list[Node], plan: ActorPlan, n_actors: int) -> str:
    """The driver's one line about a node that left the cluster."""
    head = f"node {lost.node_id[:12]} ({lost.address}) left the cluster; "
    if fits(rest, n_actors, plan.num_cpus, plan.num_gpus):
        return head + (f"its actors restart on the remaining {describe(rest)} and its unfinished batches are "
                       "retried there (rows already written are kept; none is written twice)")
    return head + (f"the remaining {describe(rest)} cannot hold {n_actors} actor(s) x {{CPU: {plan.num_cpus:g}, "
                   f"GPU: {plan.num_gpus:g}}}: the job waits for a node to join, or stop it and rerun the same "
                   "command later: it computes only the missing rows")


def head_lost_line(gcs_address: str, n_written: int) -> str:
    return (f"the Ray head (GCS {gcs_address}) is unreachable: the cluster is lost, and Ray ends this driver unless "
            "the head is back within its GCS reconnect timeout (RAY_gcs_rpc_server_reconnect_timeout_s, 60 s by "
            f"default). The {n_written} row(s) written so far are in whole part files; rerun the same command on a "
            "new cluster: it computes only the missing rows")


def reachable(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts a TCP connection at ``host:port`` (the GCS)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def watch_nodes(ray, nodes: list[Node], plan: ActorPlan, n_actors: int, say: Callable[[str], None],
                gcs_address: str | None, written: Callable[[], int]) -> Iterator[None]:
    """While the body runs: one ``say`` line per node of ``nodes`` (or that joined since) that is no longer
    alive, and one when the head (``gcs_address``) stops answering, each polled every ``NODE_POLL_S``. The head
    has its own thread and a plain TCP connect: a ``ray.nodes()`` call in flight when the GCS goes away waits
    for it until Ray ends the driver (its GCS reconnect timeout), so a check behind that call would never run."""
    stop = threading.Event()
    known = {n.node_id: n for n in nodes}

    def watch_head():
        head_lost = False
        while not stop.wait(NODE_POLL_S):
            up = reachable(gcs_address)
            if up == head_lost:
                say(f"the Ray head (GCS {gcs_address}) answers again" if up else
                    head_lost_line(gcs_address, written()))
                head_lost = not up

    def watch_members():
        while not stop.wait(NODE_POLL_S):
            try:
                alive = alive_nodes(ray)
            except Exception:  # noqa: BLE001 - the GCS went away: the head's thread says so
                continue
            ids = {n.node_id for n in alive}
            for node_id in [k for k in known if k not in ids]:
                say(loss_line(known.pop(node_id), alive, plan, n_actors))
            known.update({n.node_id: n for n in alive})

    targets = [watch_members] + ([watch_head] if gcs_address is not None else [])
    threads = [threading.Thread(target=f, name=f"rcr-{f.__name__}", daemon=True) for f in targets]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=NODE_POLL_S + 5)  # a ray.nodes() call stuck on a lost GCS must not hold the exit
