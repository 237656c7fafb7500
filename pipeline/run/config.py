"""One typed job config for the evaluation pipeline, validated up front.

A job is configured by a YAML file (``--config job.yaml``) and/or command-line flags; flags override the
file. Every check that can fail runs here, in the driver, before Ray starts and before any model is
loaded, and every error names the field it is about::

    config error: field 'max_new_tokens': must be an integer between 1 and 8192, got 0

Output and tracking locations are resolved to absolute paths (``ray job submit --working-dir`` runs the
driver inside a temporary copy of the repository, so a relative path would be lost with it).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.schema import METHOD_ORDER
from pipeline.tasks import TASKS
from rcr.embedded import model_dir as embedded_model_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = "embedded"
EMBEDDED_MODEL_DIR = embedded_model_dir()  # package data of rcr: rcr/embedded_model/

MAX_NEW_TOKENS_LIMIT = 8192

# The shape of a Hub id (`owner/name`, or a legacy bare name). Whether it resolves (local cache, or the Hub when
# online) and is a supported family is the driver's pre-flight (pipeline/preflight.py).
HUB_ID = re.compile(r"[\w][\w.-]*(/[\w][\w.-]*)?")

# Fields whose value changes what a row contains. They make the config hash; a rerun resumes only rows
# written under the same hash.
HASHED_FIELDS = ("task", "model", "max_new_tokens", "dtype", "rcr", "max_image_pixels", "max_frames", "engine")


class ConfigError(ValueError):
    """A bad job config. ``field`` names the offending field."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"config error: field '{field}': {message}")


def default_max_new_tokens(task: str) -> int:
    """The task's default output length (what validate() fills in); a ConfigError naming 'task' if unknown."""
    if task not in TASKS:
        raise ConfigError("task", f"unknown task '{task}'; choose one of {', '.join(TASKS)}")
    return TASKS[task].max_new_tokens


def default_runs_root() -> Path:
    return Path(os.environ.get("RCR_RUNS_DIR", Path.home() / "rcr-runs")).expanduser().resolve()


def default_tracking_uri() -> str:
    """The store every entry point uses unless told otherwise: ``<runs dir>/mlflow.db`` (the local cluster's MLflow
    server serves the same one; pipeline/analysis/mlflow_store.py)."""
    return f"sqlite:///{default_runs_root() / 'mlflow.db'}"


@dataclass
class JobConfig:
    """Everything a pipeline job needs. Construct with :meth:`from_args` / :meth:`from_dict`, which validate."""

    task: str = "detailcaps"
    model: str = EMBEDDED  # "embedded", a local checkpoint dir, or a supported hub id
    shards: list[str] = field(default_factory=lambda: [EMBEDDED])  # parquet files, dirs or globs; "embedded"
    dataset: str | None = None  # instead of shards: "NAME[:split]", the task's HF dataset or a local copy of it
    methods: list[str] = field(default_factory=lambda: ["all"])  # "all": every method the core provides
    max_new_tokens: int | None = None  # None: the task's (pipeline/tasks/)
    limit: int | None = None  # first N input rows, in shard order
    batch_size: int = 4  # samples per model call (left-padded batch) and per Ray batch
    num_actors: int = 1
    output_dir: str | None = None  # None: ~/rcr-runs/<job_name>
    mlflow_uri: str | None = None  # None: sqlite:///~/rcr-runs/mlflow.db (absolute)
    experiment: str = "rcr-eval"
    job_name: str | None = None  # None: "<task>-<model slug>"
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16 | float16
    gpus_per_actor: float | None = None  # None: 1 where the cluster has GPUs, else 0
    cpus_per_actor: float | None = None  # None: 1 with GPUs; on CPU-only, what leaves room for readers
    torch_threads: int | None = None  # None: the actor's CPU share
    max_restarts: int = -1  # actor restarts (-1: unlimited)
    # retries of a batch whose actor died (-1: unlimited). Ray counts each failed call to an unreachable actor: a
    # lost node uses up a small count before Ray marks the actor as restarting (ray-project/ray#25457)
    max_task_retries: int = -1
    max_image_pixels: int = 50_000_000  # bigger images are bad inputs (decompression-bomb guard)
    max_image_bytes: int = 64 * 2**20
    max_frames: int = 64
    trust_remote_code: bool = False
    rcr: dict[str, Any] = field(default_factory=dict)  # rcr.RCRConfig fields
    ray_address: str | None = None  # None: RAY_ADDRESS or a running local cluster, else an in-process one
    progress_every_s: float = 10.0
    summary: bool = True  # print the per-method summary and log to MLflow at the end
    engine: str = "rcr"  # the model backend: "rcr" (the core library), or "module:Class" (tests, other backends)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, validate: bool = True) -> JobConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in names:
                raise ConfigError(key, f"unknown field; known fields: {', '.join(sorted(names))}")
        cfg = cls(**{k: v for k, v in data.items()})
        if validate:
            cfg.validate()
        return cfg

    @classmethod
    def from_args(cls, argv: list[str] | None = None, *, task: str | None = None) -> JobConfig:
        """Parse flags (and ``--config file.yaml``); ``task`` is the entry point's fixed task."""
        from pipeline.run.cli import build_arg_parser

        parser = build_arg_parser(task)
        ns = parser.parse_args(argv)
        overrides: dict[str, Any] = {}
        for key, value in vars(ns).items():
            if key == "config" or value is None:
                continue
            if key == "rcr":
                overrides["rcr"] = _parse_kv_list(value)
                continue
            overrides[key] = value
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
        return cls.from_dict({**base, **overrides})

    # ------------------------------------------------------------------ validation

    def validate(self) -> JobConfig:
        """Check every field; fill the task-dependent defaults. Raises :class:`ConfigError`."""
        default_length = default_max_new_tokens(self.task)  # also the task check: before anything reads the task
        if self.max_new_tokens is None:
            self.max_new_tokens = default_length
        _int_range("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS_LIMIT)
        if self.limit is not None:
            _int_range("limit", self.limit, 1, None)
        _int_range("batch_size", self.batch_size, 1, 4096)
        _int_range("num_actors", self.num_actors, 1, 4096)
        _int_range("max_restarts", self.max_restarts, -1, None)
        _int_range("max_task_retries", self.max_task_retries, -1, None)
        _int_range("max_image_pixels", self.max_image_pixels, 1, None)
        _int_range("max_image_bytes", self.max_image_bytes, 1, None)
        _int_range("max_frames", self.max_frames, 1, None)
        if self.torch_threads is not None:
            _int_range("torch_threads", self.torch_threads, 1, 1024)
        for name in ("gpus_per_actor", "cpus_per_actor"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
                raise ConfigError(name, f"must be a number >= 0, got {v!r}")
        if not isinstance(self.progress_every_s, (int, float)) or self.progress_every_s <= 0:
            raise ConfigError("progress_every_s", f"must be a number > 0, got {self.progress_every_s!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError("device", f"must be auto, cpu or cuda, got '{self.device}'")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError("dtype", f"must be auto, float32, bfloat16 or float16, got '{self.dtype}'")
        if not isinstance(self.experiment, str) or not self.experiment:
            raise ConfigError("experiment", "must be a non-empty string")
        if not isinstance(self.engine, str) or not (self.engine == "rcr" or re.fullmatch(r"[\w.]+:\w+", self.engine)):
            raise ConfigError("engine", f"must be 'rcr' or 'module:Class', got {self.engine!r}")
        self.methods = _as_list("methods", self.methods)
        self.shards = _as_list("shards", self.shards)
        if self.dataset is not None:
            self.dataset = validate_dataset(self.dataset, self.task, self.shards)
        self.methods = validate_methods(self.methods)
        validate_model(self.model)
        self.rcr = validate_rcr(self.rcr)
        if self.job_name is None:
            self.job_name = f"{self.task}-{model_slug(self.model)}"
        if not re.fullmatch(r"[\w.@+-]+", self.job_name):
            raise ConfigError("job_name", f"use letters, digits and . _ - @ + only, got '{self.job_name}'")
        runs = default_runs_root()
        if self.output_dir is None:
            self.output_dir = str(runs / self.job_name)
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

    @property
    def config_hash(self) -> str:
        """12 hex digits over the fields that change a row's content (not limit, batching, paths)."""
        payload = {k: getattr(self, k) for k in HASHED_FIELDS}
        payload["model_fingerprint"] = model_fingerprint(self.model)
        blob = json.dumps(payload, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def model_path(self) -> str:
        """What the loader gets: the embedded model's directory, or the name/path as given."""
        if self.model == EMBEDDED:
            return str(EMBEDDED_MODEL_DIR)
        p = Path(self.model).expanduser()
        return str(p.resolve()) if p.exists() else self.model


# ---------------------------------------------------------------------- field checks


def _int_range(name: str, value: Any, lo: int | None, hi: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise ConfigError(name, f"must be an integer {bounds}, got {value}")


def _as_list(name: str, value: Any) -> list[str]:
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(name, f"must be a non-empty list of strings, got {value!r}")
    return list(value)


def validate_dataset(spec: Any, task: str, shards: list[str]) -> str:
    """``--dataset NAME[:split]``: one the task's converter reads (``pipeline/data/convert.py``), not with --shards."""
    from pipeline.data.convert import parse_dataset
    from pipeline.data.shards import DataError

    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("dataset", f"must be NAME[:split], got {spec!r}")
    if shards != [EMBEDDED]:
        raise ConfigError("dataset", "give --dataset or --shards, not both")
    try:
        parse_dataset(spec.strip(), task)
    except DataError as e:
        raise ConfigError("dataset", str(e)) from None
    return spec.strip()


def available_methods() -> list[str]:
    """The methods the core provides, in ``METHOD_ORDER`` (then any others, alphabetically)."""
    from rcr.methods import METHODS

    return [m for m in METHOD_ORDER if m in METHODS] + sorted(m for m in METHODS if m not in METHOD_ORDER)


def validate_methods(methods: list[str]) -> list[str]:
    """Validate each label with the core's parser; ``all`` expands to :func:`available_methods`; ``full``
    always comes first; duplicates are dropped."""
    from rcr.methods import parse_method

    out: list[str] = []
    expanded: list[str] = []
    for m in methods:
        expanded.extend(available_methods() if m == "all" else [m])
    for m in expanded:
        try:
            parse_method(m)
        except (ValueError, KeyError) as e:
            raise ConfigError("methods", f"unknown method '{m}': {e}") from None
        if m not in out:
            out.append(m)
    if "full" in out:
        out.remove("full")
    return ["full", *out]


def validate_model(model: Any) -> None:
    if not isinstance(model, str) or not model:
        raise ConfigError("model", f"must be a non-empty string, got {model!r}")
    if model == EMBEDDED:
        return  # the embedded checkpoint's presence is checked by the driver (it may be built after config)
    p = Path(model).expanduser()
    if p.exists():
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            raise ConfigError("model", f"local checkpoint {p} has no config.json")
        try:
            model_type = json.loads(cfg_file.read_text()).get("model_type")
        except json.JSONDecodeError as e:
            raise ConfigError("model", f"{cfg_file} is not valid JSON: {e}") from None
        from rcr.models import SUPPORTED

        if model_type not in SUPPORTED:
            raise ConfigError("model", f"{p}: model_type {model_type} is not supported; "
                                       f"supported: {', '.join(SUPPORTED)}")
        return
    if not HUB_ID.fullmatch(model):
        raise ConfigError("model", f"'{model}' is not a local checkpoint directory, a Hub id (owner/name) "
                                   "or 'embedded'")


# Pipeline defaults that differ from the library's: `full` rows record the most-attended prefix position, so
# the attention-stability analysis has its input (costs one exact prefix scan per layer-step of `full` only).
RCR_PIPELINE_DEFAULTS = {"record_attention": True}


def validate_rcr(values: Any) -> dict[str, Any]:
    """Validate the `rcr` mapping with rcr.RCRConfig (errors name `rcr.<field>`); returns every field."""
    import rcr

    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError("rcr", f"must be a mapping of RCRConfig fields, got {values!r}")
    names = {f.name for f in dataclasses.fields(rcr.RCRConfig)}
    for k in values:
        if k not in names:
            raise ConfigError(f"rcr.{k}", f"unknown RCRConfig field; known: {', '.join(sorted(names))}")
    try:
        return rcr.RCRConfig(**{**RCR_PIPELINE_DEFAULTS, **values}).to_dict()
    except (TypeError, ValueError) as e:
        raise ConfigError("rcr", str(e)) from None


def model_slug(model: str) -> str:
    name = Path(model).name if Path(model).expanduser().exists() else model.rsplit("/", 1)[-1]
    return re.sub(r"[^\w.-]+", "-", name).strip("-").lower() or "model"


def model_fingerprint(model: str) -> str:
    """For local checkpoints: config.json and the weight files' contents, so that a retrained model in the same
    directory (the same architecture, so the same file sizes) never resumes another model's rows. A Hub id is
    its own fingerprint."""
    p = EMBEDDED_MODEL_DIR if model == EMBEDDED else Path(model).expanduser()
    if not p.is_dir():
        return model
    h = hashlib.sha256()
    cfg = p / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for f in sorted(p.glob("*.safetensors")) + sorted(p.glob("*.bin")):
        st = f.stat()
        h.update(f"{f.name}:{_file_digest(str(f.resolve()), st.st_size, st.st_mtime_ns)}".encode())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=64)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a file's bytes, memoised per (path, size, mtime): ``config_hash`` is read several times a job,
    and a real checkpoint's shards are GBs (about a second per GB)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _parse_kv_list(items: list[str]) -> dict[str, Any]:
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError("rcr", f"expected key=value, got '{item}'")
        k, v = item.split("=", 1)
        out[k.strip()] = yaml.safe_load(v)
    return out
