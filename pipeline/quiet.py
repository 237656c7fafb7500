"""Keep a job's output to its own lines: Ray's informational messages stay in Ray's session logs.

* Ray Data: its progress display is off (the job prints its own progress line at a steady cadence), and its
  console handler shows warnings and errors only; everything still goes to
  ``<session>/logs/ray-data/ray-data.log``.
* The driver's ``ray`` loggers: warnings and errors only (``ray.init(logging_level=...)``), minus the notice
  that a private local cluster uses token authentication (the driver turns it on on purpose).
* MLflow's notices that it creates or upgrades the tables of a new SQLite store (its INFO lines).
* transformers' "Loading weights" progress bar, in each actor while it loads the model
  (:func:`quiet_model_loading`): the job's own progress line says the actors are loading.
* Ray's ``Actor with class name: 'MapWorker(...)' ... has constructor arguments in the object store and
  max_restarts > 0`` line, one per actor. Ray's C++ core worker writes it straight to the driver's stderr for
  every Ray Data actor pool with restarts on (Ray Data passes its actors their function through the object
  store, ray-project/ray#53727); the job needs the restarts (docs/cluster.md, "Faults"), and no Python
  logger carries the line. The driver's stderr passes through :func:`stderr_without`, which drops exactly that
  line; it stays in Ray's driver log (``<session>/logs/python-core-driver-*.log``).
* Actors' lines reach the driver's log without ANSI colours (``RAY_COLOR_PREFIX=0``, set by the driver).
* The map stage's actor fault-tolerance options (``max_restarts``, ``max_task_retries``) have no named
  parameter in Ray 2.60's ``map_batches``; only that one ``RayDeprecationWarning`` is filtered, around that
  call (:func:`actor_fault_tolerance`). Revisit when Ray 2.64 removes ``**ray_remote_args``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import warnings

RAY_LOGGING_LEVEL = logging.WARNING
RAY_ACTOR_RESTART_NOTICE = "has constructor arguments in the object store and max_restarts > 0"
TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"
PROGRESS_OFF_NOTICE = "Progress bars disabled"


def say(msg: str) -> None:
    """One line of the job's own output (``[rcr-job] ...``), flushed at once."""
    print(f"[rcr-job] {msg}", flush=True)


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_driver_logging() -> None:
    """At the start of a job: drop the token-authentication notice of the private local cluster and MLflow's
    store-creation notices. Idempotent."""
    token = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DropMessage) for f in token.filters):
        token.addFilter(_DropMessage(TOKEN_NOTICE))
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)


def quiet_ray_data(ctx) -> None:
    """No Ray Data progress display; its console handler at WARNING (its log file keeps every record)."""
    ctx.enable_progress_bars = False
    ctx.enable_operator_progress_bars = False
    for h in logging.getLogger("ray.data").handlers:
        if h.get_name() == "console":
            h.setLevel(logging.WARNING)
            if not any(isinstance(f, _DropMessage) for f in h.filters):
                h.addFilter(_DropMessage(PROGRESS_OFF_NOTICE))  # we turned them off on purpose


@contextlib.contextmanager
def quiet_model_loading():
    """No transformers progress bar while a model loads; the previous setting is restored after."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def actor_fault_tolerance():
    """Around ``map_batches(..., max_restarts=, max_task_retries=)``: those two have no named parameter in
    Ray 2.60, so passing them raises the ``ray_remote_args`` deprecation warning; filter exactly that one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`ray_remote_args` is deprecated", category=DeprecationWarning)
        yield


# The filter process: copies its stdin to its stdout line by line, minus the lines holding one of its arguments.
# Its own session and ignored SIGINT/SIGTERM keep it alive to the end of its input when the job is interrupted or
# stopped (`ray job stop` signals the driver's process group), so the job's last words still come through. With
# RCR_UNSAID set, an input that ends without SAID (written when the block ends, however it ends in Python) ends
# with that line: the process died where Python could say nothing.
_SAID = b"\x00rcr-said\n"  # as in _FILTER
_FILTER = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
drop = [a.encode() for a in sys.argv[1:]]
said, unsaid = b"\\x00rcr-said\\n", os.environ.get("RCR_UNSAID")
out, ended = sys.stdout.buffer, True
for line in iter(sys.stdin.buffer.readline, b""):
    if said in line:  # maybe after another writer's unfinished line, which it ends
        unsaid, line = None, line.replace(said, b"\\n" if line != said else b"")
    if line and not any(d in line for d in drop):
        out.write(line)
        out.flush()
        ended = line.endswith(b"\\n")
if unsaid:
    out.write((b"" if ended else b"\\n") + unsaid.encode() + b"\\n")
    out.flush()
"""


@contextlib.contextmanager
def stderr_without(*notices: str, drain_s: float = 10.0, unsaid: str | None = None):
    """Inside: this process's stderr (file descriptor 2, also what Ray's C++ core worker writes to) goes through a
    filter process that drops each line containing one of ``notices`` and passes every other line on at once.
    ``unsaid``: the line the filter writes when this process dies inside the block where Python cannot speak
    (SIGKILL, the kernel's out-of-memory killer, Ray's core worker ending it when its Ray goes away).

    The filter outlives a crash of this process (it ends at the end of its input), so an error written just
    before a crash still comes out. On exit, stderr is restored and the filter is given ``drain_s`` seconds to
    write what it holds (a child process that inherited the descriptor keeps it open longer: it is not waited
    for). Where the filter cannot start, stderr stays as it is."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        env = dict(os.environ, **({"RCR_UNSAID": unsaid} if unsaid else {}))
        proc = subprocess.Popen([sys.executable, "-c", _FILTER, *notices], stdin=subprocess.PIPE, stdout=saved,
                                stderr=saved, start_new_session=True, env=env)
    except OSError:
        os.close(saved)
        yield
        return
    os.dup2(proc.stdin.fileno(), 2)
    proc.stdin.close()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):  # the filter gone: nothing to tell it
            os.write(2, _SAID)  # Python is here: whatever happened, it says so itself
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=drain_s)
