"""Writing a run's results as they arrive: each result block one atomic part (``OutputStore.write_part``), each
planned key exactly once, and the job's one progress line."""

from __future__ import annotations

import contextlib
import threading
import time

import pyarrow as pa

from pipeline.quiet import say
from pipeline.run.store import OutputStore


def write_failed_line(e: OSError) -> str:
    """The job's one line when a part cannot be written (``PartWriteError``, e.g. the disk is full)."""
    return f"writing the output failed: {e}. Free space there, then rerun the same command: it computes only the " \
           "missing rows"


class Progress:
    """The job's one progress line: on every part written when ``every_s`` has passed, and from a heartbeat
    thread (:meth:`heartbeat`) every ``every_s`` while the model stage runs, so the cadence stays steady
    when rows arrive in bursts."""

    def __init__(self, total_pairs: int, total_samples: int, every_s: float, batch: str = "a batch"):
        self.total_pairs, self.total_samples, self.every_s = total_pairs, total_samples, every_s
        self.batch = batch  # what one batch holds, e.g. "2 sample(s) x 11 method(s)": rows arrive that many at a time
        self.pairs = 0
        self.samples: set[str] = set()
        self.errors = 0
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.t_row = self.t0  # when the last rows arrived
        self.pairs_shown = 0  # rows at the previous line
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def heartbeat(self):
        stop = threading.Event()

        def beat():
            while not stop.wait(self.every_s):
                self.report()

        t = threading.Thread(target=beat, name="rcr-progress", daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()

    def update(self, table: pa.Table, force: bool = False) -> None:
        with self.lock:
            self.pairs += table.num_rows
            self.t_row = time.perf_counter()
            self.samples.update(table.column("sample_id").to_pylist())
            self.errors += table.num_rows - table.column("error").null_count
        self.report(force=force or self.pairs >= self.total_pairs)

    def report(self, force: bool = False) -> None:
        with self.lock:
            now = time.perf_counter()
            if not force and now - self.last < self.every_s * 0.99:
                return
            self.last = now
            el = now - self.t0
            if self.pairs == 0:
                say(f"progress: 0/{self.total_pairs} rows, waiting for the first batch (each actor loads the "
                    f"model and calibrates what its methods need, then returns up to {self.batch} at once), "
                    f"{el:.0f}s elapsed")
                return
            rate = len(self.samples) / el if el > 0 else 0.0
            left = self.total_samples - len(self.samples)
            eta = f", ETA {left / rate:.0f}s" if rate > 0 and left > 0 else ""
            if left > 0 and self.pairs == self.pairs_shown:  # no rows since the last line: an ETA would only grow
                eta = f", waiting for the next batch ({now - self.t_row:.0f}s since the last rows)"
            self.pairs_shown = self.pairs
            say(f"progress: {self.pairs}/{self.total_pairs} rows, {len(self.samples)}/{self.total_samples} samples, "
                f"{self.errors} error rows, {rate:.2f} samples/s, {el:.0f}s elapsed{eta}")


class PartWriter:
    """Writes each result block of a run as one atomic part, each planned key exactly once.

    Rows whose key is already written or was never planned (a batch that Ray retried after its output had
    arrived) are dropped before the write."""

    def __init__(self, store: OutputStore, run_id: str, expected: set[tuple[str, str]], progress: Progress,
                 t0: float):
        self.store, self.run_id, self.expected, self.progress = store, run_id, expected, progress
        self.t0 = t0  # time.perf_counter() at the start of the run
        self.written: set[tuple[str, str]] = set()
        self.seq = 0  # parts written
        self.write_times: list[float] = []  # seconds since the start of the run, one per part
        self.write_samples: list[int] = []  # distinct samples per part

    def write(self, table: pa.Table) -> None:
        keys = zip(table.column("sample_id").to_pylist(), table.column("method").to_pylist())
        mask, kept = [], set()
        for k in keys:
            mask.append(k in self.expected and k not in self.written and k not in kept)
            if mask[-1]:
                kept.add(k)
        dropped = len(mask) - sum(mask)
        if dropped:
            say(f"dropping {dropped} row(s) already written or not planned (a retried batch)")
            table = table.filter(pa.array(mask))
        if not table.num_rows:
            return
        self.store.write_part(table, self.run_id, self.seq)
        self.written.update(kept)  # only once the part is on disk: a failed write leaves its rows missing
        self.seq += 1
        self.write_times.append(time.perf_counter() - self.t0)
        self.write_samples.append(len(set(table.column("sample_id").to_pylist())))
        self.progress.update(table)

    def missing(self) -> list[tuple[str, str]]:
        return sorted(self.expected - self.written)
