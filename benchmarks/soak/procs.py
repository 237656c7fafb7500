"""Processes the soak started, found through /proc by their ancestry or by a mark in their command line: never by a
process name (other people's Ray heads and MLflow servers run on the same machine)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def alive(pid: int) -> bool:
    """Running (a zombie, which only waits to be reaped, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(root: int) -> list[int]:
    """Every live descendant of ``root`` (not ``root`` itself), parents before children."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                children.setdefault(ppid(int(p.name)), []).append(int(p.name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(0), []):
            out.append(c)
            todo.append(c)
    return [p for p in out if alive(p)]


def marked(mark: str) -> list[int]:
    """Live processes whose command line contains ``mark`` (e.g. the soak's private Ray temp dir)."""
    me = os.getpid()
    return [int(p.name) for p in Path("/proc").iterdir()
            if p.name.isdigit() and int(p.name) != me and mark in cmdline(int(p.name)) and alive(int(p.name))]


def find(roots: list[int], fragment: str, also: str = "") -> list[int]:
    """Descendants of ``roots`` (and the roots) whose command line contains ``fragment`` (and ``also``)."""
    pids = [p for r in roots for p in [r, *descendants(r)]]
    return [p for p in dict.fromkeys(pids) if fragment in (c := cmdline(p)) and also in c and alive(p)]


def signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)


def ray_stop(pids: list[int], grace_s: float = 10.0) -> None:
    """What ``ray stop`` does, to these processes only: SIGTERM, then SIGKILL what is left after ``grace_s``."""
    signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    kill_all(pids)


def kill_all(pids: list[int]) -> None:
    """SIGKILL ``pids`` and return once none runs."""
    signal_all(pids, signal.SIGKILL)
    while any(alive(p) for p in pids):
        time.sleep(0.05)
