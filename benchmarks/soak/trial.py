"""One soak trial: a fresh output dir and MLflow store, the job through a real entry point, one fault at a drawn
moment of its life, then the same command again until it exits 0 (at most 3 times), and the invariants.

Entry points (``mode``): ``plain``, ``python jobs/detailcaps.py`` with its own private Ray, in its own session as a
terminal runs it (a Ctrl-C is SIGINT to its process group); ``submit``, ``infra/submit.py`` to the local cluster (the
quickstart's ``ray job submit``); ``2nodes``, ``python jobs/detailcaps.py --ray-address`` on a head and a worker node.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.soak import checks, procs
from benchmarks.soak.env import PY, REPO, MlflowServer, Tmpfs, wait_http

FAULTS = ("kill_driver", "kill_actor", "kill_raylet", "kill_mlflow", "sigint_driver", "disk_full", "ray_stop")
RERUNS = 3
HANG_S = 3600  # a command still running after this is a hang: a failure of its own


@dataclass
class Draw:
    """What a seed decides: the fault (the faults in turn, so that every fault gets its share of the trials), the
    entry point, the MLflow store's kind and the moment (a fraction of the job's life), at random."""

    seed: int
    fault: str
    mode: str
    server: bool
    fraction: float

    @classmethod
    def of(cls, seed: int) -> Draw:
        rng = random.Random(seed)
        fault = FAULTS[seed % len(FAULTS)]
        mode = "2nodes" if fault == "kill_raylet" else rng.choice(["plain", "submit"])
        server = mode == "submit" or fault == "kill_mlflow"  # a plain job writes the database itself
        return cls(seed, fault, mode, server, rng.random())


@dataclass
class Result:
    draw: Draw
    moment_s: float = 0.0
    phase: str = "-"
    landed: bool = False
    reruns: int = 0
    exits: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    resumed_parts: int = 0

    @property
    def ok(self) -> bool:
        return not self.failures


class Command:
    """One run of the trial's command, its output in a log file, in a session of its own."""

    def __init__(self, argv: list[str], env: dict, log: Path):
        self.log = log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.t0 = time.monotonic()
        self.sigkilled = False

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout_s: float = HANG_S) -> int | None:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            procs.kill_all([self.proc.pid, *procs.descendants(self.proc.pid)])
            self.proc.wait()
            return None


def parts_on_disk(out: Path) -> int:
    return len(list(out.glob("part-*.parquet")))


def milestone(text: str, parts: int, n_parts: int) -> int:
    """How far a job from an empty output dir got, from its log and its part files: 0 started, 1 inputs scanned and
    model checked, 2 planned, 3 Ray up (actors loading), 4 .. 3 + n_parts that many parts written, then all rows
    written, the summary printed (MLflow logging under way), the runs logged."""
    if "[mlflow] logged job" in text or "job already logged" in text:
        return n_parts + 6
    if "summary of this job" in text:
        return n_parts + 5
    if "part file(s) in" in text:
        return n_parts + 4
    if "[rcr-job] ray: " in text:
        return 3 + min(parts, n_parts)
    return 2 if "shard file(s)" in text else int("[rcr-job] job " in text)


def milestone_name(k: int, n_parts: int, n_rows: int) -> str:
    names = ["start-up", "model checked", "planned", "actors loading"]
    if k < len(names):
        return names[k]
    if k <= 3 + n_parts:
        return f"rows {(k - 3) * n_rows // n_parts}/{n_rows}"
    return ["all rows written", "MLflow logging", "after MLflow logging"][min(k - n_parts - 4, 2)]


class Timeline:
    """When a fault-free run reached each milestone (seconds from its start), and its whole life."""

    def __init__(self, times: list[float], life: float):
        self.times, self.life = times, life

    @classmethod
    def record(cls, cmd: Command, out: Path, n_parts: int) -> Timeline:
        times = [0.0]
        while cmd.proc.poll() is None:
            k = milestone(cmd.text(), parts_on_disk(out), n_parts)
            times += [cmd.elapsed()] * (k + 1 - len(times))
            time.sleep(0.1)
        k = milestone(cmd.text(), parts_on_disk(out), n_parts)
        times += [cmd.elapsed()] * (k + 1 - len(times))
        return cls(times, cmd.elapsed())

    def describe(self, n_parts: int, n_rows: int) -> str:
        return ", ".join(f"{milestone_name(k, n_parts, n_rows)} {t:.0f}s" for k, t in enumerate(self.times)
                         if k) + f", exit {self.life:.0f}s"

    def moment(self, fraction: float, window: tuple[int, int] | None = None) -> tuple[int, float]:
        """The drawn moment, ``1 + fraction * (life - 1)`` seconds into the fault-free run, as (the last milestone
        reached by then, the seconds after it): a trial waits for that milestone, then for those seconds scaled by
        how fast it got there (at the latest until the next milestone), so the fault lands at the same point of the
        job whatever the machine's load. ``window`` (two milestones) narrows the life to the span where the fault's
        target exists: an actor lives from the actors' loading to the last row."""
        lo, hi = 1.0, self.life
        if window is not None:
            lo, hi = self.times[window[0]], self.times[min(window[1], len(self.times) - 1)]
        t = lo + fraction * max(hi - lo, 0.0)
        k = max(i for i, ti in enumerate(self.times) if ti <= t)
        return k, t - self.times[k]


class Trial:
    def __init__(self, soak, draw: Draw):
        self.soak, self.draw = soak, draw
        self.dir = soak.work / f"trial-{draw.seed}"
        shutil.rmtree(self.dir, ignore_errors=True)  # a fresh output dir and store
        self.dir.mkdir(parents=True)
        self.rng = random.Random(draw.seed * 7919 + 1)
        self.tmpfs = Tmpfs(self.dir / "outfs") if draw.fault == "disk_full" else None
        self.out = (self.dir / "outfs" / "out") if self.tmpfs else self.dir / "out"
        self.store = self.dir / "store"
        self.server: MlflowServer | None = None

    # ------------------------------------------------------------------ the command

    def uri(self) -> str:
        return self.server.uri if self.server else f"sqlite:///{self.store / 'mlflow.db'}"

    def command(self) -> tuple[list[str], dict]:
        args = [*self.soak.job_args, "--output-dir", str(self.out), "--mlflow-uri", self.uri()]
        if self.draw.mode == "submit":
            c = self.soak.local_cluster()
            rt = json.dumps({"env_vars": {"RCR_RUNS_DIR": str(self.soak.runs)}})
            return [PY, "infra/submit.py", "--address", c.env()["RAY_ADDRESS"], "--runtime-env-json", rt, "--",
                    "python", "jobs/detailcaps.py",
                    *args], c.env()
        if self.draw.mode == "2nodes":
            c = self.soak.two_nodes()
            return [PY, "jobs/detailcaps.py", "--ray-address", c.cluster.address, *args], c.env()
        return [PY, "jobs/detailcaps.py", *args], self.soak.plain_env()

    def run_once(self, n: int) -> Command:
        argv, env = self.command()
        return self.soak.start(argv, env, self.dir / f"run{n}.log")

    # ------------------------------------------------------------------ the fault

    def roots(self, cmd: Command) -> list[int]:
        if self.draw.mode == "submit":
            return self.soak.local_cluster().pids()[:1]
        if self.draw.mode == "2nodes":
            return [self.soak.two_nodes().cluster.proc.pid, cmd.proc.pid]
        return [cmd.proc.pid]

    def driver(self, cmd: Command) -> int | None:
        if self.draw.mode != "submit":
            return cmd.proc.pid
        found = [p for p in procs.find(self.roots(cmd), "jobs/detailcaps.py", str(self.out))
                 if procs.cmdline(p).split()[0].endswith(("python", "python3"))]
        return found[0] if found else None

    def target(self, cmd: Command) -> list[int] | None:
        """The processes the fault hits now, or None when they do not exist (yet, or any more)."""
        f = self.draw.fault
        if f in ("kill_driver", "sigint_driver"):
            d = self.driver(cmd)
            return [d] if d else None
        if f == "kill_actor":
            actors = procs.find(self.roots(cmd), "ray::MapWorker(MapBatches(SampleEvaluator))")
            return [self.rng.choice(sorted(actors))] if actors else None
        if f == "ray_stop" and self.draw.mode == "plain":  # the private Ray of the driver: GCS, raylet, workers
            ray = [p for p in procs.descendants(cmd.proc.pid)
                   if str(self.soak.plain_ray_tmp) in procs.cmdline(p) or procs.cmdline(p).startswith("ray::")]
            return ray or None
        return []

    def inject(self, cmd: Command, pids: list[int]) -> None:
        f = self.draw.fault
        if f == "kill_driver":
            os.kill(pids[0], signal.SIGKILL)
            cmd.sigkilled = self.draw.mode != "submit"
        elif f == "sigint_driver":  # a terminal's Ctrl-C: the whole foreground process group
            if self.draw.mode == "submit":
                os.kill(pids[0], signal.SIGINT)
            else:
                os.killpg(cmd.proc.pid, signal.SIGINT)
        elif f == "kill_actor":
            os.kill(pids[0], signal.SIGKILL)
        elif f == "kill_raylet":
            os.kill(self.soak.two_nodes().worker_raylet(), signal.SIGKILL)
        elif f == "kill_mlflow":
            self.server.kill()
            threading.Timer(5.0, self.server.start).start()
        elif f == "disk_full":
            self.tmpfs.fill()
        elif f == "ray_stop":
            procs.ray_stop(pids if self.draw.mode == "plain" else self.soak.local_cluster().pids())

    def fault_run(self, res: Result) -> Command:
        """Run the command; inject the fault at the drawn moment (``Timeline.moment``), or as soon after it as its
        target exists."""
        timeline = self.soak.timeline(self.draw.mode)  # first: it may run the fault-free submitted reference
        n_parts, n_rows = self.soak.n_parts, self.soak.n_rows
        window = (3, n_parts + 4) if self.draw.fault == "kill_actor" else None  # actors loading .. all rows written
        k, after = timeline.moment(self.draw.fraction, window)
        if k <= 2 and self.rng.random() < 0.5:
            self.resume_from_half(res)  # the moment falls in the start-up: let that include a real resume scan
        cmd = self.run_once(0)
        due = None  # when the milestone is reached: now + the seconds after it, scaled by this run's pace
        while cmd.proc.poll() is None:
            reached = milestone(cmd.text(), parts_on_disk(self.out) - res.resumed_parts, n_parts)
            if due is None and reached >= k:
                pace = cmd.elapsed() / timeline.times[k] if timeline.times[k] > 0 else 1.0
                due = cmd.elapsed() + after * pace
            # due, or the next milestone already reached: the moment lies between the two in the fault-free run
            if due is not None and (cmd.elapsed() >= due or reached > k) and (pids := self.target(cmd)) is not None:
                res.moment_s = cmd.elapsed()
                res.phase = milestone_name(milestone(cmd.text(), parts_on_disk(self.out) - res.resumed_parts,
                                                     n_parts), n_parts, n_rows)
                self.inject(cmd, pids)
                res.landed = True
                break
            time.sleep(0.1)
        if not res.landed:
            res.phase = f"the job ended before {milestone_name(k, n_parts, n_rows)} + {after:.1f}s"
        return cmd

    def resume_from_half(self, res: Result) -> None:
        """Start the first run from an output dir holding the first half of the reference's parts (whole, the same
        config), as a stopped job's rerun does: its start-up then scans and verifies them (the resume scan), and it
        computes only the other half. The rows and the store must still equal the reference's."""
        self.out.mkdir(parents=True, exist_ok=True)
        parts = sorted(self.soak.reference.out.glob("part-*.parquet"))[: self.soak.n_parts // 2]
        for p in parts:
            shutil.copy2(p, self.out / p.name)
        res.resumed_parts = len(parts)

    # ------------------------------------------------------------------ the trial

    def run(self) -> Result:
        t0 = time.monotonic()
        res = Result(self.draw)
        try:
            self._run(res)
        finally:
            self._tidy(res)
        res.wall_s = time.monotonic() - t0
        return res

    def _run(self, res: Result) -> None:
        self.store.mkdir(parents=True, exist_ok=True)
        if self.draw.server:
            self.server = MlflowServer(self.store, self.soak.free_port(), self.dir / "mlflow.log").start()
        if self.tmpfs:
            self.tmpfs.mount()
        cmd = self.fault_run(res)
        while True:
            rc = cmd.wait()
            if rc is None:
                res.failures.append(f"run {res.reruns} hung (still running after {HANG_S}s)")
            res.exits.append(-1 if rc is None else rc)
            res.failures += checks.check_exit(res.exits[-1], cmd.text(), cmd.sigkilled)
            self.soak.kill_plain_leftovers()
            if rc == 0:
                break
            if res.reruns == RERUNS:
                res.failures.append(f"no exit 0 after {RERUNS} reruns (exits {res.exits})")
                return
            self._recover()
            res.reruns += 1
            cmd = self.run_once(res.reruns)
        if self.server:
            self.server.kill()  # a stopped store: what the checks read is what is on disk
        res.failures += checks.check_rows(self.out, self.soak.reference.rows)
        res.failures += checks.check_files(self.out)
        res.failures += checks.check_store(self.store, self.soak.reference.store, self.soak.methods)

    def _recover(self) -> None:
        """What the operator does before running the same command again: space freed, the cluster started again,
        the MLflow server back (it restarts itself 5 s after its kill)."""
        if self.tmpfs:
            self.tmpfs.free()
        if self.draw.mode == "submit" and not self.soak.local_cluster().alive():
            self.soak.restart_local_cluster()
        if self.server and (self.server.proc is None or self.server.proc.poll() is not None):
            time.sleep(6)  # the restart timer's 5 s
        if self.server:
            wait_http(f"{self.server.uri}/health", self.server.proc)

    def _tidy(self, res: Result) -> None:
        if self.server:
            self.server.kill()
        if self.draw.fault == "kill_raylet":
            self.soak.drop_two_nodes()  # its worker node is gone
        if self.draw.mode == "submit" and not self.soak.local_cluster().alive():
            self.soak.restart_local_cluster()
        if self.tmpfs:
            if not res.ok:
                self.tmpfs.copy_out(self.dir / "out-kept")
            self.tmpfs.umount()
