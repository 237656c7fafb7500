"""Progress lines for a long stage that runs in this process (drawing the embedded scenes, the premise check's
probes): no stage is silent for longer than the job's ``--progress-every-s``.

    with Stage("probes: greedy answers", 9, every_s=10) as stage:
        greedy_answers(..., done=stage)      # the stage calls stage(k) as its k-th item finishes

prints ``[rcr-job] probes: greedy answers 3/9, 41 s`` every ``every_s`` from a heartbeat thread (a single item can
take longer than that: a 512-token answer on a CPU), and ``... 9/9 in 2 min 5 s`` when the stage ends.
"""

from __future__ import annotations

import threading
import time

from pipeline.quiet import say


def duration(seconds: float) -> str:
    """``41 s``, ``2 min 5 s``."""
    s = round(seconds)
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60} s"


class Stage:
    """A context manager; call it with the number of items finished."""

    def __init__(self, name: str, total: int, every_s: float):
        self.name, self.total, self.every_s = name, total, every_s
        self.finished = 0
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def __call__(self, finished: int) -> None:
        self.finished = finished

    def line(self) -> str:
        return f"{self.name} {self.finished}/{self.total}, {duration(time.perf_counter() - self.t0)}"

    def __enter__(self) -> Stage:
        self.t0 = time.perf_counter()

        def beat():
            while not self._stop.wait(self.every_s):
                say(self.line())

        self._beat = threading.Thread(target=beat, name="rcr-stage-progress", daemon=True)
        self._beat.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        self._beat.join()
        if exc_type is None:
            say(f"{self.name} {self.finished}/{self.total} in {duration(time.perf_counter() - self.t0)}")
