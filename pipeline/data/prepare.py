"""Write input shards (Parquet, the project's one input schema) from a real dataset or the generator.

    python jobs/prepare_data.py detailcaps --limit 300 --seed 0 --out data/detailcaps
    python jobs/prepare_data.py textcaps   --limit 500 --seed 0 --out data/textcaps
    python jobs/prepare_data.py detailcaps --local-path /data/DetailCaps-4870.parquet --out data/detailcaps
    python jobs/prepare_data.py video      --local-path /data/my_videos --frames 8 --out data/video
    python jobs/prepare_data.py synthetic  --task detailcaps -n 200 --seed 10000 --out data/synthetic_detailcaps

DetailCaps and TextCaps are read with Hugging Face ``datasets`` (``pipeline/data/hf_datasets.py``): from the
Hub at a pinned revision (``--streaming`` for streaming=True), offline from a snapshot in the hub cache (the
pinned revision preferred; another one is named in one line), or from ``--local-path`` (a Parquet file, a
folder laid out like the Hub repository, or a ``datasets.save_to_disk`` directory). The last line names the
rows' ``source``: the Hub id with the commit read, or the local path with its files' SHA-256 prefix. Shards are
written atomically; the directory gets a ``_SUCCESS`` marker only when every shard is in place.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pipeline.data import convert, shards
from pipeline.data.synthetic import SyntheticError
from pipeline.schema import SchemaError
from pipeline.tasks import TASKS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hub = [name for name, t in TASKS.items() if t.source is not None]  # the registered tasks with a public dataset
    ap.add_argument("source", choices=[*hub, "video", "synthetic"], help="what to convert")
    ap.add_argument("--out", required=True, help="output directory for the Parquet shards")
    ap.add_argument("--limit", type=int, default=None,
                    help="keep a fixed random subset of N samples (default: every sample)")
    ap.add_argument("-n", type=int, default=None, help="synthetic: number of samples (default: --limit, else 200)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the subset (or of the synthetic samples) (default: 0)")
    ap.add_argument("--local-path", default=None,
                    help="local copy of the dataset (file or directory); for video: the folder of videos "
                         "(default: the Hub dataset at its pinned revision)")
    ap.add_argument("--cache-dir", default=None,
                    help="the Hugging Face hub cache searched offline for a snapshot (default: HF_HUB_CACHE)")
    ap.add_argument("--revision", default=None,
                    help="the dataset revision to read, a commit or a branch such as main (default: the pinned one)")
    ap.add_argument("--streaming", action="store_true",
                    help="read the Hub dataset with datasets' streaming=True and keep its first --limit samples "
                         "(no random subset, nothing written to the datasets cache)")
    ap.add_argument("--task", default="detailcaps",
                    help="synthetic: detailcaps, textcaps or video (default: detailcaps)")
    ap.add_argument("--frames", type=int, default=8, help="video: frames sampled uniformly per video (default: 8)")
    ap.add_argument("--shard-size", type=int, default=256, help="samples per Parquet shard (default: 256)")
    ap.add_argument("--workers", type=int, default=1, help="synthetic: generator processes (default: 1)")
    args = ap.parse_args(argv)

    t0 = time.time()
    try:
        if args.source == "synthetic":
            n = args.n if args.n is not None else (args.limit if args.limit is not None else 200)
            paths = shards.write_synthetic(args.out, args.task, n, seed=args.seed, shard_size=args.shard_size,
                                         workers=args.workers)
        else:
            if args.source in hub:
                recs = convert.convert_hub(TASKS[args.source], args.local_path, args.limit, args.seed, args.cache_dir,
                                           args.revision, args.streaming)
            else:
                if not args.local_path:
                    ap.error("video needs --local-path <folder of videos or frame folders>")
                recs = convert.convert_videos(args.local_path, args.frames, args.limit, args.seed)
            paths = shards.write_shards(recs, args.out, args.shard_size, prefix=args.source)
    except convert.OfflineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (shards.DataError, SchemaError, SyntheticError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    t = shards.read_input(args.out)
    no_refs = sum(1 for refs in t.column("references").to_pylist() if not refs)
    print(f"wrote {t.num_rows} samples in {len(paths)} shard(s) to {Path(args.out).resolve()} in "
          f"{time.time() - t0:.1f} s; source {', '.join(sorted(set(t.column('source').to_pylist())))}"
          + (f"; {no_refs} without references (their reference metrics are absent)" if no_refs else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
