"""Write local lmms-eval caption tasks over the project's input shards (docs/lmms_eval.md).

    python -m pipeline.lmms.tasks                         # the embedded DetailCaps and TextCaps, 16 samples each
    python -m pipeline.lmms.tasks --model embedded-drift  # in the scene layout that embedded model answers
    python -m pipeline.lmms.tasks OUT --shards detailcaps=DIR --shards textcaps=DIR   # any input shards
    python -m lmms_eval --model rcr --include_path OUT --tasks rcr_detailcaps,rcr_textcaps

Each task is a YAML in ``OUT`` that reads its shards as local Parquet (``dataset_path: parquet`` with absolute
``data_files``, so lmms-eval runs from any directory with no hub), plus ``OUT/utils.py``, which points lmms-eval's
``!function`` entries at ``pipeline/lmms/task_utils.py``. Without ``--shards`` the embedded model's held-out
synthetic shards are generated into ``OUT/shards/`` (``pipeline.data.shards.write_synthetic_shards``), in the scene
layout ``--model`` was trained on (``rcr.embedded.scene_layout``): each embedded model answers its own layout only.
OUT defaults to ``<runs dir>/lmms-tasks`` (``<runs dir>/lmms-tasks-<model>`` for another embedded model, so that
one ``--include_path`` never holds two tasks of one name).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.data import synthetic
from pipeline.data.shards import SUCCESS_MARKER, DataError, write_synthetic_shards
from pipeline.lmms.task_utils import METRICS
from pipeline.paths import default_runs_root
from pipeline.schema import INPUT_SCHEMA
from pipeline.tasks import TASKS
from rcr.embedded import DIRECTORIES, NAME, scene_layout


def caption_tasks() -> list[str]:
    """The registered image tasks (``pipeline/tasks/``): DetailCaps and TextCaps, whose output lengths are
    lmms-eval's own (512 and 64 new tokens in its task YAMLs)."""
    return [name for name, t in TASKS.items() if t.media == "image"]


TASK_PREFIX = "rcr_"
DEFAULT_N = 16  # embedded samples per task: minutes on a CPU (docs/lmms_eval.md, "A worked run")
CACHE_DIR = "hf-datasets"  # in OUT: datasets' Arrow copy of the tasks' Parquet
UTILS_SHIM = ("# lmms-eval loads a task's !function entries from utils.py beside its YAML\n"
              "from pipeline.lmms.task_utils import *  # noqa: F401,F403\n")


def shard_files(path: str | Path) -> list[Path]:
    """A ``.parquet`` file, or a complete shard directory's ``.parquet`` files; each holds the input schema's
    columns. Raises DataError naming the file (and column)."""
    import pyarrow.parquet as pq

    path = Path(path)
    if path.is_dir():
        if not (path / SUCCESS_MARKER).exists():
            raise DataError(f"{path}: shard directory is incomplete (no {SUCCESS_MARKER} marker)")
        files = sorted(p for p in path.glob("*.parquet") if not p.name.startswith("."))
    elif path.suffix == ".parquet" and path.is_file():
        files = [path]
    else:
        raise DataError(f"{path}: not a .parquet file or a shard directory")
    if not files:
        raise DataError(f"{path}: no .parquet shards in this directory")
    for f in files:
        missing = [n for n in INPUT_SCHEMA.names if n not in pq.read_schema(f).names]
        if missing:
            raise DataError(f"{f}: column '{missing[0]}' is missing (the input schema, pipeline/schema.py)")
    return [f.resolve() for f in files]


def default_out(model: str = NAME) -> Path:
    """Where the tasks go without an OUT: under the runs directory, one directory per embedded model."""
    return default_runs_root() / ("lmms-tasks" if model == NAME else f"lmms-tasks-{model}")


def task_yaml(name: str, files: list[Path], max_new_tokens: int, cache_dir: Path) -> str:
    """One task's YAML: JSON strings are YAML scalars, so every path is quoted safely. ``cache_dir``: where
    ``datasets`` keeps its Arrow copy of ``files`` (lmms-eval passes ``dataset_kwargs`` to ``load_dataset``)."""
    metrics = "".join(f"  - metric: {m}\n    aggregation: !function utils.{m.lower()}\n    higher_is_better: true\n"
                      for m in METRICS)
    return (f"task: {name}\n"
            "dataset_path: parquet\n"
            "dataset_kwargs:\n"
            "  data_files:\n"
            f"    test: {json.dumps([str(f) for f in files])}\n"
            f"  cache_dir: {json.dumps(str(cache_dir))}\n"
            "test_split: test\n"
            "output_type: generate_until\n"
            "process_docs: !function utils.process_docs\n"
            "doc_to_visual: !function utils.doc_to_visual\n"
            "doc_to_text: !function utils.doc_to_text\n"
            "doc_to_target: !function utils.doc_to_target\n"
            "generation_kwargs:\n"
            f"  max_new_tokens: {int(max_new_tokens)}\n"
            "  temperature: 0\n"
            "  do_sample: false\n"
            "  num_beams: 1\n"
            "process_results: !function utils.process_results\n"
            f"metric_list:\n{metrics}"
            "metadata:\n"
            "  version: 0.0\n")


def write_task(out_dir: str | Path, name: str, data: str | Path, max_new_tokens: int) -> Path:
    """``out_dir/<name>.yaml`` over the shards at ``data`` (and ``out_dir/utils.py``)."""
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "utils.py").write_text(UTILS_SHIM)
    path = out / f"{name}.yaml"
    path.write_text(task_yaml(name, shard_files(data), max_new_tokens, out / CACHE_DIR))
    return path


def write_tasks(out_dir: str | Path, shards: dict[str, str | Path] | None = None, n: int | None = None,
                max_new_tokens: int | None = None, model: str = NAME) -> list[Path]:
    """``rcr_<task>`` for each task in ``shards`` (task -> shard directory or file); without ``shards``, the
    DetailCaps and TextCaps shards of the embedded ``model`` (``n`` samples each, default their embedded sizes, in
    the scene layout it was trained on) generated into ``out_dir/shards/<task>``. ``max_new_tokens`` overrides
    lmms-eval's per-task lengths."""
    out = Path(out_dir)
    if not shards:
        shards = {}
        layout = scene_layout(model) or synthetic.DEFAULT_LAYOUT
        for task in (t for t in caption_tasks() if TASKS[t].embedded_size):
            # drawing the scenes is the slow part (a minute and more for the defaults on 2 busy cores)
            print(f"[rcr-lmms] drawing {n or TASKS[task].embedded_size} {task} scene(s) (layout {layout}) into "
                  f"{out / 'shards' / task}", flush=True)
            write_synthetic_shards(task, out / "shards" / task, n=n, layout=layout)
            shards[task] = out / "shards" / task
    paths = []
    for task, data in shards.items():
        if task not in caption_tasks():
            raise DataError(f"--shards {task}=...: task must be one of {', '.join(caption_tasks())}")
        paths.append(write_task(out, TASK_PREFIX + task, data, max_new_tokens or TASKS[task].max_new_tokens))
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.lmms.tasks", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default=None,
                    help="directory for the task YAMLs (lmms-eval's --include_path) (default: <runs dir>/lmms-tasks, "
                         f"now {default_out()}; <runs dir>/lmms-tasks-MODEL for another --model)")
    ap.add_argument("--model", default=NAME, choices=list(DIRECTORIES),
                    help="the embedded model whose scene layout the generated shards use (default: %(default)s)")
    ap.add_argument("--shards", action="append", default=[], metavar="TASK=PATH",
                    help="input shards of a task (detailcaps or textcaps); repeatable. Default: the embedded ones")
    ap.add_argument("--n", type=int, default=DEFAULT_N,
                    help=f"embedded samples per task (default: {DEFAULT_N}; the embedded sets hold "
                         f"{', '.join(f'{t} {TASKS[t].embedded_size}' for t in caption_tasks())})")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="override lmms-eval's per-task lengths")
    args = ap.parse_args(argv)
    shards = {}
    for spec in args.shards:
        task, sep, path = spec.partition("=")
        if not sep or not path:
            ap.error(f"--shards {spec!r}: expected TASK=PATH")
        shards[task] = path
    if args.n < 1:
        ap.error(f"--n {args.n}: must be at least 1")
    out = Path(args.out).resolve() if args.out else default_out(args.model)
    try:
        paths = write_tasks(out, shards, args.n, args.max_new_tokens, args.model)
    except DataError as e:
        print(f"[rcr-lmms] {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    model = "MODEL" if shards else args.model
    results = default_runs_root() / "lmms-results"  # not the working directory: `clean` removes it with the rest
    print(f"[rcr-lmms] {len(paths)} task(s) in {out}; lmms-eval keeps its copy of their data in "
          f"{out / CACHE_DIR}. Run:\npython -m lmms_eval --model rcr --model_args pretrained={model},method=rcr "
          f"--include_path {out} --tasks {','.join(p.stem for p in paths)} --log_samples --output_path {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
