"""The job config's field checks that need more than a type and a range: the model, the methods, the shared
``rcr`` settings, the dataset; and the model's fingerprint that the config hash covers.

Each raises ``ConfigError`` (``rcr.config``) naming the field, before Ray starts and before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from pathlib import Path
from typing import Any

from rcr.config import ConfigError
from rcr.embedded import DIRECTORIES as EMBEDDED_MODELS
from rcr.embedded import is_embedded
from rcr.embedded import model_dir as embedded_model_dir

EMBEDDED = "embedded"  # the default model (rcr/embedded_model/), and --shards' word for the synthetic shards

# The shape of a Hub id (`owner/name`, or a legacy bare name). Whether it resolves (local cache, or the Hub when
# online) and is a supported family is the driver's pre-flight (pipeline/run/preflight.py).
HUB_ID = re.compile(r"[\w][\w.-]*(/[\w][\w.-]*)?")

# Pipeline defaults that differ from the library's: `full` rows record the most-attended prefix position, so
# the attention-stability analysis has its input (costs one exact prefix scan per layer-step of `full` only).
RCR_PIPELINE_DEFAULTS = {"record_attention": True}


def as_list(name: str, value: Any) -> list[str]:
    """A non-empty list of strings; a string is split on commas."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(name, f"must be a non-empty list of strings, got {value!r}")
    return list(value)


def method_labels(value: Any) -> list[str]:
    """``--methods``: labels separated by commas, where a piece with ``=`` and no ``@`` continues the label before
    it (``rcr@rho=0.3,step=0.1,bacon`` is two labels: ``rcr@rho=0.3,step=0.1`` and ``bacon``)."""
    from rcr.methods.knobs import join_labels

    return join_labels(as_list("methods", value))


def available_methods() -> list[str]:
    """The registered methods, in the registry's (display) order."""
    from rcr.methods import METHODS

    return list(METHODS)


# The names under which the config hash has always recorded the built-in methods' knob defaults: one flat mapping,
# each knob under its own name or, where two methods' knobs share a name, the name given here. Kept as they are so
# that every existing output keeps its config hash. A method registered since is recorded by method, and only in the
# hash of a job that runs it (:func:`hashed_knob_defaults`), so that installing one re-keys no other job.
HASH_NAMES: dict[str, dict[str, str]] = {
    "full": {}, "bacon": {}, "prefill_oracle": {"pool": "oracle_pool"}, "exact": {}, "fixed": {"tau": "fixed_tau"},
    "rcr": {}, "rcr_layer": {}, "quest": {"reduction": "quest_reduction"},
    "arkvale": {"rule": "arkvale_rule", "groups": "arkvale_groups"},
    "infinigen": {"partial_ratio": "infinigen_partial_ratio", "calibration": "infinigen_calibration",
                  "layer0": "infinigen_layer0"},
    "refreshkv": {"rule": "refreshkv_rule"},
}


def hashed_knob_defaults(methods: list[str]) -> dict[str, Any]:
    """The knob defaults a job's config hash covers: every built-in method's (:data:`HASH_NAMES`), flat, and, under
    ``method_knobs``, those of the other methods among ``methods`` (the job's labels), by method."""
    from rcr.methods import knob_defaults
    from rcr.methods.knobs import split_label

    record = knob_defaults()
    out: dict[str, Any] = {}
    for name, renamed in HASH_NAMES.items():
        for knob, default in record.get(name, {}).items():
            key = renamed.get(knob, knob)
            if out.get(key, default) != default:
                raise ValueError(f"config hash: {name}.{knob} and another method's knob would both be {key!r}, "
                                 f"with defaults {default!r} and {out[key]!r}: give {name}.{knob} its own name in "
                                 "HASH_NAMES")
            out[key] = default
    others = {n: record[n] for n in sorted({split_label(m)[0] for m in methods} - HASH_NAMES.keys()) if n in record}
    return {**out, "method_knobs": others} if others else out


def validate_methods(methods: Any, rcr_values: dict) -> list[str]:
    """Validate each label, with its knobs, against the job's shared settings (``rcr``); ``all`` expands to
    :func:`available_methods`; ``full`` always comes first; duplicates are dropped."""
    from rcr import RCRConfig
    from rcr.methods import parse_method

    config = RCRConfig.from_dict(rcr_values)
    out: list[str] = []
    for m in (x for label in method_labels(methods) for x in (available_methods() if label == "all" else [label])):
        try:
            parse_method(m, config)
        except ConfigError as e:
            # parse_method's own errors (field "method") name the method already; a knob's error names the label
            raise ConfigError("methods", e.message if e.field == "method" else f"{m!r}: {e.message} ({e.field})") \
                from None
        if m not in out:
            out.append(m)
    if "full" in out:
        out.remove("full")
    return ["full", *out]


def validate_rcr(values: Any) -> dict[str, Any]:
    """The shared ``rcr.RCRConfig`` settings (errors name ``rcr.<field>``); returns every field. A method's own knob
    is refused with where it goes: its label."""
    import rcr
    from rcr.methods import METHODS
    from rcr.methods.knobs import knob_fields

    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError("rcr", f"must be a mapping of RCRConfig fields, got {values!r}")
    names = {f.name for f in dataclasses.fields(rcr.RCRConfig)}
    for k in values:
        if k in names:
            continue
        owners = [n for n, cls in METHODS.items() if k in knob_fields(cls) or k in HASH_NAMES.get(n, {}).values()]
        where = (f"it is a setting of {', '.join(owners)}: give it in the method's label, e.g. --methods "
                 f"{owners[0]}@FIELD=VALUE (rcr.methods.describe_methods() lists each method's fields)" if owners
                 else f"known: {', '.join(sorted(names))}")
        raise ConfigError(f"rcr.{k}", f"not a shared RCRConfig field; {where}")
    try:
        return rcr.RCRConfig(**{**RCR_PIPELINE_DEFAULTS, **values}).to_dict()
    except ConfigError as e:
        raise ConfigError(e.field.replace("RCRConfig.", "rcr."), e.message) from None


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


def validate_model(model: Any) -> None:
    if not isinstance(model, str) or not model:
        raise ConfigError("model", f"must be a non-empty string, got {model!r}")
    if is_embedded(model):
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
                                   f"or an embedded model ({', '.join(EMBEDDED_MODELS)})")


def model_slug(model: str) -> str:
    name = Path(model).name if Path(model).expanduser().exists() else model.rsplit("/", 1)[-1]
    return re.sub(r"[^\w.-]+", "-", name).strip("-").lower() or "model"


def model_fingerprint(model: str) -> str:
    """For local checkpoints: config.json and the weight files' contents, so that a retrained model in the same
    directory (the same architecture, so the same file sizes) never resumes another model's rows. A Hub id is
    its own fingerprint."""
    p = embedded_model_dir(model) if is_embedded(model) else Path(model).expanduser()
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


def parse_kv_list(items: list[str]) -> dict[str, Any]:
    """``--rcr KEY=VALUE`` (repeatable): values read as YAML scalars (``true``, ``0.5``, ``none``)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError("rcr", f"expected key=value, got '{item}'")
        k, v = item.split("=", 1)
        out[k.strip()] = yaml.safe_load(v)
    return out
