"""A randomized fault soak: one fault at a random moment of a job's life, then the same command until it exits 0,
and invariants checked after every trial by code that does not share the pipeline's readers.

    python -m benchmarks.fault_soak --trials 40          # seeds 0..39
    python -m benchmarks.fault_soak --seed 17            # one trial alone, as it ran in the soak

Each trial: a fresh output dir and MLflow store; the job (12 embedded samples x full,bacon,rcr, batch 2, 2 actors)
through a real entry point, ``python jobs/detailcaps.py`` (its own Ray) or ``infra/submit.py`` to a local cluster
(``infra/local_cluster.sh``, what the quickstart submits with); one fault at a moment drawn from the job's whole
life (from its first second to its MLflow logging after the last row), drawn from: SIGKILL of the driver, of one
actor, of a worker node's raylet (a 2-node cluster), of the MLflow server (restarted 5 s later), SIGINT of the driver
(a terminal's Ctrl-C), disk full on the output dir (a 64 MB tmpfs, where ``mount -t tmpfs`` works, else skipped),
and ``ray stop`` of the whole cluster (the soak's own), started again afterwards. Then the same command again until
it exits 0, at most 3 times, and the invariants (``benchmarks/soak/checks.py``): (a) N x M rows, each key once,
(b) equal to a fault-free reference run token for token, (c) no partial or temporary file, no run record left
running, (d) the MLflow store: no run RUNNING, the parent FINISHED with one child per method and the reference
store's metrics and artifacts, ``PRAGMA integrity_check`` ok, (e) every nonzero exit named what happened in one
line, no traceback. One line per trial, then a table by fault; exit status 1 if any trial failed.

Everything runs on 127.0.0.1 and is stopped by the pids the soak started. The local cluster, the 2-node cluster and
the fault-free reference are reused across trials while a trial's fault leaves them intact. Mounting a tmpfs needs
root; elsewhere the disk-full fault is skipped, and the soak says so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from benchmarks.soak import checks, procs
from benchmarks.soak.env import REPO, WORKER_NICENESS, LocalCluster, MlflowServer, Tmpfs, TwoNodes, base_env
from benchmarks.soak.trial import FAULTS, Command, Draw, Timeline, Trial

METHODS = ["full", "bacon", "rcr"]


@dataclass
class Reference:
    rows: dict
    store: dict
    timelines: dict  # mode -> Timeline of its fault-free run
    out: Path  # its output dir: a resumed trial starts from some of its parts


class Soak:
    def __init__(self, work: Path, samples: int, max_new_tokens: int):
        self.work = work
        self.runs = work / "runs"  # the embedded shards (generated once), the local cluster's state
        tag = f"{os.getpid()}"  # Ray's socket paths must stay short
        self.plain_ray_tmp, self.cluster_ray_tmp = Path(f"/tmp/rcrsoak{tag}p"), Path(f"/tmp/rcrsoak{tag}c")
        self.methods = METHODS
        self.n_rows = samples * len(METHODS)
        self.n_parts = -(-samples // 2)  # one part per batch of 2
        self.job_args = ["--limit", str(samples), "--methods", ",".join(METHODS), "--batch-size", "2",
                         "--num-actors", "2", "--max-new-tokens", str(max_new_tokens), "--progress-every-s", "5"]
        self._local: LocalCluster | None = None
        self._two: TwoNodes | None = None
        self.reference: Reference | None = None
        self.notes: list[str] = []
        self.commands: list[Command] = []  # every command started, so that close() stops one still running

    def start(self, argv: list[str], env: dict, log: Path) -> Command:
        self.commands.append(Command(argv, env, log))
        return self.commands[-1]

    # ------------------------------------------------------------------ what the trials share

    def plain_env(self) -> dict:
        return base_env(self.runs, self.plain_ray_tmp)

    def local_cluster(self) -> LocalCluster:
        if self._local is None:
            self._local = LocalCluster(self.runs, self.cluster_ray_tmp, self.work / "local-cluster.log").start()
        return self._local

    def restart_local_cluster(self) -> None:
        self._local.stop()
        self._local.start()

    def two_nodes(self) -> TwoNodes:
        if self._two is None:
            self._two = TwoNodes(self.work / "two-nodes", self.runs, self.plain_ray_tmp).start()
        return self._two

    def drop_two_nodes(self) -> None:
        if self._two is not None:
            self._two.stop()
            self._two = None

    @staticmethod
    def free_port() -> int:
        from tests.ray_head import free_port

        return free_port()

    def kill_plain_leftovers(self) -> None:
        """A plain job's private Ray that outlived its driver (a SIGKILLed driver's)."""
        procs.kill_all(procs.marked(str(self.plain_ray_tmp)))

    def timeline(self, mode: str) -> Timeline:
        if mode == "submit" and "submit" not in self.reference.timelines:
            self._reference_submitted()
        return self.reference.timelines.get(mode, self.reference.timelines["plain"])

    def close(self) -> None:
        for c in self.commands:
            if c.proc.poll() is None:
                procs.kill_all([c.proc.pid, *procs.descendants(c.proc.pid)])
        self.drop_two_nodes()
        if self._local is not None:
            self._local.stop()
        self.kill_plain_leftovers()
        for d in (self.plain_ray_tmp, self.cluster_ray_tmp):
            shutil.rmtree(d, ignore_errors=True)

    # ------------------------------------------------------------------ the fault-free reference

    def _fault_free(self, name: str, argv_env, server: bool, tries: int = 3) -> tuple[Path, Path, Timeline]:
        """A run without a fault, from a fresh output dir and store (again, up to ``tries``, when it fails on its
        own: on a busy machine Ray's start-up can time out)."""
        d = self.work / name
        for attempt in range(tries):
            shutil.rmtree(d, ignore_errors=True)  # a fresh run: its life is what the moments are drawn from
            out, store = d / "out", d / "store"
            store.mkdir(parents=True, exist_ok=True)
            srv = MlflowServer(store, self.free_port(), d / "mlflow.log") if server else None
            try:
                uri = srv.start().uri if srv else f"sqlite:///{store / 'mlflow.db'}"
                argv, env = argv_env([*self.job_args, "--output-dir", str(out), "--mlflow-uri", uri])
                cmd = self.start(argv, env, d / "run.log")
                timeline = Timeline.record(cmd, out, self.n_parts)
                rc = cmd.wait()
            finally:
                if srv:
                    srv.kill()
                self.kill_plain_leftovers()
            if rc == 0:
                return out, store, timeline
            last = [ln for ln in cmd.text().splitlines() if ln.strip()][-1:] or ["<no output>"]
            print(f"[soak] the fault-free {name} run exited {rc} ({last[0][:200]}); attempt {attempt + 1}/{tries}",
                  flush=True)
        raise SystemExit(f"the fault-free {name} run failed {tries} times; see {d / 'run.log'}")

    def make_reference(self) -> None:
        """The embedded shards first (generated once into the soak's runs dir, not part of any job's life), then a
        fault-free plain run: the rows and the store every trial is compared with, and the life moments are drawn
        from."""
        subprocess.run([sys.executable, "-c", "from pipeline.run.inputs import embedded_shards; "
                        "embedded_shards('detailcaps')"], cwd=REPO, env=self.plain_env(), check=True)
        py = sys.executable
        out, store, timeline = self._fault_free("reference", lambda a: ([py, "jobs/detailcaps.py", *a],
                                                                      self.plain_env()), server=False)
        _, rows = checks.rows(out)
        summary = checks.store_summary(store)
        if summary["bad"] or len(rows) != self.n_rows:
            raise SystemExit(f"the fault-free reference is not clean: {summary['bad']}, {len(rows)} rows")
        self.reference = Reference(rows, summary, {"plain": timeline}, out)
        print(f"[soak] reference: python jobs/detailcaps.py, {len(rows)} rows; "
              f"{timeline.describe(self.n_parts, self.n_rows)}", flush=True)

    def _reference_submitted(self) -> None:
        """A fault-free submitted run: the submitted trials' life, and a check that it gives the same rows and
        store as the plain reference."""
        c = self.local_cluster()
        import json

        rt = json.dumps({"env_vars": {"RCR_RUNS_DIR": str(self.runs)}})
        out, store, timeline = self._fault_free("reference-submit", lambda a: (
            [sys.executable, "infra/submit.py", "--address", c.env()["RAY_ADDRESS"], "--runtime-env-json", rt, "--",
             "python", "jobs/detailcaps.py", *a], c.env()),
            server=True)
        self.reference.timelines["submit"] = timeline
        bad = checks.check_rows(out, self.reference.rows) + checks.check_store(store, self.reference.store,
                                                                               self.methods)
        note = "same rows and store as the plain reference" if not bad else f"DIFFERS from the plain one: {bad}"
        self.notes.append(f"submitted reference: {note}")
        print(f"[soak] reference: infra/submit.py, {note}; {timeline.describe(self.n_parts, self.n_rows)}",
              flush=True)


def trial_line(r) -> str:
    d = r.draw
    where = f"at {r.moment_s:5.1f}s ({r.phase})" if r.landed else f"never landed ({r.phase})"
    where += f", resumed from {r.resumed_parts} parts" if r.resumed_parts else ""
    verdict = "ok" if r.ok else "FAIL " + "; ".join(r.failures)
    return (f"seed {d.seed:<4} {d.fault:<14} {d.mode:<7} {'server' if d.server else 'sqlite':<7} {where:<40} "
            f"reruns {r.reruns}  exits {r.exits}  {r.wall_s:5.0f}s  {verdict}")


def table(results: list) -> str:
    by: dict[str, list] = defaultdict(list)
    for r in results:
        by[r.draw.fault].append(r)
    lines = [f"{'fault':<14} {'trials':>6} {'passed':>6}  failing seeds", "-" * 48]
    for f in FAULTS:
        rs = by.get(f, [])
        if rs:
            failing = [str(r.draw.seed) for r in rs if not r.ok]
            lines.append(f"{f:<14} {len(rs):>6} {sum(r.ok for r in rs):>6}  {', '.join(failing) or '-'}")
    lines.append(f"{'all':<14} {len(results):>6} {sum(r.ok for r in results):>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=40, help="seeds --first-seed .. --first-seed + trials - 1")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--seed", type=int, action="append", help="run only this seed's trial (repeatable)")
    ap.add_argument("--faults", default=",".join(FAULTS), help="run only the seeds that draw these faults "
                    "(comma-separated); seed S draws fault S mod 7 in the order " + ", ".join(FAULTS))
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--work", help="working directory (default: a new one under the temp dir; removed at the end "
                    "unless a trial failed)")
    args = ap.parse_args(argv)
    faults = tuple(f for f in args.faults.split(",") if f)
    unknown = set(faults) - set(FAULTS)
    if unknown:
        ap.error(f"unknown fault(s) {sorted(unknown)}; known: {', '.join(FAULTS)}")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="rcr-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.update(WORKER_NICENESS)  # also for the 2-node cluster's helper, which takes this environment
    seeds = args.seed or list(range(args.first_seed, args.first_seed + args.trials))
    draws = [d for d in map(Draw.of, seeds) if d.fault in faults]  # a seed always draws the same trial
    if any(d.fault == "disk_full" for d in draws) and (why := Tmpfs.available(work)) is not None:
        draws = [d for d in draws if d.fault != "disk_full"]
        print(f"[soak] disk_full skipped: this machine does not let the soak mount a tmpfs ({why})", flush=True)
    print(f"[soak] {len(draws)} trial(s) of seeds {seeds[0]}..{seeds[-1]}, faults {', '.join(faults)}; job: "
          f"{args.samples} samples x {','.join(METHODS)}, batch 2, 2 actors, max_new_tokens {args.max_new_tokens}; "
          f"work dir {work}", flush=True)
    soak = Soak(work, args.samples, args.max_new_tokens)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: still stop what the soak started (finally)
    results = []
    t0 = time.monotonic()
    try:
        soak.make_reference()
        if any(d.mode == "submit" for d in draws):
            soak.timeline("submit")  # its fault-free reference, before any trial's clock starts
        for d in draws:
            r = Trial(soak, d).run()
            results.append(r)
            print(trial_line(r), flush=True)
            if r.ok:
                shutil.rmtree(work / f"trial-{d.seed}", ignore_errors=True)
    finally:
        soak.close()
    wall = time.monotonic() - t0
    print()
    print(table(results))
    per = sum(r.wall_s for r in results) / max(len(results), 1)
    print(f"wall time {wall:.0f}s in all, {per:.0f}s per trial on average (the reference and cluster start-ups "
          f"aside); load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for n in soak.notes:
        print(n)
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"failing trials kept in {work}; rerun one alone: python -m benchmarks.fault_soak --seed "
              f"{failed[0].draw.seed}")
        return 1
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
