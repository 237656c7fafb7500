"""Rows/s of one job on 3 Ray nodes of 1 CPU each against one node of 3 CPUs, side by side in one run.

Both clusters run on this machine on 127.0.0.1 (tests/ray_cluster.py: ``ray.cluster_utils.Cluster`` in a
helper process); the same command runs on each, ``python jobs/detailcaps.py --ray-address <cluster>
--num-actors 3``, with the same samples, model, methods and settings and a fresh output directory. So the
figure compares the plumbing of a spread job (actors and their blocks on three raylets and object stores)
with a one-node job, on the same cores; it is not a speed-up.

* end-to-end: rows / the job's wall time (its run record: planning, Ray Data, model loading in each actor).
* steady: rows of the parts after the first 3 (one warm-up batch per actor) over the time from the 3rd part
  written to the last (part files' modification times).

The two set-ups alternate (``--repeats``), and the machine's load average is printed at the start and end:
on a shared box, other processes change these figures.

    python -m benchmarks.cluster_spread                           # embedded model, 18 samples, 24 tokens
    python -m benchmarks.cluster_spread --n 24 --max-new-tokens 32 --repeats 2
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

SETUPS = {"3 nodes x 1 CPU": [1, 1, 1], "1 node x 3 CPU": [3]}
ACTORS = 3


def _model(arg: str, tmp: Path) -> str:
    from rcr.embedded import model_dir

    if arg != "embedded" or (model_dir() / "config.json").is_file():
        return arg
    from tests.pipeline_helpers import tiny_qwen2_vl_dir

    print("[bench] the embedded model is not in this checkout; using a tiny random Qwen2-VL instead", flush=True)
    return str(tiny_qwen2_vl_dir(tmp))


def _one(cpus: list[int], tmp: Path, job_args: list[str]) -> dict:
    """Start a cluster of ``cpus``, run the job on it, stop it; the job's rows, wall time and steady rows/s."""
    from tests.ray_cluster import LocalRayCluster

    out = tmp / "out"
    cluster = LocalRayCluster(tmp, cpus=cpus).start()
    try:
        r = subprocess.run([sys.executable, "jobs/detailcaps.py", "--ray-address", cluster.address,
                            "--output-dir", str(out), *job_args], cwd=REPO, env=cluster.env(), capture_output=True,
                           text=True, check=False)
    finally:
        cluster.stop()
    if r.returncode != 0:
        raise SystemExit(f"the job failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    import pyarrow.parquet as pq

    record = json.loads(next((out / "_runs").glob("*.json")).read_text())
    parts = sorted(out.glob("part-*.parquet"), key=lambda p: p.stat().st_mtime_ns)
    rows = [pq.read_metadata(p).num_rows for p in parts]
    times = [p.stat().st_mtime_ns / 1e9 for p in parts]
    k = ACTORS
    steady = sum(rows[k:]) / (times[-1] - times[k - 1]) if len(parts) > k and times[-1] > times[k - 1] else float("nan")
    nodes = {n for p in parts for n in pq.read_table(p, columns=["node_id"]).column("node_id").to_pylist()}
    return {"rows": sum(rows), "wall": record["wall_s"], "steady": steady, "parts": len(parts), "nodes": len(nodes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--n", type=int, default=18, help="samples")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--methods", default="full,rcr")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each set-up, alternating")
    args = ap.parse_args()

    from pipeline.data.shards import synthetic_records, write_shards

    tmp = Path(tempfile.mkdtemp(prefix="rcr-spread-"))
    # shards of exactly the N samples: the read stage reads whole files, and --limit on bigger shards would
    # make both set-ups read (and spill) rows they never use
    write_shards(list(synthetic_records("detailcaps", args.n, seed=12345)), tmp / "shards", shard_size=args.n)
    job_args = ["--model", _model(args.model, tmp), "--shards", str(tmp / "shards"), "--methods", args.methods,
                "--max-new-tokens", str(args.max_new_tokens), "--batch-size", str(args.batch_size),
                "--num-actors", str(ACTORS), "--torch-threads", "1", "--no-summary", "--progress-every-s", "1000",
                "--mlflow-uri", f"sqlite:///{tmp / 'mlflow.db'}"]
    load0 = os.getloadavg()
    runs: dict[str, list[dict]] = {name: [] for name in SETUPS}
    for i in range(args.repeats):
        for name, cpus in SETUPS.items():
            res = _one(cpus, tmp / f"{i}-{len(cpus)}", job_args)
            runs[name].append(res)
            print(f"[bench] {name}, run {i + 1}: {res['rows']} rows in {res['parts']} parts from {res['nodes']} "
                  f"node(s), {res['wall']:.1f}s, steady {res['steady']:.3f} rows/s", flush=True)
    load1 = os.getloadavg()

    print()
    print(f"cluster spread: detailcaps, model={args.model}, methods={args.methods}, max_new_tokens="
          f"{args.max_new_tokens}, batch_size={args.batch_size}, {args.n} samples, {ACTORS} actors x 1 torch thread; "
          f"{os.cpu_count()} CPU cores; load average at start {load0[0]:.1f} {load0[1]:.1f} {load0[2]:.1f}, "
          f"at end {load1[0]:.1f} {load1[1]:.1f} {load1[2]:.1f}")
    print(f"{'set-up':<18}{'rows':>6}{'wall s':>9}{'rows/s end-to-end':>19}{'rows/s steady':>15}")
    means = {}
    for name, rs in runs.items():
        wall = sum(r["wall"] for r in rs) / len(rs)
        e2e = sum(r["rows"] / r["wall"] for r in rs) / len(rs)
        steady = sum(r["steady"] for r in rs) / len(rs)
        means[name] = (e2e, steady)
        print(f"{name:<18}{rs[0]['rows']:>6}{wall:>9.1f}{e2e:>19.3f}{steady:>15.3f}")
    (spread, one) = means["3 nodes x 1 CPU"], means["1 node x 3 CPU"]
    print(f"ratio 3x1 / 1x3: end-to-end {spread[0] / one[0]:.3f}, steady {spread[1] / one[1]:.3f} "
          "(the bar: within 20%, i.e. >= 0.80)")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"[bench] {time.perf_counter() - t0:.0f}s in all")
