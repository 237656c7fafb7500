"""The job's command line (``python jobs/detailcaps.py --help``): the flags of :class:`JobConfig`, grouped.

Flags default to None so that a ``--config`` file's values win over unset flags; each help text states the real
default (what :meth:`JobConfig.validate` fills in). ``--engine`` (the model backend, ``module:Class``: the tests'
fake engines) is accepted but not listed.
"""

from __future__ import annotations

import argparse

from pipeline.run.config import (
    JobConfig,
    available_methods,
    default_runs_root,
    default_tracking_uri,
)
from pipeline.tasks import TASKS


def _epilog(task: str | None) -> str:
    script = f"jobs/{task or 'detailcaps'}.py"
    return (
        "examples:\n"
        f"  python {script} --limit 8\n"
        "      the embedded model on its synthetic scenes, the first 8 samples, every method\n"
        f"  python {script} --model Qwen/Qwen2-VL-7B-Instruct --shards /data/shards/{task or 'detailcaps'} \\\n"
        "      --methods full,bacon,exact,fixed,rcr --num-actors 8 --device cuda\n"
        "      a real model on converted shards (jobs/prepare_data.py), one GPU per actor\n"
        "\n"
        "Results: Parquet rows in the output dir, runs in MLflow; the job prints both at the end. On a running\n"
        "cluster: ray job submit --working-dir . -- python " + script + " ... (docs/pipeline.md)."
    )


def _what(p: argparse.ArgumentParser, task: str | None, d: JobConfig, runs) -> None:
    g = p.add_argument_group("what to run")
    if task is None:
        g.add_argument("--task", choices=list(TASKS), help=f"which task (default: {d.task})")
    tokens = ", ".join(f"{t} {n}" for t, n in ((t, x.max_new_tokens) for t, x in TASKS.items()) if task in (None, t))
    g.add_argument("--model", help="'embedded' (the small synthetic-scene model shipped in rcr/embedded_model), "
                   "a local checkpoint dir, or e.g. Qwen/Qwen2-VL-7B-Instruct (default: embedded)")
    g.add_argument("--shards", nargs="+", help="Parquet shard files/dirs/globs in the input schema, or 'embedded': "
                   f"the synthetic shards, generated once under {runs / 'shards'} (default: embedded)")
    g.add_argument("--dataset", help="instead of --shards: NAME[:split], the task's Hugging Face dataset by name "
                   "(foundation-multimodal-models/DetailCaps-4870, lmms-lab/TextCaps, or the task name) at its "
                   "pinned revision, or a local save_to_disk directory or Parquet file/folder of it; converted in "
                   f"full once, into {runs / 'datasets'} (default: none; the split defaults to the pinned one)")
    g.add_argument("--methods", help="comma-separated method labels, or 'all': "
                   f"{', '.join(available_methods())}; 'fixed@TAU' runs fixed with that tau "
                   "(e.g. fixed@0.05,fixed@0.10 for a sweep); full is always run (default: all)")
    g.add_argument("--max-new-tokens", dest="max_new_tokens", type=int,
                   help=f"generated tokens per sample and method, at most (default: {tokens})")
    g.add_argument("--limit", type=int, help="first N input rows, in shard order (default: every row)")
    g.add_argument("--rcr", action="append", metavar="KEY=VALUE",
                   help="an rcr.RCRConfig field, repeatable (default: the paper's values, and record_attention=true)")
    g.add_argument("--config", help="YAML file of JobConfig fields; flags override it (default: none)")


def _where(p: argparse.ArgumentParser, d: JobConfig, runs) -> None:
    g = p.add_argument_group("where results go")
    g.add_argument("--output-dir", dest="output_dir", help=f"Parquet output directory (default: {runs}/<job name>)")
    g.add_argument("--mlflow-uri", dest="mlflow_uri",
                   help=f"MLflow tracking URI (default: {default_tracking_uri()})")
    g.add_argument("--experiment", help=f"MLflow experiment (default: {d.experiment})")
    g.add_argument("--job-name", dest="job_name", help="names the output dir and the MLflow parent run "
                   "(default: <task>-<model name>, e.g. detailcaps-embedded)")
    g.add_argument("--progress-every-s", dest="progress_every_s", type=float,
                   help=f"seconds between progress lines (default: {d.progress_every_s:g})")
    g.add_argument("--no-summary", dest="summary", action="store_false", default=None,
                   help="skip the per-method summary and the MLflow logging at the end (default: both run)")


def _resources(p: argparse.ArgumentParser, d: JobConfig) -> None:
    g = p.add_argument_group("resources")
    g.add_argument("--batch-size", dest="batch_size", type=int,
                   help=f"samples per model call (left-padded) and per Ray batch (default: {d.batch_size})")
    g.add_argument("--num-actors", dest="num_actors", type=int,
                   help=f"model actors, each holding one copy of the model (default: {d.num_actors})")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"),
                   help=f"where each actor runs the model; auto: cuda when the actor has a GPU (default: {d.device})")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                   help=f"model dtype; auto: bfloat16 on GPU, float32 on CPU (default: {d.dtype})")
    g.add_argument("--gpus-per-actor", dest="gpus_per_actor", type=float,
                   help="GPUs per actor (default: 1 where the cluster has GPUs, else 0)")
    g.add_argument("--cpus-per-actor", dest="cpus_per_actor", type=float,
                   help="CPUs per actor (default: 1 with GPUs; on CPU-only clusters what leaves 1 CPU for the readers)")
    g.add_argument("--torch-threads", dest="torch_threads", type=int,
                   help="torch threads per actor (default: 1 on CPU, 4 with a GPU)")
    g.add_argument("--ray-address", dest="ray_address",
                   help="Ray cluster to join; 'auto' joins a running one (default: the cluster of `ray job submit`, "
                        "else a private local Ray)")


def _faults(p: argparse.ArgumentParser, d: JobConfig) -> None:
    g = p.add_argument_group("faults and input limits")
    g.add_argument("--max-restarts", dest="max_restarts", type=int,
                   help=f"restarts of a dead actor, -1 unlimited (default: {d.max_restarts})")
    g.add_argument("--max-task-retries", dest="max_task_retries", type=int,
                   help=f"retries of a batch whose actor died, -1 unlimited (default: {d.max_task_retries})")
    g.add_argument("--max-image-pixels", dest="max_image_pixels", type=int,
                   help=f"larger images become error rows (decompression-bomb guard) (default: {d.max_image_pixels})")
    g.add_argument("--trust-remote-code", dest="trust_remote_code", action="store_true", default=None,
                   help="allow a hub model's own code (default: off)")


def build_arg_parser(task: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``jobs/<task>.py`` (``task`` None: ``--task`` is a flag too)."""
    d = JobConfig()
    runs = default_runs_root()
    p = argparse.ArgumentParser(
        description=f"Run {task or 'the'} evaluation job: every method on every sample, one Parquet row per "
                    "(sample, method).",
        epilog=_epilog(task), formatter_class=argparse.RawDescriptionHelpFormatter)
    _what(p, task, d, runs)
    _where(p, d, runs)
    _resources(p, d)
    _faults(p, d)
    p.add_argument("--engine", help=argparse.SUPPRESS)  # the model backend, module:Class (tests; see the docstring)
    return p
