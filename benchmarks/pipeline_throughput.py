"""Pipeline throughput: samples/s of a bare single-process loop, the Ray job with 1 actor, and with 2 actors.

All three evaluate the same samples with the same model, methods and max_new_tokens, in the same run:

1. bare loop: one process, ``SampleEvaluator`` called batch by batch (no Ray, no Parquet);
2. Ray job, 1 actor: ``pipeline.run.run`` (the code behind ``jobs/*.py``): Ray Data ``read_parquet`` ->
   ``map_batches(SampleEvaluator)`` -> atomic Parquet parts, on a private local Ray on 127.0.0.1;
3. the same with 2 actors.

"end-to-end" includes model loading (and Ray start-up / actor creation for the Ray runs). "steady" leaves
out each worker's first batch (its warm-up): the samples of the later batches over the time from the
k-th batch written to the last (k = 1 for the loop and 1 actor, 2 for 2 actors). The machine's load
average is printed too: on a shared box, other processes change these figures.

    python -m benchmarks.pipeline_throughput                      # embedded model, 8 samples, 32 tokens
    python -m benchmarks.pipeline_throughput --n 16 --max-new-tokens 64 --methods full,bacon,rcr
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _model(arg: str, tmp: Path) -> str:
    from rcr.embedded import model_dir

    if arg != "embedded" or (model_dir() / "config.json").is_file():
        return arg
    from tests.pipeline_helpers import tiny_qwen2_vl_dir

    print("[bench] the embedded model is not in this checkout; using a tiny random Qwen2-VL instead", flush=True)
    return str(tiny_qwen2_vl_dir(tmp))


def _steady(times: list[float], sizes: list[int], k: int) -> float:
    """Samples of batches k.. over the time from batch k-1 to the last (each worker's first batch left out)."""
    if len(times) <= k or times[-1] <= times[k - 1]:
        return float("nan")
    return sum(sizes[k:]) / (times[-1] - times[k - 1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="detailcaps", choices=("detailcaps", "textcaps", "video"))
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--n", type=int, default=12, help="samples")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--methods", default="all")
    ap.add_argument("--batch-size", type=int, default=2)
    args = ap.parse_args()

    from pipeline.data.shards import synthetic_records, write_shards
    from pipeline.run.actor import SampleEvaluator
    from pipeline.run.config import JobConfig
    from pipeline.run.driver import run
    from pipeline.run.placement import Node, plan_actors

    tmp = Path(tempfile.mkdtemp(prefix="rcr-bench-"))
    model = _model(args.model, tmp)
    shards = tmp / "shards"
    records = list(synthetic_records(args.task, args.n, seed=12345))
    write_shards(records, shards, shard_size=max(1, args.n))

    def cfg(n_actors: int, name: str) -> JobConfig:
        return JobConfig.from_dict({
            "task": args.task, "model": model, "shards": [str(shards)], "methods": args.methods.split(","),
            "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "num_actors": n_actors,
            "output_dir": str(tmp / name), "mlflow_uri": f"sqlite:///{tmp / 'mlflow.db'}", "summary": False,
            "progress_every_s": 1e9})

    results = []
    load0 = os.getloadavg()
    # 1. bare single-process loop, with the torch threads a 1-actor job would use
    c = cfg(1, "bare")
    threads = plan_actors(c, [Node("local", "127.0.0.1", float(os.cpu_count() or 1), 0.0)]).torch_threads
    c.torch_threads = threads
    t0 = time.perf_counter()
    ev = SampleEvaluator(c.to_dict())
    t1 = time.perf_counter()
    rows = 0
    times, sizes = [], []
    for i in range(0, args.n, args.batch_size):
        chunk = records[i:i + args.batch_size]
        rows += ev({k: [r[k] for r in chunk] for k in chunk[0]}).num_rows
        times.append(time.perf_counter() - t0)
        sizes.append(len(chunk))
    t2 = time.perf_counter()
    results.append(("bare loop, 1 process", args.n, rows, t2 - t0, args.n / (t2 - t0), _steady(times, sizes, 1)))
    print(f"[bench] bare loop: model load {t1 - t0:.1f}s, {args.n} samples in {t2 - t1:.1f}s", flush=True)
    del ev

    # 2./3. the Ray job with 1 and 2 actors
    for n_actors in (1, 2):
        c = cfg(n_actors, f"ray{n_actors}")
        t0 = time.perf_counter()
        rep = run(c)
        wall = time.perf_counter() - t0
        assert rep["status"] == "ok" and rep["n_missing"] == 0, rep
        steady = _steady(rep.get("write_times_s") or [], rep.get("write_samples") or [], n_actors)
        results.append((f"ray job, {n_actors} actor{'s' if n_actors > 1 else ''}", args.n, rep["n_written"], wall,
                        args.n / wall, steady))

    import torch

    print()
    shown = args.model if model == args.model else "tiny random Qwen2-VL"
    print(f"pipeline throughput: task={args.task} model={shown} "
          f"methods={','.join(cfg(1, 'x').methods)} max_new_tokens={args.max_new_tokens} batch_size={args.batch_size} "
          f"samples={args.n}; {os.cpu_count()} CPU cores, "
          f"{'GPU ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}; "
          f"load average at start {load0[0]:.1f}, at end {os.getloadavg()[0]:.1f}")
    print(f"torch threads per process/actor: {threads}")
    print(f"{'mode':<24}{'samples':>8}{'rows':>7}{'wall s':>9}{'samples/s end-to-end':>22}{'samples/s steady':>18}")
    for name, n, r, wall, e2e, st in results:
        print(f"{name:<24}{n:>8}{r:>7}{wall:>9.1f}{e2e:>22.3f}{st:>18.3f}")


if __name__ == "__main__":
    main()
