"""One typed job config for the evaluation pipeline, validated up front.

A job is configured by a YAML file (``--config job.yaml``) and/or command-line flags; flags override the file.
Each field carries its own help, its ``--help`` group and its range (``_f``): the command line
(``pipeline/run/cli.py``) and the generic checks are generated from them, so a field is defined once. Every check
that can fail runs here, in the driver, before Ray starts and before any model is loaded, and every error names
the field it is about (``rcr.config.ConfigError``)::

    config error: field 'max_new_tokens': must be an integer between 1 and 8192, got 0

Output and tracking locations are resolved to absolute paths (``ray job submit --working-dir`` runs the
driver inside a temporary copy of the repository, so a relative path would be lost with it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.paths import default_runs_root, default_tracking_uri  # noqa: F401 - API
from pipeline.run import checks
from pipeline.run.checks import EMBEDDED, available_methods, model_slug  # noqa: F401 - API
from pipeline.tasks import TASKS
from rcr.config import MAX_IMAGE_TOKENS, ConfigError
from rcr.embedded import is_embedded
from rcr.embedded import model_dir as embedded_model_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_NEW_TOKENS_LIMIT = 8192

# Fields whose value changes what a row contains. They make the config hash; a rerun resumes only rows
# written under the same hash.
HASHED_FIELDS = ("task", "model", "max_new_tokens", "dtype", "rcr", "max_image_pixels", "max_image_tokens",
                 "max_frames", "engine")

WHAT, WHERE, RESOURCES, FAULTS = "what to run", "where results go", "resources", "faults and input limits"


def default_max_new_tokens(task: str) -> int:
    """The task's default output length (what validate() fills in); a ConfigError naming 'task' if unknown."""
    if task not in TASKS:
        raise ConfigError("task", f"unknown task '{task}'; choose one of {', '.join(TASKS)}")
    return TASKS[task].max_new_tokens


def _f(default: Any = None, help: str = "", group: str | None = None, *, factory=None, shown: str | None = None,
       kind: type | None = None, lo: float | None = None, hi: float | None = None, choices: tuple | None = None,
       flag: dict | None = None):
    """A JobConfig field. ``help`` and ``group`` make its ``--help`` entry (no group: not a flag); ``shown`` is the
    default as ``--help`` states it (else the default itself); ``kind``/``lo``/``hi``/``choices`` are the generic
    check (None passes: a default filled in later); ``flag``: extra ``argparse`` arguments (nargs, action, metavar)."""
    meta = {"help": help, "group": group, "shown": shown, "kind": kind, "lo": lo, "hi": hi, "choices": choices,
            "flag": flag or {}}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class JobConfig:
    """Everything a pipeline job needs. Construct with ``pipeline.run.cli.job_config`` (a command line) or
    :meth:`from_dict`; both validate."""

    task: str = _f("detailcaps", "which task (pipeline/tasks/)", WHAT)
    model: str = _f(EMBEDDED, "'embedded' (the small synthetic-scene model shipped in rcr/embedded_model), "
                    "'embedded-drift' (its test bed whose samples drift at different scales), a local checkpoint "
                    "dir, or e.g. Qwen/Qwen2-VL-7B-Instruct", WHAT)
    shards: list[str] = _f(help="Parquet shard files/dirs/globs in the input schema, or 'embedded': the synthetic "
                           "shards of the model's scene layout, generated once under <runs dir>/shards", group=WHAT,
                           factory=lambda: [EMBEDDED],
                           shown="embedded", flag={"nargs": "+"})
    dataset: str | None = _f(None, "instead of --shards: NAME[:split], the task's Hugging Face dataset by name "
                             "(foundation-multimodal-models/DetailCaps-4870, lmms-lab/TextCaps, or the task name) at "
                             "its pinned revision, or a local save_to_disk directory or Parquet file/folder of it; "
                             "converted in full once, into <runs dir>/datasets (the split defaults to the pinned one)",
                             WHAT, shown="none")
    methods: list[str] = _f(help="comma-separated method labels, or 'all'; NAME@FIELD=VALUE,... sets a method's own "
                            "fields (rcr@rho=0.3, arkvale@rule=recall) and fixed@TAU fixed's threshold (e.g. "
                            "fixed@0.05,fixed@0.1 for a sweep); full is always run", group=WHAT,
                            factory=lambda: ["all"], shown="all")
    max_new_tokens: int | None = _f(None, "generated tokens per sample and method, at most", WHAT, kind=int, lo=1,
                                    hi=MAX_NEW_TOKENS_LIMIT)
    limit: int | None = _f(None, "first N input rows, in shard order", WHAT, shown="every row", kind=int, lo=1)
    rcr: dict[str, Any] = _f(help="a shared rcr.RCRConfig field, repeatable (a method's own go in its label)",
                             group=WHAT, factory=dict, shown="the paper's values, and record_attention=true",
                             flag={"action": "append", "metavar": "KEY=VALUE"})
    output_dir: str | None = _f(None, "Parquet output directory", WHERE, shown="<runs dir>/<job name>")
    mlflow_uri: str | None = _f(None, "MLflow tracking URI", WHERE, shown="sqlite:///<runs dir>/mlflow.db")
    experiment: str = _f("rcr-eval", "MLflow experiment", WHERE)
    job_name: str | None = _f(None, "names the output dir and the MLflow parent run", WHERE,
                              shown="<task>-<model name>, e.g. detailcaps-embedded")
    progress_every_s: float = _f(10.0, "seconds between progress lines", WHERE)
    summary: bool = _f(True, "skip the per-method summary and the MLflow logging at the end", WHERE,
                       shown="both run", flag={"name": "--no-summary", "action": "store_false"})
    batch_size: int = _f(4, "samples per model call (left-padded) and per Ray batch", RESOURCES, kind=int, lo=1,
                         hi=4096)
    num_actors: int = _f(1, "model actors, each holding one copy of the model", RESOURCES, kind=int, lo=1, hi=4096)
    device: str = _f("auto", "where each actor runs the model; auto: cuda when the actor has a GPU", RESOURCES,
                     choices=("auto", "cpu", "cuda"))
    dtype: str = _f("auto", "model dtype; auto: bfloat16 on GPU, float32 on CPU", RESOURCES,
                    choices=("auto", "float32", "bfloat16", "float16"))
    gpus_per_actor: float | None = _f(None, "GPUs per actor", RESOURCES, shown="1 where the cluster has GPUs, else 0",
                                      kind=float, lo=0)
    cpus_per_actor: float | None = _f(None, "CPUs per actor", RESOURCES, shown="1 with GPUs; on CPU-only clusters "
                                      "what leaves 1 CPU for the readers", kind=float, lo=0)
    torch_threads: int | None = _f(None, "torch threads per actor", RESOURCES, shown="1 on CPU, 4 with a GPU",
                                   kind=int, lo=1, hi=1024)
    ray_address: str | None = _f(None, "Ray cluster to join; 'auto' joins a running one", RESOURCES,
                                 shown="the cluster of `ray job submit`, else a private local Ray")
    max_restarts: int = _f(-1, "restarts of a dead actor, -1 unlimited", FAULTS, kind=int, lo=-1)
    # retries of a batch whose actor died (-1: unlimited). Ray counts each failed call to an unreachable actor: a
    # lost node uses up a small count before Ray marks the actor as restarting (ray-project/ray#25457)
    max_task_retries: int = _f(-1, "retries of a batch whose actor died, -1 unlimited", FAULTS, kind=int, lo=-1)
    max_image_pixels: int = _f(50_000_000, "larger images become error rows (decompression-bomb guard)", FAULTS,
                               kind=int, lo=1)
    max_image_tokens: int = _f(MAX_IMAGE_TOKENS, "Qwen-family models: an image's visual tokens at most; a larger "
                               "image is downscaled, aspect kept (rcr.config.MAX_IMAGE_TOKENS)", FAULTS, kind=int,
                               lo=1)
    max_image_bytes: int = _f(64 * 2**20, "larger encoded images become error rows", kind=int, lo=1)
    max_frames: int = _f(64, "videos with more frames become error rows", kind=int, lo=1)
    trust_remote_code: bool = _f(False, "allow a hub model's own code", FAULTS, shown="off",
                                 flag={"action": "store_true"})
    # the model backend: "rcr" (the core library), or "module:Class" (the tests' fake engines; accepted, not listed)
    engine: str = _f("rcr", flag={"hidden": True})

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, validate: bool = True) -> JobConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in names:
                raise ConfigError(key, f"unknown field; known fields: {', '.join(sorted(names))}")
        cfg = cls(**data)
        if validate:
            cfg.validate()
        return cfg

    # ------------------------------------------------------------------ validation

    def _check_fields(self) -> None:
        """The generic checks of every field's metadata: type, range, choices."""
        for f in dataclasses.fields(self):
            m, v = f.metadata, getattr(self, f.name)
            if v is None:
                continue
            if m["choices"] is not None and v not in m["choices"]:
                raise ConfigError(f.name, f"must be one of {', '.join(map(str, m['choices']))}, got {v!r}")
            kind = m["kind"]
            if kind is None:
                continue
            ok = not isinstance(v, bool) and isinstance(v, (int, float) if kind is float else int)
            bounds = (f"between {m['lo']:g} and {m['hi']:g}" if m["hi"] is not None
                      else f">= {m['lo']:g}" if m["lo"] is not None else "")
            what = f"{'an integer' if kind is int else 'a number'}{' ' + bounds if bounds else ''}"
            if not ok or (m["lo"] is not None and v < m["lo"]) or (m["hi"] is not None and v > m["hi"]):
                raise ConfigError(f.name, f"must be {what}, got {v!r}")

    def validate(self) -> JobConfig:
        """Check every field; fill the task-dependent defaults. Raises :class:`ConfigError`."""
        default_length = default_max_new_tokens(self.task)  # also the task check: before anything reads the task
        if self.max_new_tokens is None:
            self.max_new_tokens = default_length
        self._check_fields()
        if isinstance(self.progress_every_s, bool) or not isinstance(self.progress_every_s, (int, float)) \
                or self.progress_every_s <= 0:
            raise ConfigError("progress_every_s", f"must be a number > 0, got {self.progress_every_s!r}")
        if not isinstance(self.experiment, str) or not self.experiment:
            raise ConfigError("experiment", "must be a non-empty string")
        if not isinstance(self.engine, str) or not (self.engine == "rcr" or re.fullmatch(r"[\w.]+:\w+", self.engine)):
            raise ConfigError("engine", f"must be 'rcr' or 'module:Class', got {self.engine!r}")
        self.shards = checks.as_list("shards", self.shards)
        if self.dataset is not None:
            self.dataset = checks.validate_dataset(self.dataset, self.task, self.shards)
        checks.validate_model(self.model)
        self.rcr = checks.validate_rcr(self.rcr)
        self.methods = checks.validate_methods(self.methods, self.rcr)
        if self.job_name is None:
            self.job_name = f"{self.task}-{model_slug(self.model)}"
        if not re.fullmatch(r"[\w.@+-]+", self.job_name):
            raise ConfigError("job_name", f"use letters, digits and . _ - @ + only, got '{self.job_name}'")
        if self.output_dir is None:
            self.output_dir = str(default_runs_root() / self.job_name)
        self.output_dir = str(Path(self.output_dir).expanduser().resolve())
        if Path(self.output_dir).exists() and not Path(self.output_dir).is_dir():
            raise ConfigError("output_dir", f"{self.output_dir} exists and is not a directory")
        if self.mlflow_uri is None:
            self.mlflow_uri = default_tracking_uri()
        if not isinstance(self.mlflow_uri, str) or not self.mlflow_uri:
            raise ConfigError("mlflow_uri", f"must be a non-empty string, got {self.mlflow_uri!r}")
        from pipeline.analysis.tracking import resolve_tracking_uri

        self.mlflow_uri = resolve_tracking_uri(self.mlflow_uri)
        return self

    # ------------------------------------------------------------------ derived values

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def record(self) -> dict[str, Any]:
        """The config as a job records it (run record, MLflow's params): its fields, and every method's knob
        defaults by method (``method_knobs``), which the config hash also covers."""
        from rcr.methods import knob_defaults

        return {**self.to_dict(), "method_knobs": knob_defaults()}

    @property
    def config_hash(self) -> str:
        """12 hex digits over the fields that change a row's content (not limit, batching, paths). ``rcr`` counts
        with the methods' knob defaults (``checks.hashed_knob_defaults``): a changed default re-keys the outputs,
        while a knob set in a label is part of that label, the rows' key."""
        payload = {k: getattr(self, k) for k in HASHED_FIELDS}
        payload["rcr"] = {**checks.hashed_knob_defaults(checks.method_labels(self.methods)), **self.rcr}
        payload["model_fingerprint"] = checks.model_fingerprint(self.model)
        blob = json.dumps(payload, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def dtype_on(self, device: str) -> str:
        """The model dtype on ``device`` ("cuda" or "cpu"): ``dtype``, where ``auto`` is bfloat16 on a GPU and
        float32 on a CPU (not the checkpoint's own dtype). The actors and the premise check's probes load with it."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device == "cuda" else "float32"

    def model_path(self) -> str:
        """What the loader gets: the embedded model's directory, or the name/path as given."""
        if is_embedded(self.model):
            return str(embedded_model_dir(self.model))
        p = Path(self.model).expanduser()
        return str(p.resolve()) if p.exists() else self.model
