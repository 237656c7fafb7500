"""Submit a job to a Ray cluster and stream its log: only the job's own lines (infra/quickstart.sh, the tests).

    python infra/submit.py --address http://127.0.0.1:8265 [--runtime-env FILE.yaml] [--runtime-env-json JSON]
        -- python jobs/detailcaps.py --limit 8

What `ray job submit --working-dir . -- ...` does, through Ray's job submission API
(``ray.job_submission.JobSubmissionClient``, which the CLI uses), without the CLI's lines: its banner, "Next steps"
and status lines (INFO and SUCC records with ANSI colours), its upload notices, and the job manager's two preamble
lines in the log. The working directory (the repository) is packaged as with ``--working-dir .``: the project's
packages only, as ``.rayignore`` lists them. Exit status: 0 when the job succeeds; 1 when it fails or is stopped,
after one line with Ray's reason (its first line: the job's own log, already shown, is not repeated), or when the job
server cannot be reached or is lost while the job runs (one line, e.g. the cluster was stopped); 130 on Ctrl-C, which
leaves the job running and says how to stop it. Token authentication is read from the environment (RAY_AUTH_MODE,
RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH), as the CLI does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import shlex
import sys
import time
from pathlib import Path

import yaml


def preamble(submission_id: str) -> re.Pattern:
    """The job manager's own lines at the start of a job's log."""
    return re.compile(rf"^\S+ \S+\tINFO job_manager\.py:\d+ -- Runtime env is setting up\.$"
                      rf"|^Running entrypoint for job {re.escape(submission_id)}: ")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True, help="the job server (Ray dashboard) URL, e.g. http://127.0.0.1:8265")
    p.add_argument("--runtime-env", help="a runtime_env YAML file (env_vars, py_modules, ...)")
    p.add_argument("--runtime-env-json", help="a runtime_env as JSON, merged over --runtime-env")
    p.add_argument("--submission-id", help="the job's id (default: one Ray makes)")
    p.add_argument("entrypoint", nargs=argparse.REMAINDER, help="-- the command to run")
    ns = p.parse_args(argv)
    ns.entrypoint = ns.entrypoint[1:] if ns.entrypoint[:1] == ["--"] else ns.entrypoint
    if not ns.entrypoint:
        p.error("no entrypoint: put the command after --")
    return ns


async def stream(client, submission_id: str) -> None:
    skip = preamble(submission_id)
    head = True  # the preamble lines come first; everything after them is the job's
    try:
        async for chunk in client.tail_job_logs(submission_id):
            for line in chunk.splitlines(keepends=True):
                if head and skip.match(line.rstrip("\n")):
                    continue
                head = False
                sys.stdout.write(line)
            sys.stdout.flush()
    except RuntimeError as e:  # Ray's log stream says the job server went away (e.g. the cluster was stopped)
        if "WebSocket connection closed" not in str(e):
            raise
        raise ConnectionError(str(e)) from e


def reason(message: str | None) -> str:
    """Ray's reason for a failed or stopped job, on one line: Ray appends the end of the job's log to it, which
    this command has already printed."""
    lines = (message or "").strip().splitlines()
    return re.sub(r",? last available logs.*$", "", lines[0]) if lines else "no message"


def cause(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


def main(argv: list[str]) -> int:
    ns = parse(argv)
    import aiohttp

    try:
        return _main(ns)
    except (ConnectionError, OSError, aiohttp.ClientError) as e:  # the job server is down, or went away mid-job
        print(f"[submit] lost the job server at {ns.address} ({cause(e)}); the job's state is unknown. Once the "
              "cluster answers (infra/local_cluster.sh start), rerun the same command: it computes only the missing "
              "rows", file=sys.stderr)
        return 1


def _main(ns: argparse.Namespace) -> int:
    from ray.job_submission import JobStatus, JobSubmissionClient

    # this process's Ray loggers (packaging notices, each upload, the websocket's close) at WARNING
    for name in ("ray", *(n for n in logging.root.manager.loggerDict if n.startswith("ray."))):
        logging.getLogger(name).setLevel(logging.WARNING)

    env = yaml.safe_load(Path(ns.runtime_env).read_text()) if ns.runtime_env else {}
    env = {**(env or {}), **json.loads(ns.runtime_env_json or "{}")}
    env.setdefault("working_dir", ".")
    client = JobSubmissionClient(ns.address)
    sid = client.submit_job(entrypoint=shlex.join(ns.entrypoint), runtime_env=env, submission_id=ns.submission_id)
    try:
        asyncio.run(stream(client, sid))
    except KeyboardInterrupt:
        print(f"\n[submit] detached; job {sid} keeps running. Stop it: ray job stop --address {ns.address} {sid}",
              file=sys.stderr)
        return 130
    info = client.get_job_info(sid)
    while not info.status.is_terminal():  # the log ends as the job does; its status may lag a moment
        time.sleep(0.5)
        info = client.get_job_info(sid)
    if info.status == JobStatus.SUCCEEDED:
        return 0
    print(f"[submit] job {sid} {info.status.value.lower()}: {reason(info.message)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
