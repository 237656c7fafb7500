"""Fabricates pipeline output rows (one per (sample_id, method)) in the Parquet output schema, for the
statistics and tracking tests. Telemetry is plausible, not a simulation of the model."""
from __future__ import annotations

import numpy as np
import pandas as pd

from rcr.methods import parse_label

DEFAULT_METHODS = ("full", "bacon", "prefill_oracle", "exact", "fixed", "rcr", "quest")
WORDS = [
    "a", "red", "cube", "sits", "left", "of", "a", "small", "blue", "sphere", "on", "the", "grey", "floor", "while",
    "green", "cone", "and", "yellow", "cylinder", "stand", "behind", "near", "wall", "under", "bright", "light",
    "with", "soft", "shadow",
]


def _degrade(words: list[str], p: float, rng: np.random.Generator) -> list[str]:
    out = []
    for w in words:
        u = rng.random()
        if u < p / 2:
            continue  # drop
        if u < p:
            out.append(WORDS[rng.integers(len(WORDS))])  # substitute
        else:
            out.append(w)
    return out


# how much each method departs from `full` (probability of a word error), before drift scaling
_QUALITY = {"full": 0.0, "bacon": 0.55, "prefill_oracle": 0.45, "exact": 0.2, "fixed": 0.35, "rcr": 0.28,
            "quest": 0.5, "arkvale": 0.6, "infinigen": 0.3, "rcr_layer": 0.3}
_STATIC = {"full", "bacon", "prefill_oracle", "quest", "arkvale", "infinigen"}
_DETECTOR = {"fixed", "rcr", "rcr_layer"}


def make_output_frame(n_samples: int = 24, methods=DEFAULT_METHODS, models=("tiny-vlm",), n_layers: int = 4,
                      seed: int = 0, errors: int = 0, references: bool = True, job_name: str = "test-job",
                      config_hash: str = "cfg0", min_steps: int = 12, max_steps: int = 40) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for model in models:
        for i in range(n_samples):
            sid = f"s{i:04d}"
            T = int(rng.integers(min_steps, max_steps + 1))
            sample_drift = float(rng.gamma(2.0, 0.02))
            full_words = [WORDS[j] for j in rng.integers(0, len(WORDS), size=T)]
            refs = [" ".join(_degrade(full_words, 0.5, rng)) for _ in range(2)] if references else []
            top = np.cumsum(rng.random((n_layers, T)) < 0.4, axis=1).astype(np.int32) % 50
            for method in methods:
                cls, knobs = parse_label(method)
                base, tau_label = cls.name, knobs.get("tau")
                drift = (sample_drift * rng.gamma(4.0, 0.25, size=(n_layers, T))).astype(np.float32)
                if base == "rcr":
                    tau = np.empty((n_layers, T), np.float32)
                    trig = np.zeros((n_layers, T), bool)
                    t = 0.03
                    for s in range(T):
                        for layer in range(n_layers):
                            tau[layer, s] = t
                            trig[layer, s] = drift[layer, s] > t
                            t *= float(np.exp(0.05 * (float(trig[layer, s]) - 0.4)))
                elif base == "fixed":
                    tv = tau_label if tau_label is not None else 0.03
                    tau = np.full((n_layers, T), tv, np.float32)
                    trig = drift > tv
                elif base == "exact":
                    tau = np.zeros((n_layers, T), np.float32)
                    trig = np.ones((n_layers, T), bool)
                else:
                    tau = np.zeros((n_layers, T), np.float32)
                    trig = np.zeros((n_layers, T), bool)
                refresh = float(trig.mean())
                q = _QUALITY.get(base, 0.4)
                if base == "fixed" and tau_label is not None:
                    q = 0.2 + 0.25 * (1 - refresh)
                p = min(0.95, q * (0.5 + 10 * sample_drift)) if base != "full" else 0.0
                words = full_words if base == "full" else _degrade(full_words, p, rng)
                err = None
                if errors and method != "full" and rng.random() < errors / (n_samples * len(methods)):
                    err = "RuntimeError: simulated failure"
                rows.append(dict(
                    sample_id=sid, method=method, task="caption", source="synthetic", model=model,
                    config_hash=config_hash, job_name=job_name, prompt="Describe this image in detail.",
                    references=refs, output_text=" ".join(words),
                    output_ids=np.arange(len(words), dtype=np.int32), n_steps=np.int32(T),
                    n_layers=np.int32(n_layers), prefix_len=np.int32(200),
                    refresh_fraction=refresh,
                    mean_drift=float(drift.mean()) if base in _DETECTOR else None,
                    mean_drift_exact=float(drift.mean() * 1.1) if base in _DETECTOR else None,
                    keys_read_per_step=(0.0 if base in _STATIC else (200.0 if base == "exact" else 128 * refresh)),
                    values_read_per_step=(0.0 if base in _STATIC else (200.0 if base == "exact" else 32 * refresh)),
                    detector_dots_per_step=(12.5 if base in _DETECTOR else 0.0),
                    drift=[list(r) for r in drift],
                    drift_exact=[list(r * 1.1) for r in drift] if base in _DETECTOR else None,
                    trigger=[list(r) for r in trig], tau=[list(r) for r in tau],
                    top_prefix_pos=[list(r) for r in top] if method == "full" else None,
                    prefill_s=0.5, decode_s=T / 50.0, tokens_per_s=50.0 + rng.normal(0, 2),
                    error=err,
                ))
    return pd.DataFrame(rows)


def write_output_dir(df: pd.DataFrame, out_dir, n_files: int = 2) -> None:
    """Write the frame as several Parquet files, the way the pipeline writes shards."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:  # the pipeline's OUTPUT_SCHEMA when it exists, so the types are exactly what a job writes
        from pipeline.schema import OUTPUT_SCHEMA as schema
    except ImportError:
        schema = None
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = sorted(df.sample_id.unique())
    for k in range(n_files):
        part = df[df.sample_id.isin(ids[k::n_files])]
        if schema is not None:
            recs = part.to_dict("records")
            table = pa.Table.from_pydict({n: [_py(r.get(n)) for r in recs] for n in schema.names}, schema=schema)
        else:
            table = pa.Table.from_pandas(part, preserve_index=False)
        pq.write_table(table, out_dir / f"part-{k:05d}.parquet")


def _py(v):
    if isinstance(v, np.ndarray):
        return [_py(x) for x in v]
    if isinstance(v, list):
        return [_py(x) for x in v]
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and np.isnan(v):
        return None
    return v
