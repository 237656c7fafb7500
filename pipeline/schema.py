"""Arrow schemas shared by every stage of the pipeline.

Input schema (one row per sample, the same for every source: DetailCaps, TextCaps, local videos and the
synthetic embedded default):

=============  ======================  ==========================================================
field          type                    meaning
=============  ======================  ==========================================================
sample_id      string, not null        unique within a source
task           string, not null        one of ``INPUT_TASKS`` (``detailcaps``, ``textcaps``, ``video``)
prompt         string, not null        the user prompt sent with the image(s)
images         list<binary>, not null  encoded image bytes (PNG/JPEG/...); one per frame for video
references     list<string>, not null  reference descriptions, possibly empty
source         string, not null        where it came from (``synthetic``, a HF dataset id, a path)
=============  ======================  ==========================================================
"""

from __future__ import annotations

import pyarrow as pa

# ------------------------------------------------------------------------------------------- input
INPUT_TASKS = ("detailcaps", "textcaps", "video")

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


def _type_ok(actual: pa.DataType, expected: pa.DataType) -> bool:
    if actual.equals(expected):
        return True
    # accept the 64-bit offset / view variants that other writers produce, and cast later
    loose = {
        pa.string(): (pa.large_string(), pa.string_view()) if hasattr(pa, "string_view") else (pa.large_string(),),
        pa.binary(): (pa.large_binary(), pa.binary_view()) if hasattr(pa, "binary_view") else (pa.large_binary(),),
    }
    if expected in loose:
        return any(actual.equals(t) for t in loose[expected])
    if pa.types.is_list(expected):
        if pa.types.is_list(actual) or pa.types.is_large_list(actual):
            return _type_ok(actual.value_type, expected.value_type)
    return False


def validate_input_table(table: pa.Table, where: str = "input table") -> pa.Table:
    """Check ``table`` against ``INPUT_SCHEMA`` and return it cast to exactly that schema.

    Raises ``SchemaError`` naming the offending field (and the first bad row, when it is a value
    problem): a missing column, a column of the wrong type, a null, an empty ``images`` list, an
    unknown ``task`` or a duplicated ``sample_id``. Extra columns are dropped.
    """
    names = set(table.column_names)
    for field in INPUT_SCHEMA:
        if field.name not in names:
            raise SchemaError(f"{where}: missing column '{field.name}' (have: {', '.join(table.column_names) or 'none'})")
        actual = table.schema.field(field.name).type
        if not _type_ok(actual, field.type):
            raise SchemaError(f"{where}: column '{field.name}' has type {actual}, expected {field.type}")
    table = table.select(INPUT_SCHEMA.names)
    for field in INPUT_SCHEMA:
        col = table.column(field.name)
        if col.null_count:
            row = next(i for i, v in enumerate(col.to_pylist()) if v is None)
            raise SchemaError(f"{where}: column '{field.name}' is null in row {row}")
    tasks = table.column("task").to_pylist()
    for i, t in enumerate(tasks):
        if t not in INPUT_TASKS:
            raise SchemaError(f"{where}: column 'task' has unknown task {t!r} in row {i}; expected one of {INPUT_TASKS}")
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


# ======================================================================================================
# OUTPUT schema (pipeline engineer): one Parquet row per (sample_id, method), written by pipeline/run.py.
# Consumed by pipeline/metrics.py. Documented column by column in docs/pipeline.md.
# ======================================================================================================

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
    pa.field("prompt", pa.string()),
    pa.field("references", pa.list_(pa.string())),
    # output
    pa.field("output_text", pa.string()),
    pa.field("output_ids", pa.list_(pa.int32())),
    pa.field("n_steps", pa.int32()),
    pa.field("n_layers", pa.int32()),
    pa.field("prefix_len", pa.int32()),
    # per-row telemetry summaries
    pa.field("refresh_fraction", pa.float64()),  # mean trigger over valid layer-steps
    pa.field("mean_drift", pa.float64()),
    pa.field("mean_drift_exact", pa.float64()),
    pa.field("keys_read_per_step", pa.float64()),  # per KV head per layer-step
    pa.field("values_read_per_step", pa.float64()),
    pa.field("detector_dots_per_step", pa.float64()),
    pa.field("bytes_moved_per_step", pa.float64()),  # host-to-device prefix bytes per decode step (offload)
    # per-layer-step telemetry, [layer][step]
    pa.field("drift", _F32_LL),
    pa.field("drift_exact", _F32_LL),
    pa.field("trigger", pa.list_(pa.list_(pa.bool_()))),
    pa.field("tau", _F32_LL),
    pa.field("top_prefix_pos", pa.list_(pa.list_(pa.int32()))),  # on `full` rows when recorded
    # timings (of the model call that produced the row; shared by the samples of one batch)
    pa.field("prefill_s", pa.float64()),
    pa.field("decode_s", pa.float64()),
    pa.field("tokens_per_s", pa.float64()),
    pa.field("error", pa.string()),  # null when the row is ok
])

OUTPUT_KEY = ("sample_id", "method")


def empty_output_row() -> dict:
    """A row with every OUTPUT_SCHEMA column set to null."""
    return {name: None for name in OUTPUT_SCHEMA.names}


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
