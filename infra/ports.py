"""Port helper for infra/local_cluster.sh: choose the local cluster's ports, and say who holds a port.

    python infra/ports.py pick NAME=ENV_VAR:DEFAULT ... NAME=ENV_VAR:+SIZE
        prints one ``NAME=PORT`` line per port (``NAME=LO-HI`` for a block of SIZE), all distinct and free now.
        A port set in ENV_VAR must be free, else the command fails with one line naming the port, the
        variable and the process that holds it. An unset one takes DEFAULT when that is free, else any free
        port (DEFAULT "-" means any free port).
    python infra/ports.py holder PORT
        prints "pid 123 (python3)" for the process listening on 127.0.0.1:PORT or any address, or nothing.

Every check binds 127.0.0.1 and the wildcard address, so a port that another process holds on either counts
as taken. Standard library only: this runs before the venv's packages are known to be there.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

HOST = "127.0.0.1"


def _bindable(port: int) -> bool:
    for host in (HOST, "0.0.0.0"):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT does not count
        try:
            s.bind((host, port))
        except OSError:
            return False
        finally:
            s.close()
    return True


def holder(port: int) -> str:
    """The listening process on ``port`` as ss sees it (pids show only for this user's processes)."""
    try:
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    for line in out.splitlines():
        cols = line.split()
        if len(cols) >= 4 and cols[3].rsplit(":", 1)[-1] == str(port):
            m = re.search(r'\("([^"]+)",pid=(\d+)', line)
            return f"pid {m.group(2)} ({m.group(1)})" if m else f"another user's process on {cols[3]}"
    return ""


def _taken(port: int, what: str) -> str:
    who = holder(port)
    return f"port {port} ({what}) is in use{' by ' + who if who else ''}"


def _any_free(avoid: set[int]) -> int:
    while True:
        s = socket.socket()
        s.bind((HOST, 0))
        port = s.getsockname()[1]
        s.close()
        if port not in avoid and _bindable(port):
            return port


def _free_block(size: int, avoid: set[int]) -> int:
    """The lowest port of ``size`` consecutive free ports (below the ephemeral range, where the OS does not
    hand out ports on its own)."""
    for lo in range(20000, 32000 - size, size):
        if all(p not in avoid and _bindable(p) for p in range(lo, lo + size)):
            return lo
    raise SystemExit(f"no block of {size} free ports between 20000 and 32000")


def pick(specs: list[str]) -> list[str]:
    """``NAME=ENV:DEFAULT`` -> ``NAME=PORT``; ``NAME=ENV:+SIZE`` -> ``NAME=LO-HI`` (a block, chosen last)."""
    lines, used, blocks = [], set(), []
    for spec in specs:
        name, rest = spec.split("=", 1)
        env, default = rest.split(":", 1)
        if default.startswith("+"):
            blocks.append((name, env, int(default[1:])))
            continue
        value = os.environ.get(env, "").strip()
        if value:
            if not value.isdigit():
                raise SystemExit(f"{env}={value!r} is not a port number")
            port = int(value)
            if port in used or not _bindable(port):
                raise SystemExit(_taken(port, f"{name}, set by {env}") + f"; free it or set {env} to another port")
        elif default != "-" and int(default) not in used and _bindable(int(default)):
            port = int(default)
        else:
            port = _any_free(used)
        used.add(port)
        lines.append(f"{name}={port}")
    for name, env, size in blocks:
        value = os.environ.get(env, "").strip()
        if value:
            m = re.fullmatch(r"(\d+)-(\d+)", value)
            if not m or int(m.group(1)) > int(m.group(2)):
                raise SystemExit(f"{env}={value!r} is not a port range LO-HI")
            lo, hi = int(m.group(1)), int(m.group(2))
            bad = next((p for p in range(lo, hi + 1) if p in used or not _bindable(p)), None)
            if bad is not None:
                raise SystemExit(_taken(bad, f"{name}, in {env}={value}") + f"; set {env} to a free range")
        else:
            lo = _free_block(size, used)
            hi = lo + size - 1
        lines.append(f"{name}={lo}-{hi}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "holder":
        print(holder(int(argv[1])))
        return 0
    if argv and argv[0] == "pick":
        print("\n".join(pick(argv[1:])))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
