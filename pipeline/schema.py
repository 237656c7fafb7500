"""The pipeline's one definition of its data: the input schema, the output schema and its column names,
and the constructors of an output row and of error rows.

Adding an output column is two edits, both here: its field in ``OUTPUT_SCHEMA`` and its value in
:func:`output_row`. Everything downstream derives from these: ``Col`` (the analysis' column constants),
``ROW_SUMMARIES`` (the per-row numbers averaged per method and logged to each method's MLflow run).

Input schema (one row per sample, the same for every source: DetailCaps, TextCaps, local videos and the
synthetic embedded default):

=============  ======================  ==========================================================
field          type                    meaning
=============  ======================  ==========================================================
sample_id      string, not null        unique within a source
task           string, not null        a registered task (``pipeline/tasks/``)
prompt         string, not null        the user prompt sent with the image(s)
images         list<binary>, not null  encoded image bytes (PNG/JPEG/...); one per frame for video
references     list<string>, not null  reference descriptions, possibly empty
source         string, not null        where it came from: ``synthetic``; ``<hub id>@<commit[:10]>:<split>``
                                       (the commit read); ``<path>@sha256:<12 hex>:<split>`` for a local
                                       copy (the SHA-256 of its split's files); a video folder's path
=============  ======================  ==========================================================
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.tasks import TASKS

# ------------------------------------------------------------------------------------------- input

INPUT_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("task", pa.string(), nullable=False),
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("images", pa.list_(pa.binary()), nullable=False),
        pa.field("references", pa.list_(pa.string()), nullable=False),
        pa.field("source", pa.string(), nullable=False),
    ],
    metadata={"rcr.schema": "input", "rcr.schema_version": "1"},
)


class SchemaError(ValueError):
    """A table or record does not match a project schema; the message names the field (and row)."""


# the 64-bit-offset and view variants other writers produce; a matching column is cast on read
_VARIANTS = {
    pa.string(): (pa.large_string(), pa.string_view()),
    pa.binary(): (pa.large_binary(), pa.binary_view()),
}


def type_matches(actual: pa.DataType, expected: pa.DataType) -> bool:
    """``actual`` is ``expected`` up to string/large_string/string_view, binary/large_binary/binary_view and
    list/large_list (the only Arrow type check in the project). These variants cast to the schema's types;
    list_view does not (pyarrow 25 builds an invalid array), so it is refused by name."""
    if actual.equals(expected):
        return True
    if pa.types.is_list(expected):
        return ((pa.types.is_list(actual) or pa.types.is_large_list(actual))
                and type_matches(actual.value_type, expected.value_type))
    return any(actual.equals(t) for t in _VARIANTS.get(expected, ()))


def validate_input_table(table: pa.Table, where: str = "input table") -> pa.Table:
    """Check ``table`` against ``INPUT_SCHEMA`` and return it cast to exactly that schema.

    Raises ``SchemaError`` naming the offending field (and the first bad row, when it is a value
    problem): a missing column, a column of the wrong type, a null, an empty ``images`` list, an
    unknown ``task`` or a duplicated ``sample_id``. Extra columns are dropped.
    """
    names = set(table.column_names)
    for field in INPUT_SCHEMA:
        if field.name not in names:
            have = ", ".join(table.column_names) or "none"
            raise SchemaError(f"{where}: missing column '{field.name}' (have: {have})")
        actual = table.schema.field(field.name).type
        if not type_matches(actual, field.type):
            raise SchemaError(f"{where}: column '{field.name}' has type {actual}, expected {field.type}")
    table = table.select(INPUT_SCHEMA.names)
    for field in INPUT_SCHEMA:
        col = table.column(field.name)
        if col.null_count:
            row = next(i for i, v in enumerate(col.to_pylist()) if v is None)
            raise SchemaError(f"{where}: column '{field.name}' is null in row {row}")
    tasks = table.column("task").to_pylist()
    for i, t in enumerate(tasks):
        if t not in TASKS:
            raise SchemaError(f"{where}: column 'task' has unknown task {t!r} in row {i}; "
                              f"expected one of {', '.join(TASKS)}")
    for i, imgs in enumerate(table.column("images").to_pylist()):
        if not imgs:
            raise SchemaError(f"{where}: column 'images' is empty in row {i}")
        if any(b is None or len(b) == 0 for b in imgs):
            raise SchemaError(f"{where}: column 'images' holds an empty or null image in row {i}")
    for i, refs in enumerate(table.column("references").to_pylist()):
        if any(r is None for r in refs):
            raise SchemaError(f"{where}: column 'references' holds a null string in row {i}")
    ids = table.column("sample_id").to_pylist()
    if len(set(ids)) != len(ids):
        seen: set = set()
        dup = next(s for s in ids if s in seen or seen.add(s))
        raise SchemaError(f"{where}: column 'sample_id' is not unique (duplicate {dup!r})")
    return table.cast(INPUT_SCHEMA)


def input_table_from_records(records: list[dict], where: str = "records") -> pa.Table:
    """Build (and validate) an input table from a list of row dicts."""
    for i, r in enumerate(records):
        missing = [f for f in INPUT_SCHEMA.names if f not in r]
        if missing:
            raise SchemaError(f"{where}: record {i} is missing field '{missing[0]}'")
    cols = {name: [r[name] for r in records] for name in INPUT_SCHEMA.names}
    try:
        table = pa.table(cols, schema=INPUT_SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        # find the field that does not convert
        for field in INPUT_SCHEMA:
            try:
                pa.array(cols[field.name], type=field.type)
            except (pa.ArrowInvalid, pa.ArrowTypeError) as inner:
                raise SchemaError(f"{where}: field '{field.name}' has a value of the wrong type: {inner}") from e
        raise SchemaError(f"{where}: {e}") from e
    return validate_input_table(table, where)




# ------------------------------------------------------------------------------------------- output
# One Parquet row per (sample_id, method). Documented column by column in README.md ("Output schema").
_F32_LL = pa.list_(pa.list_(pa.float32()))

OUTPUT_SCHEMA = pa.schema([
    # identifiers; (sample_id, method) is the key
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("method", pa.string(), nullable=False),  # "full", "rcr", "fixed@0.05", ...
    pa.field("task", pa.string()),
    pa.field("source", pa.string()),
    pa.field("model", pa.string()),
    pa.field("config_hash", pa.string(), nullable=False),
    pa.field("job_name", pa.string()),
    pa.field("node_id", pa.string()),  # the Ray node whose actor computed the row; null for the driver's own rows
    pa.field("prompt", pa.string()),
    pa.field("references", pa.list_(pa.string())),
    # output
    pa.field("output_text", pa.string()),
    pa.field("output_ids", pa.list_(pa.int32())),
    pa.field("n_steps", pa.int32()),
    pa.field("n_layers", pa.int32()),
    pa.field("prefix_len", pa.int32()),
    # per-row telemetry summaries (ROW_SUMMARIES)
    pa.field("refresh_fraction", pa.float64()),  # mean trigger over valid layer-steps
    pa.field("mean_drift", pa.float64()),
    pa.field("mean_drift_exact", pa.float64()),
    # prefix reads per KV head per layer-step, over the layers the method re-selects (docs/algorithms.md, "Cost
    # per decode step"); ArkVale's own recalls into its page cache apart, null for other methods
    pa.field("keys_read_per_step", pa.float64()),
    pa.field("values_read_per_step", pa.float64()),
    pa.field("recalled_per_step", pa.float64()),
    pa.field("detector_dots_per_step", pa.float64()),
    pa.field("bytes_moved_per_step", pa.float64()),  # host-to-device prefix bytes per decode step (offload)
    # per-layer-step telemetry, [layer][step]
    pa.field("drift", _F32_LL),
    pa.field("drift_exact", _F32_LL),
    pa.field("trigger", pa.list_(pa.list_(pa.bool_()))),  # null for a layer never re-selected (sliding window)
    pa.field("tau", _F32_LL),
    pa.field("top_prefix_pos", pa.list_(pa.list_(pa.int32()))),  # on `full` rows when recorded
    # what an `infinigen` row's skew and partial columns were calibrated on, and the calibration file's sha256
    # (GenerationResult.cost; null on other methods' rows, and the sha256 on per-sample rows)
    pa.field("calibration", pa.string()),
    pa.field("calibration_sha256", pa.string()),
    # timings (of the model call that produced the row; shared by the samples of one batch)
    pa.field("prefill_s", pa.float64()),
    pa.field("decode_s", pa.float64()),
    pa.field("tokens_per_s", pa.float64()),
    pa.field("error", pa.string()),  # null when the row is ok
])

# Column names as constants, derived from the schema: ``Col.MEAN_DRIFT == "mean_drift"``; ``tuple(Col)`` is
# every name in schema order. A misspelt constant fails at import, not as a silently missing column.
Col = namedtuple("Col", [f.name.upper() for f in OUTPUT_SCHEMA])(*OUTPUT_SCHEMA.names)

# The per-row float64 numbers that the analysis averages per method and logs to each method's MLflow run.
ROW_SUMMARIES = tuple(f.name for f in OUTPUT_SCHEMA
                      if pa.types.is_float64(f.type) and f.name not in ("prefill_s", "decode_s"))
TIMING_COLUMNS = ("prefill_s", "decode_s", "tokens_per_s")  # differ from run to run, as node_id; nothing else may


@dataclass(frozen=True)
class JobStamp:
    """The identity columns every row of one job shares."""

    model: str
    config_hash: str
    job_name: str
    task: str  # the job's task: a row's task when its input row has none
    node_id: str | None = None  # the Ray node of the process making the rows (None outside Ray)


def _identity(job: JobStamp, sample: dict, method: str, key: str | None) -> dict:
    refs = sample.get("references")
    return {
        "sample_id": key if key is not None else str(sample.get("sample_id")),
        "method": method,
        "task": sample.get("task") or job.task,
        "source": sample.get("source"),
        "model": job.model,
        "config_hash": job.config_hash,
        "job_name": job.job_name,
        "node_id": job.node_id,
        "prompt": sample.get("prompt"),
        "references": [str(r) for r in refs] if refs is not None else [],
    }


def error_rows(job: JobStamp, sample: dict, methods: list[str], message: str, key: str | None = None) -> list[dict]:
    """One row per method for a sample that could not be evaluated: identity, ``error`` and ``n_steps=0``."""
    return [{**_identity(job, sample, m, key), "error": message, "n_steps": 0} for m in methods]


def _mean(x: np.ndarray | None) -> float | None:
    """Mean over the valid (non-NaN) entries; None when there are none (the column is nullable)."""
    return float(np.nanmean(x)) if x is not None and x.size and not np.all(np.isnan(x)) else None


def _reselected_mean(x: np.ndarray, trigger: np.ndarray) -> float:
    """Mean of x (L, steps) over the layers with a selection (a sliding-window layer's trigger is NaN,
    rcr.telemetry.Telemetry); 0 when there is none (nothing was read)."""
    layers = ~np.isnan(trigger).all(-1)
    return float(x[layers].mean()) if x.size and layers.any() else 0.0


def telemetry_summary(s: dict) -> dict[str, float | None]:
    """The per-row summaries of one sample's trimmed telemetry (``GenerationResult.sample(b)``): means over
    its valid layer-steps (0 for a sample that stopped after one token)."""
    steps = s["drift"].shape[1]
    bytes_moved = s.get("bytes_moved")
    return {
        # over the re-selected layers: a sliding-window layer's trigger is NaN (rcr.telemetry.Telemetry)
        "refresh_fraction": _mean(s["trigger"]) if steps else 0.0,
        "mean_drift": _mean(s["drift"]),
        "mean_drift_exact": _mean(s.get("drift_exact")),
        "keys_read_per_step": _reselected_mean(s["keys_read"], s["trigger"]),
        "values_read_per_step": _reselected_mean(s["values_read"], s["trigger"]),
        "recalled_per_step": _mean(s.get("recalled")),
        "detector_dots_per_step": _reselected_mean(s["detector_dots"], s["trigger"]),
        # all layers and KV heads: (L, steps) -> sum over layers, mean over steps
        "bytes_moved_per_step": float(bytes_moved.sum(0).mean()) if steps and bytes_moved is not None else 0.0,
    }


def _lists(a: np.ndarray | None, dtype) -> list | None:
    return None if a is None else a.astype(dtype).tolist()  # (L, steps) -> [layer][step]


def _trigger_lists(a: np.ndarray) -> list:
    """(L, steps) float trigger -> [layer][step] bools; null for a layer never re-selected (all NaN)."""
    return [None if steps.size and np.isnan(steps).all() else steps.astype(bool).tolist() for steps in a]


def output_row(job: JobStamp, sample: dict, method: str, result: Any, b: int, text: str) -> dict:
    """The row of sample ``b`` of one method's ``rcr.GenerationResult`` (``text``: its decoded tokens)."""
    s = result.sample(b)
    decode_s = float(result.decode_s)
    n_tokens = int(np.asarray(result.lengths).sum())  # the whole batch's, for tokens_per_s
    cost = getattr(result, "cost", None) or {}  # the method's cost model (rcr.GenerationResult.cost)
    return {
        **_identity(job, sample, method, None),
        "output_text": text,
        "output_ids": s["tokens"].astype(np.int32).tolist(),
        "n_steps": len(s["tokens"]),
        "n_layers": s["drift"].shape[0],
        "prefix_len": int(result.prefix_len[b]),
        **telemetry_summary(s),
        "drift": _lists(s["drift"], np.float32),
        "drift_exact": _lists(s.get("drift_exact"), np.float32),
        "trigger": _trigger_lists(s["trigger"]),
        "tau": _lists(s["tau"], np.float32),
        "top_prefix_pos": _lists(s.get("top_prefix_pos"), np.int32),
        "calibration": cost.get("calibration"),
        "calibration_sha256": cost.get("calibration_sha256"),
        "prefill_s": float(result.prefill_s),
        "decode_s": decode_s,
        "tokens_per_s": n_tokens / decode_s if decode_s else None,
        "error": None,
    }


def output_table(rows: list[dict]) -> pa.Table:
    """Rows (dicts keyed by OUTPUT_SCHEMA names; missing keys are null) -> a Table in OUTPUT_SCHEMA."""
    cols = {name: [r.get(name) for r in rows] for name in OUTPUT_SCHEMA.names}
    return pa.Table.from_pydict(cols, schema=OUTPUT_SCHEMA)


def validate_output_table(table: pa.Table) -> None:
    """Raise ValueError naming the first column that is missing or has the wrong type."""
    for f in OUTPUT_SCHEMA:
        if f.name not in table.schema.names:
            raise ValueError(f"output column '{f.name}' is missing")
        got = table.schema.field(f.name).type
        if got != f.type:
            raise ValueError(f"output column '{f.name}' has type {got}, expected {f.type}")
