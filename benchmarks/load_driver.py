"""Load on the job driver: a job of many samples with a fast fake engine (no model), through the real driver
and Ray Data on a private in-process Ray. Per job size it reports rows/s and the driver's peak RSS, and the
ratio of the peak RSS at the largest size to the smallest (the driver streams: it must not grow with N).

    python -m benchmarks.load_driver                      # 500 and 2,000 samples x 3 methods
    python -m benchmarks.load_driver --sizes 500 2000 8000 --batch-size 20

Each size runs in a fresh driver process (``--child``), so each peak RSS (the kernel's VmHWM) is that job's
own. "growth" is the peak minus the RSS just before ``pipeline.run.driver.run`` (after the imports), i.e. what the
job itself costs the driver, Ray's client included. The fake engine is tests/pipeline_helpers.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
METHODS = "full,bacon,rcr"


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def make_shards(out: Path, n: int, per_shard: int = 250) -> None:
    """``n`` samples in shards of ``per_shard``: one synthetic image and prompt, distinct ids."""
    from tests.pipeline_helpers import synthetic_records, write_shard

    base = synthetic_records("detailcaps", 1)[0]
    for s in range(0, n, per_shard):
        recs = [dict(base, sample_id=f"load-{i:06d}", prompt=f"{base['prompt']} ({i})")
                for i in range(s, min(n, s + per_shard))]
        write_shard(out / f"s{s // per_shard:04d}.parquet", recs)


def child(n: int, work: Path, batch_size: int, inline: bool) -> None:
    """One job of ``n`` samples in this process; prints a JSON line with its figures."""
    if inline:  # no Ray: the evaluator runs in the driver process (tests/inline_driver.py)
        from tests import inline_driver

        inline_driver.install()
    os.environ.setdefault("RCR_RUNS_DIR", str(work / "runs"))
    from pipeline.run import driver
    from pipeline.run.cli import job_config

    model = work / "fake-model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text('{"model_type": "qwen2_vl"}')
    cfg = job_config(["--model", str(model), "--shards", str(work / f"shards-{n}"), "--methods", METHODS,
                               "--engine", "tests.pipeline_helpers:FakeEngine", "--batch-size", str(batch_size),
                               "--output-dir", str(work / f"out-{n}"), "--no-summary", "--progress-every-s", "30",
                               "--mlflow-uri", f"sqlite:///{work / 'mlflow.db'}"], task="detailcaps")
    rss0 = _status_kb("VmRSS")
    t0 = time.perf_counter()
    rep = driver.run(cfg)
    wall = time.perf_counter() - t0
    assert rep["status"] == "ok" and rep["n_missing"] == 0, rep
    print("LOAD " + json.dumps({"n": n, "rows": rep["n_written"], "wall_s": wall, "rss0_kb": rss0,
                                "peak_kb": _status_kb("VmHWM"), "parts": len(rep["write_times_s"])}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[500, 2000])
    ap.add_argument("--batch-size", type=int, default=20)
    ap.add_argument("--work", help="work directory (default: a temporary one)")
    ap.add_argument("--inline", action="store_true", help="without Ray (the evaluator runs in the driver)")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, Path(args.work), args.batch_size, args.inline)
        return 0

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(args.work or tempfile.mkdtemp(prefix="rcr-load-"))
    print(f"load average at start: {os.getloadavg()}; work dir {work}; methods {METHODS}; batch size {args.batch_size}"
          f"; {'inline (no Ray)' if args.inline else 'Ray Data on a private in-process Ray'}")
    results = []
    for n in args.sizes:
        make_shards(work / f"shards-{n}", n)
        r = subprocess.run([sys.executable, __file__, "--child", str(n), "--work", str(work), "--batch-size",
                            str(args.batch_size), *(["--inline"] if args.inline else [])], cwd=REPO,
                           capture_output=True, text=True, check=False,
                           env=dict(os.environ, PYTHONPATH=str(REPO), RAY_raylet_start_wait_time_s="300"))
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("LOAD ")]
        if r.returncode != 0 or not line:
            print(r.stdout[-3000:], r.stderr[-3000:])
            return 1
        results.append(json.loads(line[0][5:]))
    print(f"\n{'samples':>8}{'rows':>8}{'parts':>7}{'wall s':>9}{'rows/s':>9}{'peak RSS MiB':>14}{'growth MiB':>12}")
    for x in results:
        print(f"{x['n']:>8}{x['rows']:>8}{x['parts']:>7}{x['wall_s']:>9.1f}{x['rows'] / x['wall_s']:>9.1f}"
              f"{x['peak_kb'] / 1024:>14.0f}{(x['peak_kb'] - x['rss0_kb']) / 1024:>12.0f}")
    a, b = results[0], results[-1]
    print(f"\npeak RSS {b['n']} vs {a['n']} samples: x{b['peak_kb'] / a['peak_kb']:.3f}; "
          f"growth x{(b['peak_kb'] - b['rss0_kb']) / max(1, a['peak_kb'] - a['rss0_kb']):.3f} "
          f"(x{b['n'] / a['n']:.0f} samples)")
    print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
