"""The job's command line (``python jobs/eval.py --help``), generated from :class:`JobConfig`'s field metadata: one
flag per field that has a ``--help`` group, in that group, stating its real default; :func:`job_config` parses it
(with ``--config file.yaml``) into a validated config.

Flags default to None so that a ``--config`` file's values win over unset flags. ``--engine`` (the model backend,
``module:Class``: the tests' fake engines) is accepted but not listed.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from pipeline.run import checks
from pipeline.run.config import WHAT, JobConfig, default_runs_root
from pipeline.tasks import TASKS
from rcr.config import ConfigError

GROUPS = ("what to run", "where results go", "resources", "faults and input limits")
TYPES = {"int": int, "float": float, "str": str, "int | None": int, "float | None": float, "str | None": str}


def _epilog(task: str | None) -> str:
    script = f"jobs/{task}.py" if task else "jobs/eval.py --task detailcaps"
    shards = task or "detailcaps"
    return (
        "examples:\n"
        f"  python {script} --limit 8\n"
        "      the embedded model on its synthetic scenes, the first 8 samples, every method\n"
        f"  python {script} --model Qwen/Qwen2-VL-7B-Instruct --shards /data/shards/{shards} \\\n"
        "      --methods full,bacon,exact,fixed,rcr --num-actors 8 --device cuda\n"
        "      a real model on converted shards (jobs/prepare_data.py), one GPU per actor\n"
        "\n"
        "Each method's own fields (NAME@FIELD=VALUE):\n"
        + "".join(f"  {line}\n" for line in _method_lines()) +
        "\nResults: Parquet rows in the output dir, runs in MLflow; the job prints both at the end. On a running\n"
        f"cluster: ray job submit --working-dir . -- python {script} ... (docs/cluster.md)."
    )


def _method_lines() -> list[str]:
    from rcr.methods import METHODS
    from rcr.methods.knobs import knob_fields

    return [f"{name}: " + (", ".join(f"{f.name}={f.default}" for f in knob_fields(cls).values()) or "-")
            for name, cls in METHODS.items()]


def _shown(f: dataclasses.Field, task: str | None, runs) -> str:
    """The default as ``--help`` states it: what :meth:`JobConfig.validate` fills in."""
    from pipeline.run.checks import available_methods

    if f.name == "max_new_tokens":
        return ", ".join(f"{t} {x.max_new_tokens}" for t, x in TASKS.items() if task in (None, t))
    if f.name == "methods":
        return f"all: {', '.join(available_methods())}"
    shown = f.metadata["shown"]
    if shown is None:
        shown = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return str(shown).replace("<runs dir>", str(runs))


def _add(group, f: dataclasses.Field, task: str | None, runs) -> None:
    meta, extra = f.metadata, dict(f.metadata["flag"])
    name = extra.pop("name", "--" + f.name.replace("_", "-"))
    if extra.pop("hidden", False):
        group.add_argument(name, dest=f.name, help=argparse.SUPPRESS)
        return
    help = f"{meta['help']} (default: {_shown(f, task, runs)})".replace("<runs dir>", str(runs)).replace("%", "%%")
    if f.name == "task":
        extra["choices"] = list(TASKS)
    elif meta["choices"] is not None:
        extra["choices"] = list(meta["choices"])
    if extra.get("action") in ("store_true", "store_false"):
        extra["default"] = None
    elif "action" not in extra:
        extra["type"] = TYPES.get(str(f.type), str)
    group.add_argument(name, dest=f.name, help=help, **extra)


def build_arg_parser(task: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``jobs/eval.py`` (``task`` None: ``--task`` is a flag) or of ``jobs/<task>.py``."""
    runs = default_runs_root()
    p = argparse.ArgumentParser(
        description=f"Run {'the ' + task if task else 'an'} evaluation job: every method on every sample, one Parquet "
                    "row per (sample, method).",
        epilog=_epilog(task), formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = {g: p.add_argument_group(g) for g in GROUPS}
    for f in dataclasses.fields(JobConfig):
        group = f.metadata["group"]
        if f.metadata["flag"].get("hidden"):
            _add(p, f, task, runs)
        elif group is not None and not (f.name == "task" and task is not None):
            _add(groups[group], f, task, runs)
    groups[WHAT].add_argument("--config", help="YAML file of JobConfig fields; flags override it (default: none)")
    return p


def job_config(argv: list[str] | None = None, *, task: str | None = None) -> JobConfig:
    """The validated config of a job's command line (flags, and ``--config file.yaml``, which flags override);
    ``task`` is the entry point's fixed task."""
    ns = build_arg_parser(task).parse_args(argv)
    overrides = {k: v for k, v in vars(ns).items() if k != "config" and v is not None}
    if "rcr" in overrides:
        overrides["rcr"] = checks.parse_kv_list(overrides["rcr"])
    if task is not None:
        overrides.setdefault("task", task)
    base: dict[str, Any] = {}
    if ns.config:
        import yaml

        path = Path(ns.config).expanduser()
        if not path.is_file():
            raise ConfigError("config", f"no such YAML file: {path}")
        base = yaml.safe_load(path.read_text()) or {}
        if not isinstance(base, dict):
            raise ConfigError("config", f"{path} must hold a mapping of field: value")
        if task is not None and base.get("task", task) != task:
            raise ConfigError("task", f"this entry point runs task '{task}', {path} says '{base['task']}'")
        if "rcr" in overrides and isinstance(base.get("rcr"), dict):
            overrides["rcr"] = {**base["rcr"], **overrides["rcr"]}
    return JobConfig.from_dict({**base, **overrides})
