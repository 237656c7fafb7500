"""Ctrl-C and ``ray job stop`` as normal events: the job stops where it is, says in one line what it left, and exits
with ``128 + signal`` (130 for SIGINT, 143 for SIGTERM).

A terminal's Ctrl-C sends SIGINT to the job's whole process group; ``ray job stop`` sends SIGTERM to the
entrypoint's process group (and SIGKILL 3 s later, ``RAY_JOB_STOP_WAIT_TIME_S``). Inside :func:`interruptible`
either signal raises :class:`Interrupted` in the main thread, wherever it is (planning, the Ray stages, a part
write, MLflow logging); every later one is ignored, so the clean-up that follows (the run record, the one line,
MLflow's runs marked FAILED) is not itself interrupted. What a part write leaves is already clean: its temporary is
removed by ``rcr.fileio.atomic_path`` on any exception, and a part is renamed into place whole or not at all.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_LOGGING_DIR = os.path.dirname(logging.__file__)


class Interrupted(BaseException):  # noqa: N818 - a BaseException like KeyboardInterrupt: `except Exception` lets it by
    """The job was asked to stop by ``signum``; ``exit_status`` is the shell's ``128 + signum``."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def behind(e: BaseException) -> Interrupted | None:
    """The :class:`Interrupted` that ``e`` stands for, if any. The signal handler raises where the main thread is;
    when that is inside a C extension's call (Ray's Cython core worker: ``ray.wait`` under Ray Data's read of the
    inputs, or the wait for the next batch), the call comes out as ``SystemError: ... returned a result with an
    exception set``, with the Interrupted as its cause; an ``except Exception`` would take it for a failure."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, Interrupted):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def unwrap(e: BaseException) -> None:
    """Raise the :class:`Interrupted` behind ``e`` (:func:`behind`), if any: first thing in an ``except Exception``
    that would report ``e`` as a failure."""
    if (i := behind(e)) is not None and i is not e:
        raise i from None


def signal_of(e: BaseException) -> int:
    """The signal behind an interruption: ``Interrupted``'s, or SIGINT for a bare ``KeyboardInterrupt``."""
    return e.signum if isinstance(e, Interrupted) else signal.SIGINT


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Inside: the first SIGINT or SIGTERM raises :class:`Interrupted`; later ones are ignored until the block ends.
    Outside the main thread (where Python cannot install handlers) it does nothing.

    Python runs a signal's handler in the main thread between two bytecodes, wherever it is; two places there must
    not take the exception. Inside the ``logging`` package (a logging handler that goes away calls logging from a
    weakref callback, between taking and releasing logging's module lock): raised there, the exception leaves the
    lock taken, and the next thread that logs (Ray Data's) waits for ever. Where Python cannot raise (a weakref
    callback, ``__del__``): it prints "Exception ignored in ..." and drops the exception, and the job would go on
    with the signals ignored. In both cases the signal is sent to the main thread again (:class:`_Resender`) until
    it lands outside them. One still being sent again when the block ends is dropped, like one after the job ended
    (:func:`closing`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    resend = _Resender()

    def handler(signum, frame):
        if held_back(frame):
            resend.ask(signum)
            return
        resend.ask(0)
        for s in SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    def dropped(unraisable):
        if isinstance(unraisable.exc_value, Interrupted):
            resend.ask(unraisable.exc_value.signum)
            for s in SIGNALS:  # the handler had ignored them, for a clean-up that now never runs
                signal.signal(s, handler)  # one handled before this hook returns is held back, below
        else:
            before(unraisable)

    def held_back(frame) -> bool:
        """Whether ``frame``, or a frame that called it, runs the logging package's code or ``dropped``."""
        while frame is not None:
            if frame.f_code is dropped.__code__ or os.path.dirname(frame.f_code.co_filename) == _LOGGING_DIR:
                return True
            frame = frame.f_back
        return False

    before, sys.unraisablehook = sys.unraisablehook, dropped
    try:
        with _handled_by(handler):
            try:
                yield
            finally:
                resend.stop()  # before the handlers go back: a signal sent again must not meet the ones before
    finally:
        sys.unraisablehook = before


class _Resender:
    """A thread that sends a signal to the main thread again until the main thread's handler takes it. Not from the
    handler itself: Python would run the handler again inside it, before it returns. A real signal, so that it also
    ends a wait the main thread has gone back to. The handler's side (:meth:`ask`) takes no lock and starts nothing:
    it may run where the main thread holds any lock; it sets the signal and writes a byte to a pipe the thread
    waits on."""

    RETRY_S = 0.01  # while the main thread is still where the signal is held back

    def __init__(self):
        self.signum, self.stopped = 0, False
        self.main = threading.main_thread().ident
        self.r, self.w = os.pipe()
        os.set_blocking(self.w, False)
        self.thread = threading.Thread(target=self._run, name="rcr-interrupt", daemon=True)
        self.thread.start()

    def ask(self, signum: int) -> None:
        """From the main thread's handler: send ``signum`` again until asked for 0."""
        if self.stopped:
            return
        self.signum = signum
        if signum:
            with contextlib.suppress(BlockingIOError):  # the pipe is full: the thread is awake anyway
                os.write(self.w, b"\0")

    def stop(self) -> None:
        self.signum, self.stopped = 0, True
        with contextlib.suppress(BlockingIOError):
            os.write(self.w, b"\0")
        self.thread.join()
        os.close(self.r)
        os.close(self.w)

    def _run(self) -> None:
        while not self.stopped:
            os.read(self.r, 512)
            while (signum := self.signum) and not self.stopped:
                signal.pthread_kill(self.main, signum)
                time.sleep(self.RETRY_S)


@contextlib.contextmanager
def while_starting() -> Iterator[None]:
    """Around a job script's imports (the driver's modules take seconds, a minute on a busy machine), before
    :func:`interruptible` takes over: SIGINT or SIGTERM prints the one line and ends the process at once with
    ``128 + signal``, instead of a KeyboardInterrupt traceback from somewhere in an import. Nothing is written yet."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        print(f"[rcr-job] {line(None, None, None)}", flush=True)
        os._exit(128 + signum)

    with _handled_by(handler):
        yield


@contextlib.contextmanager
def _handled_by(handler) -> Iterator[None]:
    """SIGINT and SIGTERM go to ``handler`` inside the block; the handlers before it are put back after."""
    before = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def closing() -> None:
    """After the job has ended and said so (its rows and runs are in place): SIGINT and SIGTERM are held back for the
    rest of the process, Ray's teardown and the interpreter's, which end it with the job's own exit status. A terminal's
    Ctrl-C reaches that teardown too, and there no handler of ours runs (the interpreter restores the default ones as
    it finalizes): the process died by the signal without a word. SIGKILL (``ray job stop``'s second step) still
    ends it."""
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:  # ignored, process-wide (a mask would be the main thread's only); finalizing keeps SIG_IGN
            signal.signal(s, signal.SIG_IGN)


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Around ``ray.init``: the SIGINT and SIGTERM handlers before it are put back after it, at the Python and the C
    level. ``ray.init`` replaces Python's SIGTERM handler with its own (``sys.exit``) and then the core worker installs
    its failure signal handler over it at the C level, which for SIGTERM prints a stack trace (``*** SIGTERM received
    ...``) and ends the process before any Python handler runs: a job stopped by ``ray job stop`` would die without its
    one line. If the job is interrupted inside, the signals stay ignored instead. Outside the main thread it does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in SIGNALS}
    interrupted = False
    try:
        yield
    except BaseException as e:
        interrupted = behind(e) is not None
        raise
    finally:
        for s, h in before.items():
            if interrupted:  # the job stops: later signals stay ignored for its clean-up (interruptible)
                signal.signal(s, signal.SIG_IGN)
            elif h is not None:  # None: a handler not installed from Python, which Python cannot put back
                signal.signal(s, h)


def line(done: int | None, total: int | None, output_dir: str | None, during: str | None = None) -> str:
    """The job's one line when interrupted: how many of its rows are on disk, where, and what to do (``total``
    None: before the job planned its rows)."""
    what = f" while {during}" if during else ""
    if total is None:
        where = f" (output dir {output_dir})" if output_dir else ""
        return f"interrupted{what} before the job planned its rows: this run wrote nothing{where}; the same command " \
               "resumes"
    return f"interrupted{what}: {done} of {total} rows written to {output_dir}; the same command resumes"
