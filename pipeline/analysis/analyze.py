"""Statistics over the pipeline's Parquet output: fidelity, reference metrics, paired bootstrap CIs,
refresh/drift analyses and the printed summary table.

Pure pandas / numpy / scipy (plus ``rouge-score`` and, for CIDEr, ``pycocoevalcap``). No MLflow, no
Ray, no torch: the driver calls this after a job, and a person can call it on ``pd.read_parquet(out)``.

Public entry points (stable; the pipeline driver and ``pipeline.tracking`` call them):

* :func:`analyze` ``(df, bootstrap_resamples=10000, seed=0, ...) -> Analysis``
* :func:`format_summary` ``(analysis) -> str``: the table the job prints at the end.

Input: one row per (sample_id, method) in the output schema (``pipeline/schema.py``; column names
used here are collected in :class:`Col`). The ``full`` row of a sample is the uncompressed reference
for the fidelity of every method on the same (model, sample_id). Rows whose ``error`` is not null are
excluded from all statistics, but counted (``Analysis.errors`` and ``n_errors`` per method).

What is measured, and with what (also in ``Analysis.meta`` and logged to MLflow):

* **Fidelity**: ROUGE-L F1 of a method's ``output_text`` against the ``full`` output of the same model
  and sample. Package ``rouge-score`` (``RougeScorer(["rougeL"])``), with :class:`UnicodeTokenizer`
  (the package's default tokenizer keeps only ``[a-z0-9]`` and so drops all non-ASCII text), no
  stemming. Two outputs that are both empty after tokenisation score 1.0 (they are identical).
* **ROUGE-L vs references**: the same scorer; multi-reference rule: the maximum F1 over the
  sample's references (``RougeScorer.score_multi``).
* **CIDEr** (CIDEr-D as in the COCO caption evaluation code): ``pycocoevalcap`` 1.2 ``Cider`` (n=4,
  sigma=6), which is pure Python; its Java PTB tokenizer is *not* used: texts are tokenised with
  :class:`UnicodeTokenizer` and joined with spaces. Multi-reference rule: CIDEr's own consensus (the
  mean over references of the TF-IDF n-gram cosine). IDF comes from the references of the samples
  scored together (one corpus per (model, method), so the same corpus for every method when they cover
  the same samples). Per-sample scores are bootstrapped with that IDF fixed.
* **Paired bootstrap**: percentile CIs from ``n_resamples`` resamples of the samples (default 10,000,
  seeded). Per model, ONE matrix of resampled indices is drawn and used for every method's mean and
  for every difference (method minus ``bacon``, method minus ``rcr``), so the comparisons are paired.
  Equivalent to ``scipy.stats.bootstrap(..., paired=True, method="percentile")`` (tested against it),
  but vectorised as a matrix product of resample counts. A statistic with zero variance (e.g. two
  identical methods) gets the CI [x, x] exactly, never NaN.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import unicodedata
import warnings
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd
from scipy import stats as _scistats

__all__ = [
    "Col",
    "UnicodeTokenizer",
    "rouge_l_f1",
    "rouge_l_multi",
    "cider_scores",
    "bootstrap_means",
    "paired_bootstrap",
    "Analysis",
    "analyze",
    "format_summary",
    "refresh_by_step",
    "sweep_methods",
    "parse_sweep_tau",
    "DEFAULT_TAU_SWEEP",
    "FIDELITY_DESC",
    "REF_ROUGE_DESC",
    "CIDER_DESC",
]


# ----------------------------------------------------------------------------------------------------
# Column names: one place. pipeline/schema.py (owned by the pipeline engineer) defines the Arrow schema;
# the names below are the contract with it. tests/test_metrics.py checks them against the schema when
# that module exists.
# ----------------------------------------------------------------------------------------------------
class Col:
    SAMPLE_ID = "sample_id"
    METHOD = "method"
    TASK = "task"
    SOURCE = "source"
    MODEL = "model"
    CONFIG_HASH = "config_hash"
    JOB_NAME = "job_name"
    PROMPT = "prompt"
    REFERENCES = "references"
    OUTPUT_TEXT = "output_text"
    OUTPUT_IDS = "output_ids"
    N_STEPS = "n_steps"
    N_LAYERS = "n_layers"
    PREFIX_LEN = "prefix_len"
    REFRESH_FRACTION = "refresh_fraction"
    MEAN_DRIFT = "mean_drift"
    MEAN_DRIFT_EXACT = "mean_drift_exact"
    KEYS_READ = "keys_read_per_step"
    VALUES_READ = "values_read_per_step"
    DETECTOR_DOTS = "detector_dots_per_step"
    BYTES_MOVED = "bytes_moved_per_step"
    DRIFT = "drift"
    DRIFT_EXACT = "drift_exact"
    TRIGGER = "trigger"
    TAU = "tau"
    TOP_PREFIX_POS = "top_prefix_pos"
    PREFILL_S = "prefill_s"
    DECODE_S = "decode_s"
    TOKENS_PER_S = "tokens_per_s"
    ERROR = "error"

    # columns this module reads (the rest may be absent)
    REQUIRED = (SAMPLE_ID, METHOD, OUTPUT_TEXT)
    ALL = (
        SAMPLE_ID, METHOD, TASK, SOURCE, MODEL, CONFIG_HASH, JOB_NAME, PROMPT, REFERENCES, OUTPUT_TEXT,
        OUTPUT_IDS, N_STEPS, N_LAYERS, PREFIX_LEN, REFRESH_FRACTION, MEAN_DRIFT, MEAN_DRIFT_EXACT,
        KEYS_READ, VALUES_READ, DETECTOR_DOTS, BYTES_MOVED, DRIFT, DRIFT_EXACT, TRIGGER, TAU, TOP_PREFIX_POS,
        PREFILL_S, DECODE_S, TOKENS_PER_S, ERROR,
    )


# method labels with a role in the analyses
FULL, BACON, RCR, EXACT, FIXED = "full", "bacon", "rcr", "exact", "fixed"
BASELINES = (BACON, RCR)  # every method gets a paired difference from each of these (when present)
TERCILE_METHODS = (RCR, FIXED, EXACT)
# which row's mean drift is "the sample's mean drift" for the tercile / correlation analyses, in order
DRIFT_SOURCES = ((FIXED, Col.MEAN_DRIFT), (RCR, Col.MEAN_DRIFT), (EXACT, Col.MEAN_DRIFT),
                 (RCR, Col.MEAN_DRIFT_EXACT), (EXACT, Col.MEAN_DRIFT_EXACT))
# preferred display order; others follow alphabetically, tau-sweep labels sorted by tau
METHOD_ORDER = ("full", "bacon", "prefill_oracle", "exact", "fixed", "rcr", "rcr_layer", "quest",
                "arkvale", "infinigen")
DEFAULT_TAU_SWEEP = (0.02, 0.03, 0.05, 0.10, 0.15)
_SWEEP_RE = re.compile(r"^(?P<base>[A-Za-z_]+)@(?P<tau>[0-9.eE+-]+)$")


def sweep_methods(taus: Iterable[float] = DEFAULT_TAU_SWEEP, base: str = FIXED) -> list[str]:
    """Method labels of a fixed-tau sweep, e.g. ``["fixed@0.02", ..., "fixed@0.15"]``.

    The job's config can list these next to the ordinary methods; :func:`analyze` recognises them and
    puts them on the cost/quality frontier (fidelity against realised refresh fraction) next to ``rcr``.
    """
    return [f"{base}@{float(t):g}" for t in taus]


def parse_sweep_tau(method: str) -> float | None:
    """``"fixed@0.05" -> 0.05``; ``None`` for labels that are not sweep points."""
    m = _SWEEP_RE.match(str(method))
    if not m:
        return None
    try:
        return float(m.group("tau"))
    except ValueError:
        return None


def _method_sort_key(m: str) -> tuple:
    if m in METHOD_ORDER:
        return (0, METHOD_ORDER.index(m), 0.0, m)
    tau = parse_sweep_tau(m)
    if tau is not None:
        return (1, 0, tau, m)
    return (2, 0, 0.0, m)


def order_methods(methods: Iterable[str]) -> list[str]:
    return sorted(set(methods), key=_method_sort_key)


# ----------------------------------------------------------------------------------------------------
# Text metrics
# ----------------------------------------------------------------------------------------------------
def _is_cjk_char(ch: str) -> bool:
    o = ord(ch)
    return (0x4E00 <= o <= 0x9FFF or 0x3400 <= o <= 0x4DBF or 0x20000 <= o <= 0x2EBEF
            or 0xF900 <= o <= 0xFAFF or 0x3040 <= o <= 0x30FF or 0x31F0 <= o <= 0x31FF)


try:  # rouge-score's abstract base, so RougeScorer accepts it; fall back to a plain class.
    from rouge_score.tokenizers import Tokenizer as _RougeTokenizerBase
except Exception:  # pragma: no cover - rouge-score is a pipeline dependency
    _RougeTokenizerBase = object


class UnicodeTokenizer(_RougeTokenizerBase):
    """ROUGE tokenizer that keeps non-ASCII text.

    NFKC-normalise, lowercase, then a token is a maximal run of Unicode letters, digits and combining
    marks (categories L*, N*, M*); every CJK ideograph / kana character is a token of its own (those
    scripts are written without spaces). Punctuation, symbols and whitespace separate tokens and are
    dropped. No stemming. For ASCII text this gives the same tokens as rouge-score's default tokenizer
    without stemming, except that "_" separates tokens there too.
    """

    def tokenize(self, text: str) -> list[str]:
        if text is None:
            return []
        text = unicodedata.normalize("NFKC", str(text)).lower()
        tokens: list[str] = []
        cur: list[str] = []
        for ch in text:
            if _is_cjk_char(ch):
                if cur:
                    tokens.append("".join(cur))
                    cur = []
                tokens.append(ch)
            elif unicodedata.category(ch)[0] in "LNM":
                cur.append(ch)
            elif cur:
                tokens.append("".join(cur))
                cur = []
        if cur:
            tokens.append("".join(cur))
        return tokens


FIDELITY_DESC = ("ROUGE-L F1 vs the same model's uncompressed ('full') output; package rouge-score 0.1.2 "
                 "RougeScorer(['rougeL']) with pipeline.metrics.UnicodeTokenizer (NFKC, lowercase, runs of "
                 "Unicode letters/digits/marks, one token per CJK ideograph/kana, no stemming); both empty -> 1.0")
REF_ROUGE_DESC = ("ROUGE-L F1 vs references; rouge-score 0.1.2 with pipeline.metrics.UnicodeTokenizer; "
                  "multi-reference rule: max F1 over the references (RougeScorer.score_multi)")
CIDER_DESC = ("CIDEr-D; package pycocoevalcap 1.2 Cider(n=4, sigma=6) (pure Python; its Java PTB tokenizer "
              "is not used), texts tokenised by pipeline.metrics.UnicodeTokenizer and space-joined; "
              "multi-reference rule: CIDEr consensus (mean over references); IDF from the references of "
              "the samples scored together, one corpus per (model, method)")

_SCORER = None
_TOKENIZER = UnicodeTokenizer()


def _scorer():
    global _SCORER
    if _SCORER is None:
        from rouge_score import rouge_scorer

        _SCORER = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False, tokenizer=_TOKENIZER)
    return _SCORER


def rouge_l_f1(reference: str, candidate: str) -> float:
    """ROUGE-L F1 (rouge-score, :class:`UnicodeTokenizer`). Both empty after tokenisation -> 1.0."""
    reference = "" if reference is None else str(reference)
    candidate = "" if candidate is None else str(candidate)
    if reference == candidate:
        return 1.0
    if not _TOKENIZER.tokenize(reference) and not _TOKENIZER.tokenize(candidate):
        return 1.0
    return float(_scorer().score(reference, candidate)["rougeL"].fmeasure)


def rouge_l_multi(references: Sequence[str], candidate: str) -> float:
    """ROUGE-L F1 against several references: the maximum over them (NaN without references)."""
    refs = [str(r) for r in (references if references is not None else []) if r is not None]
    if not refs:
        return float("nan")
    return max(rouge_l_f1(r, candidate) for r in refs)


def _cider_text(s: str) -> str:
    return " ".join(_TOKENIZER.tokenize(s))


def cider_scores(candidates: Sequence[str], references: Sequence[Sequence[str]]) -> np.ndarray:
    """Per-sample CIDEr-D (pycocoevalcap ``Cider``) of ``candidates[i]`` against ``references[i]``.

    All samples form one corpus (the IDF is computed from their references). Samples without references
    get NaN and are not part of the corpus. Needs at least two samples with references for a non-zero
    IDF (one document gives log(1) = 0 everywhere, so every score is 0).
    """
    from pycocoevalcap.cider.cider import Cider  # pure Python; the PTB tokenizer (Java) is not imported

    out = np.full(len(candidates), np.nan)
    gts, res, pos = {}, {}, []
    for i, (c, refs) in enumerate(zip(candidates, references)):
        refs = [r for r in (list(refs) if refs is not None else []) if r is not None]
        if not refs:
            continue
        gts[len(pos)] = [_cider_text(r) for r in refs]
        res[len(pos)] = [_cider_text(c or "")]
        pos.append(i)
    if not pos:
        return out
    _, scores = Cider().compute_score(gts, res)
    out[pos] = np.asarray(scores, dtype=float)
    return out


# ----------------------------------------------------------------------------------------------------
# Paired bootstrap
# ----------------------------------------------------------------------------------------------------
def bootstrap_means(values: np.ndarray, valid: np.ndarray | None = None, n_resamples: int = 10_000,
                    seed: int | np.random.Generator = 0, confidence: float = 0.95,
                    max_chunk_elems: int = 4_000_000) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Percentile bootstrap CIs of the column means of ``values`` ([n_samples, k]), all columns paired.

    One set of resampled sample indices (seeded) is shared by all k columns, so a column holding a
    per-sample difference ``a - b`` gives the paired-bootstrap CI of ``mean(a) - mean(b)``.
    ``valid`` ([n, k] bool) marks usable entries; a resample's mean of a column is over its valid
    resampled entries (for complete data this is the ordinary bootstrap). Returns ``(mean, low, high)``
    arrays of length k. Columns whose valid values are all equal (to 1e-12 relative) get
    ``low == high == mean`` exactly;
    columns with no valid value get NaN.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None]
    n, k = x.shape
    m = np.isfinite(x) if valid is None else (np.asarray(valid, dtype=bool).reshape(n, k) & np.isfinite(x))
    xm = np.where(m, x, 0.0)
    mf = m.astype(np.float64)
    cnt = mf.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = xm.sum(0) / cnt
    low = np.full(k, np.nan)
    high = np.full(k, np.nan)
    if n == 0:
        return mean, low, high
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    stats = np.empty((n_resamples, k))
    chunk = max(1, min(n_resamples, max_chunk_elems // max(n, 1)))
    done = 0
    while done < n_resamples:
        b = min(chunk, n_resamples - done)
        idx = rng.integers(0, n, size=(b, n))
        flat = (idx + (np.arange(b)[:, None] * n)).ravel()
        w = np.bincount(flat, minlength=b * n).reshape(b, n).astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            stats[done:done + b] = (w @ xm) / (w @ mf)
        done += b
    alpha = (1.0 - confidence) / 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns
        q = np.nanpercentile(stats, [100 * alpha, 100 * (1 - alpha)], axis=0)
    low, high = q[0], q[1]
    # zero variance: every resample mean is the same number -> report it exactly, never NaN
    for j in range(k):
        v = x[m[:, j], j]
        if v.size == 0:
            low[j] = high[j] = mean[j] = np.nan
        elif np.all(v == v[0]):
            low[j] = high[j] = mean[j] = float(v[0])
        elif np.ptp(v) <= 1e-12 * max(1.0, float(np.abs(v).max())):  # constant up to float rounding
            low[j] = high[j] = mean[j]
    return mean, low, high


def paired_bootstrap(table: pd.DataFrame, baselines: Sequence[str] = BASELINES, n_resamples: int = 10_000,
                     seed: int = 0, confidence: float = 0.95) -> pd.DataFrame:
    """Means, CIs and paired differences for a [samples x methods] table (NaN = missing).

    Returns one row per method with ``mean, ci_low, ci_high, n`` and, for each baseline ``b`` present,
    ``diff_<b>, diff_<b>_ci_low, diff_<b>_ci_high, n_pairs_<b>`` (method minus baseline, over the
    samples where both are present). One shared set of resampled indices serves every column.
    """
    methods = list(table.columns)
    cols, valid, names = [table[m].to_numpy(float) for m in methods], [], []
    valid = [np.isfinite(c) for c in cols]
    names = [("mean", m, None) for m in methods]
    for b in baselines:
        if b not in table.columns:
            continue
        vb = table[b].to_numpy(float)
        for m in methods:
            vm = table[m].to_numpy(float)
            ok = np.isfinite(vm) & np.isfinite(vb)
            cols.append(np.where(ok, vm - vb, 0.0))
            valid.append(ok)
            names.append(("diff", m, b))
    if not cols:
        return pd.DataFrame(columns=["method", "mean", "ci_low", "ci_high", "n"])
    X = np.stack(cols, 1)
    M = np.stack(valid, 1)
    mean, lo, hi = bootstrap_means(X, M, n_resamples=n_resamples, seed=seed, confidence=confidence)
    rows = {m: {"method": m} for m in methods}
    for j, (kind, m, b) in enumerate(names):
        if kind == "mean":
            rows[m].update(mean=mean[j], ci_low=lo[j], ci_high=hi[j], n=int(M[:, j].sum()))
        else:
            rows[m].update({f"diff_{b}": mean[j], f"diff_{b}_ci_low": lo[j], f"diff_{b}_ci_high": hi[j],
                            f"n_pairs_{b}": int(M[:, j].sum())})
    return pd.DataFrame([rows[m] for m in methods])


# ----------------------------------------------------------------------------------------------------
# Telemetry helpers
# ----------------------------------------------------------------------------------------------------
def _as_2d(x, dtype=float) -> np.ndarray | None:
    """[layer][step] nested list / array of arrays -> 2-D array (None if missing or empty)."""
    if x is None:
        return None
    if isinstance(x, float) and math.isnan(x):
        return None
    try:
        rows = [np.asarray(r, dtype=dtype) for r in x]
    except TypeError:
        return None
    if not rows:
        return None
    width = max(r.shape[0] for r in rows)
    if any(r.shape[0] != width for r in rows):  # ragged: pad with NaN (float) / False
        fill = np.nan if np.issubdtype(np.dtype(dtype), np.floating) else 0
        rows = [np.concatenate([r, np.full(width - r.shape[0], fill, dtype=dtype)]) for r in rows]
    return np.stack(rows, 0)


def _ragged_mean(seqs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Mean over sequences of different lengths, position by position; returns (mean, count)."""
    seqs = [np.asarray(s, float) for s in seqs if s is not None and len(s)]
    if not seqs:
        return np.zeros(0), np.zeros(0, int)
    T = max(len(s) for s in seqs)
    acc = np.full((len(seqs), T), np.nan)
    for i, s in enumerate(seqs):
        acc[i, : len(s)] = s
    cnt = np.isfinite(acc).sum(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(acc, 0), cnt


def refresh_by_step(df: pd.DataFrame, method: str = RCR, model: str | None = None) -> pd.DataFrame:
    """Refresh rate (mean trigger over layers, then over samples) and mean tau at each decode step.

    Columns: ``step, refresh_rate, tau_mean, n_samples``. Samples shorter than a step drop out of it.
    """
    d = _ok_rows(df)
    d = d[d[Col.METHOD] == method]
    if model is not None and Col.MODEL in d:
        d = d[d[Col.MODEL].fillna("") == model]
    trig, tau = [], []
    for _, r in d.iterrows():
        t = _as_2d(r.get(Col.TRIGGER), float)
        if t is not None and np.isfinite(t).any():
            trig.append(np.nanmean(t, 0))
        a = _as_2d(r.get(Col.TAU), float)
        if a is not None and np.isfinite(a).any():  # methods without a threshold record NaN tau
            tau.append(np.nanmean(a, 0))
    rm, rc = _ragged_mean(trig)
    tm, _ = _ragged_mean(tau)
    T = max(len(rm), len(tm))
    out = pd.DataFrame({"step": np.arange(T)})
    out["refresh_rate"] = np.pad(rm, (0, T - len(rm)), constant_values=np.nan) if T else []
    out["tau_mean"] = np.pad(tm, (0, T - len(tm)), constant_values=np.nan) if T else []
    out["n_samples"] = np.pad(rc, (0, T - len(rc))) if T else []
    return out


def top_position_stability(df: pd.DataFrame) -> pd.DataFrame:
    """Fraction of adjacent decode steps whose most-attended prefix position is unchanged, per model.

    From ``top_prefix_pos`` [layer][step] of the ``full`` rows. ``fraction_unchanged`` pools all
    (sample, layer, adjacent step pair) comparisons; ``fraction_unchanged_sample_mean`` first averages
    within each sample. Negative positions are padding and are skipped.
    """
    d = _ok_rows(df)
    d = d[d[Col.METHOD] == FULL]
    rows = []
    if Col.TOP_PREFIX_POS not in d:
        return pd.DataFrame(columns=["model", "n_samples", "n_pairs", "fraction_unchanged",
                                     "fraction_unchanged_sample_mean"])
    for model, g in d.groupby(_model_series(d), sort=True):
        same_tot = pairs_tot = 0
        per_sample = []
        for x in g[Col.TOP_PREFIX_POS]:
            a = _as_2d(x, float)
            if a is None or a.shape[1] < 2:
                continue
            ok = (a[:, 1:] >= 0) & (a[:, :-1] >= 0) & np.isfinite(a[:, 1:]) & np.isfinite(a[:, :-1])
            same = (a[:, 1:] == a[:, :-1]) & ok
            if ok.sum() == 0:
                continue
            same_tot += int(same.sum())
            pairs_tot += int(ok.sum())
            per_sample.append(same.sum() / ok.sum())
        if pairs_tot:
            rows.append(dict(model=model, n_samples=len(per_sample), n_pairs=pairs_tot,
                             fraction_unchanged=same_tot / pairs_tot,
                             fraction_unchanged_sample_mean=float(np.mean(per_sample))))
    return pd.DataFrame(rows, columns=["model", "n_samples", "n_pairs", "fraction_unchanged",
                                       "fraction_unchanged_sample_mean"])


def _ok_rows(df: pd.DataFrame) -> pd.DataFrame:
    if Col.ERROR in df:
        return df[df[Col.ERROR].isna()]
    return df


def _model_series(df: pd.DataFrame) -> pd.Series:
    if Col.MODEL in df:
        return df[Col.MODEL].fillna("").astype(str)
    return pd.Series([""] * len(df), index=df.index)


def _num(df: pd.DataFrame, col: str) -> pd.Series:
    if col in df:
        return pd.to_numeric(df[col], errors="coerce").astype(float)
    return pd.Series(np.nan, index=df.index, dtype=float)


# ----------------------------------------------------------------------------------------------------
# analyze()
# ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Analysis:
    """Tables produced by :func:`analyze` (all plain pandas DataFrames; ``model`` is "" if unnamed).

    * ``per_sample``: one row per ok (model, sample_id, method): fidelity, rougeL_ref, cider,
      refresh_fraction, mean_drift, sample_drift (the sample's drift for terciles), drift_tercile,
      output_len_full, n_steps, read counters, tokens_per_s, sweep_tau.
    * ``methods``: one row per (model, method): n, n_errors, fidelity mean/ci_low/ci_high,
      diff_bacon*/diff_rcr* with CIs and n_pairs, refresh_fraction (+CI), reads per step, tokens/s,
      rougeL_ref and cider (+CI), sweep_tau.
    * ``terciles``: (model, tercile, method) -> n, drift range, refresh_fraction, fidelity (+CI).
    * ``correlations``: (model, method, against) -> Spearman rho, p-value, n; ``gap`` is
      fidelity(exact) - fidelity(method), against "mean_drift" or "output_length".
    * ``stability``: per model, fraction of adjacent steps with unchanged most-attended prefix position.
    * ``frontier``: per (model, method) fidelity (+CI) against realised refresh fraction, with
      ``kind`` in {"sweep", "rcr", "method"}.
    * ``errors``: the rows with an error (model, sample_id, method, error).
    * ``meta``: what was used (packages, tokenizer, multi-reference rule, bootstrap settings, drift source).
    """

    per_sample: pd.DataFrame
    methods: pd.DataFrame
    terciles: pd.DataFrame
    correlations: pd.DataFrame
    stability: pd.DataFrame
    frontier: pd.DataFrame
    errors: pd.DataFrame
    meta: dict[str, Any]

    def tables(self) -> dict[str, pd.DataFrame]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), pd.DataFrame)}


def _rouge_pairs(pairs: list[tuple[str, str]], n_jobs: int | None = None) -> list[float]:
    """``rouge_l_f1`` over (reference, candidate) pairs; in worker processes when there are many.

    rouge-score's LCS is pure Python (~0.1 s for two 512-token outputs), so a DetailCaps-sized job
    (thousands of pairs) is spread over ``n_jobs`` processes (default: the CPU count, at most 16)."""
    if n_jobs is None:
        n_jobs = min(16, os.cpu_count() or 1)
    # LCS cost ~ product of the lengths; rouge-score does ~2.5M table cells per second
    cells = sum(len(a.split()) * len(b.split()) for a, b in pairs if a != b)
    if n_jobs <= 1 or cells < PARALLEL_MIN_CELLS:
        return [rouge_l_f1(a, b) for a, b in pairs]
    import concurrent.futures as cf
    import multiprocessing as mp

    # spawn: the driver may hold Ray / torch threads, which fork does not copy safely
    with cf.ProcessPoolExecutor(max_workers=n_jobs, mp_context=mp.get_context("spawn")) as ex:
        refs, cands = zip(*pairs)
        return list(ex.map(rouge_l_f1, refs, cands, chunksize=max(1, len(pairs) // (8 * n_jobs))))


PARALLEL_MIN_CELLS = 50_000_000  # ~20 s of serial scoring: below that, worker start-up is not worth it


def _fidelity_column(d: pd.DataFrame, n_jobs: int | None = None) -> pd.Series:
    """ROUGE-L F1 of every row's output against the ``full`` output of the same (model, sample)."""
    full = d[d[Col.METHOD] == FULL]
    ref = {(m, s): t for m, s, t in zip(_model_series(full), full[Col.SAMPLE_ID], full[Col.OUTPUT_TEXT])}
    keys = []
    for m, s, t in zip(_model_series(d), d[Col.SAMPLE_ID], d[Col.OUTPUT_TEXT]):
        r = ref.get((m, s), _NO_REF)
        keys.append(None if r is _NO_REF else ("" if r is None else str(r), "" if t is None else str(t)))
    uniq = sorted({k for k in keys if k is not None})
    scores = dict(zip(uniq, _rouge_pairs(uniq, n_jobs)))
    return pd.Series([np.nan if k is None else scores[k] for k in keys], index=d.index, dtype=float)


_NO_REF = object()


def _ref_rouge_column(d: pd.DataFrame, n_jobs: int | None = None) -> list[float]:
    """Max ROUGE-L F1 over each row's references (rows given all have references)."""
    keys = [[(str(r), "" if t is None else str(t)) for r in refs if r is not None]
            for refs, t in zip(d[Col.REFERENCES], d[Col.OUTPUT_TEXT])]
    uniq = sorted({k for ks in keys for k in ks})
    scores = dict(zip(uniq, _rouge_pairs(uniq, n_jobs)))
    return [max(scores[k] for k in ks) if ks else np.nan for ks in keys]


def _has_refs(x) -> bool:
    if x is None:
        return False
    try:
        return len(x) > 0
    except TypeError:
        return False


def _sample_drift(d: pd.DataFrame) -> tuple[pd.Series, str | None]:
    """Per (model, sample) mean drift from the first available source in DRIFT_SOURCES."""
    for method, col in DRIFT_SOURCES:
        if col not in d:
            continue
        g = d[(d[Col.METHOD] == method)]
        v = _num(g, col)
        if v.notna().any():
            key = list(zip(_model_series(g), g[Col.SAMPLE_ID]))
            return pd.Series(v.to_numpy(), index=pd.MultiIndex.from_tuples(key)), f"{method}.{col}"
    return pd.Series(dtype=float), None


def analyze(df: pd.DataFrame, bootstrap_resamples: int = 10_000, seed: int = 0, confidence: float = 0.95,
            reference_metrics: bool = True, baselines: Sequence[str] = BASELINES,
            n_jobs: int | None = None) -> Analysis:
    """Compute every statistic of a job from its output rows (see the module docstring).

    Args:
        df: the job's rows, e.g. ``pd.read_parquet(output_dir)``; one row per (sample_id, method).
        bootstrap_resamples: resamples of the paired bootstrap (default 10,000).
        seed: bootstrap seed. The same seed is used for each model's shared resample set.
        confidence: CI level (0.95).
        reference_metrics: compute ROUGE-L vs references and CIDEr where references exist.
        baselines: methods every other method is differenced against (paired).
        n_jobs: processes for the ROUGE-L scoring when there are many pairs (default: CPU count, <= 16).

    Returns:
        :class:`Analysis`.
    """
    missing = [c for c in Col.REQUIRED if c not in df.columns]
    if missing:
        raise ValueError(f"output rows lack required columns {missing}")
    df = df.reset_index(drop=True)  # copies; a unique index is assumed below
    df[Col.MODEL] = _model_series(df)
    df[Col.SAMPLE_ID] = df[Col.SAMPLE_ID].astype(str)
    err_mask = df[Col.ERROR].notna() if Col.ERROR in df else pd.Series(False, index=df.index)
    errors = df.loc[err_mask, [Col.MODEL, Col.SAMPLE_ID, Col.METHOD] + ([Col.ERROR] if Col.ERROR in df else [])]
    errors = errors.reset_index(drop=True)
    d = df[~err_mask].copy()
    dups = d.duplicated([Col.MODEL, Col.SAMPLE_ID, Col.METHOD], keep="last")
    n_dups = int(dups.sum())
    d = d[~dups]

    # ---- per-sample metrics
    ps = pd.DataFrame({
        "model": d[Col.MODEL], "sample_id": d[Col.SAMPLE_ID], "method": d[Col.METHOD].astype(str),
    })
    for c in (Col.TASK, Col.SOURCE):
        if c in d:
            ps[c] = d[c]
    ps["fidelity"] = _fidelity_column(d, n_jobs)
    ps["rougeL_ref"] = np.nan
    ps["cider"] = np.nan
    cider_ok = None
    if reference_metrics and Col.REFERENCES in d:
        has = d[Col.REFERENCES].map(_has_refs)
        if has.any():
            ps.loc[has, "rougeL_ref"] = _ref_rouge_column(d[has], n_jobs)
            try:
                for (_, _), g in d[has].groupby([Col.MODEL, Col.METHOD], sort=False):
                    ps.loc[g.index, "cider"] = cider_scores(list(g[Col.OUTPUT_TEXT]),
                                                            [list(r) for r in g[Col.REFERENCES]])
                cider_ok = True
            except ImportError as e:  # pycocoevalcap is in the `pipeline` extra
                warnings.warn(f"CIDEr skipped: {e}")
                cider_ok = False
    for name, col in (("refresh_fraction", Col.REFRESH_FRACTION), ("mean_drift", Col.MEAN_DRIFT),
                      ("mean_drift_exact", Col.MEAN_DRIFT_EXACT), ("n_steps", Col.N_STEPS),
                      ("keys_read_per_step", Col.KEYS_READ), ("values_read_per_step", Col.VALUES_READ),
                      ("detector_dots_per_step", Col.DETECTOR_DOTS), ("bytes_moved_per_step", Col.BYTES_MOVED),
                      ("tokens_per_s", Col.TOKENS_PER_S),
                      ("prefill_s", Col.PREFILL_S), ("decode_s", Col.DECODE_S)):
        ps[name] = _num(d, col)
    ps["reads_per_step"] = ps["keys_read_per_step"] + ps["values_read_per_step"]
    full_len = ps[ps.method == FULL].set_index(["model", "sample_id"])["n_steps"]
    full_len = full_len[~full_len.index.duplicated()]
    ps["output_len_full"] = full_len.reindex(list(zip(ps.model, ps.sample_id))).to_numpy()
    drift, drift_src = _sample_drift(d)
    ps["sample_drift"] = drift.reindex(list(zip(ps.model, ps.sample_id))).to_numpy() if len(drift) else np.nan
    ps["sweep_tau"] = ps.method.map(parse_sweep_tau).astype(float)
    ps = ps.reset_index(drop=True)

    # ---- per-method stats with one shared bootstrap per model
    method_rows, terc_rows, corr_rows = [], [], []
    n_err = errors.groupby([Col.MODEL, Col.METHOD]).size() if len(errors) else pd.Series(dtype=int)
    models = sorted(set(ps.model) | set(errors[Col.MODEL] if len(errors) else []))
    ps["drift_tercile"] = pd.Series(pd.NA, index=ps.index, dtype="object")
    for mi, model in enumerate(models):
        pm = ps[ps.model == model]
        methods = order_methods(set(pm.method) | set(errors.loc[errors[Col.MODEL] == model, Col.METHOD]
                                                     if len(errors) else []))
        samples = sorted(set(pm.sample_id))
        wide = {}
        for metric in ("fidelity", "refresh_fraction", "rougeL_ref", "cider"):
            wide[metric] = (pm.pivot_table(index="sample_id", columns="method", values=metric, aggfunc="first",
                                           dropna=False)
                            .reindex(index=samples, columns=methods))
        rng_seed = seed
        fid = paired_bootstrap(wide["fidelity"], baselines, bootstrap_resamples, rng_seed, confidence)
        fid = fid.set_index("method")
        # refresh and reference metrics: CIs on means (same seed -> same resample indices)
        extra = {}
        for metric in ("refresh_fraction", "rougeL_ref", "cider"):
            w = wide[metric]
            mean, lo, hi = bootstrap_means(w.to_numpy(float), None, bootstrap_resamples, rng_seed, confidence)
            extra[metric] = pd.DataFrame({"mean": mean, "ci_low": lo, "ci_high": hi,
                                          "n": np.isfinite(w.to_numpy(float)).sum(0)}, index=w.columns)
        for m in methods:
            g = pm[pm.method == m]
            row: dict[str, Any] = {"model": model, "method": m, "n": int(g.fidelity.notna().sum()),
                                   "n_rows": len(g), "n_errors": int(n_err.get((model, m), 0)),
                                   "sweep_tau": parse_sweep_tau(m)}
            f = fid.loc[m] if m in fid.index else None
            row["fidelity"] = f["mean"] if f is not None else np.nan
            row["fidelity_ci_low"] = f["ci_low"] if f is not None else np.nan
            row["fidelity_ci_high"] = f["ci_high"] if f is not None else np.nan
            for b in baselines:
                for suf in ("", "_ci_low", "_ci_high"):
                    key = f"diff_{b}{suf}"
                    row[key] = f[key] if (f is not None and key in f.index) else np.nan
                key = f"n_pairs_{b}"
                row[key] = int(f[key]) if (f is not None and key in f.index and pd.notna(f[key])) else 0
            for metric in ("refresh_fraction", "rougeL_ref", "cider"):
                e = extra[metric].loc[m]
                row[metric] = e["mean"]
                row[f"{metric}_ci_low"] = e["ci_low"]
                row[f"{metric}_ci_high"] = e["ci_high"]
            for c in ("keys_read_per_step", "values_read_per_step", "reads_per_step",
                      "detector_dots_per_step", "bytes_moved_per_step", "tokens_per_s", "n_steps", "mean_drift"):
                row[c] = float(g[c].mean()) if g[c].notna().any() else np.nan
            if m == FIXED and pd.isna(row["sweep_tau"]) and Col.TAU in d:
                row["sweep_tau"] = _constant_tau(d[(d[Col.MODEL] == model) & (d[Col.METHOD] == m)])
            method_rows.append(row)

        # ---- terciles by per-sample mean drift
        sd = pm.drop_duplicates("sample_id").set_index("sample_id")["sample_drift"].dropna()
        if len(sd) >= 3:
            terc = pd.qcut(sd.rank(method="first"), 3, labels=["low", "mid", "high"])
            ps.loc[pm.index, "drift_tercile"] = pm.sample_id.map(terc).astype("object").to_numpy()
            for t in ("low", "mid", "high"):
                ids = terc.index[terc == t]
                for m in TERCILE_METHODS:
                    if m not in wide["fidelity"].columns:
                        continue
                    fv = wide["fidelity"].loc[ids, m].to_numpy(float)
                    rv = wide["refresh_fraction"].loc[ids, m].to_numpy(float)
                    mean, lo, hi = bootstrap_means(fv, None, bootstrap_resamples, seed, confidence)
                    terc_rows.append(dict(
                        model=model, tercile=t, method=m, n=int(np.isfinite(fv).sum()),
                        drift_min=float(sd[ids].min()), drift_max=float(sd[ids].max()),
                        drift_mean=float(sd[ids].mean()),
                        refresh_fraction=float(np.nanmean(rv)) if np.isfinite(rv).any() else np.nan,
                        fidelity=mean[0], fidelity_ci_low=lo[0], fidelity_ci_high=hi[0]))

        # ---- Spearman: gap to exact vs mean drift and vs output length
        if EXACT in wide["fidelity"].columns:
            ex = wide["fidelity"][EXACT]
            per = pm.drop_duplicates("sample_id").set_index("sample_id")
            against = {"mean_drift": per["sample_drift"].reindex(samples),
                       "output_length": per["output_len_full"].reindex(samples)}
            for m in methods:
                if m in (EXACT, FULL) or m not in wide["fidelity"].columns:
                    continue
                gap = ex - wide["fidelity"][m]
                for name, x in against.items():
                    ok = gap.notna() & x.notna()
                    rho, p = _spearman(gap[ok].to_numpy(float), x[ok].to_numpy(float))
                    corr_rows.append(dict(model=model, method=m, gap="fidelity(exact) - fidelity(method)",
                                          against=name, spearman_rho=rho, p_value=p, n=int(ok.sum())))

    methods_df = pd.DataFrame(method_rows)
    terciles = pd.DataFrame(terc_rows, columns=["model", "tercile", "method", "n", "drift_min", "drift_max",
                                                 "drift_mean", "refresh_fraction", "fidelity",
                                                 "fidelity_ci_low", "fidelity_ci_high"])
    correlations = pd.DataFrame(corr_rows, columns=["model", "method", "gap", "against", "spearman_rho",
                                                    "p_value", "n"])
    stability = top_position_stability(df)
    frontier = _frontier(methods_df)
    meta = {
        "fidelity": FIDELITY_DESC,
        "rougeL_ref": REF_ROUGE_DESC,
        "cider": CIDER_DESC if cider_ok is not False else "not computed (pycocoevalcap missing)",
        "bootstrap": (f"paired percentile bootstrap, {bootstrap_resamples} resamples, seed {seed}, "
                      f"{int(confidence * 100)}% CI; one shared resample-index set per model for all "
                      "methods and differences; zero variance -> CI [x, x]"),
        "bootstrap_resamples": bootstrap_resamples, "seed": seed, "confidence": confidence,
        "drift_source": drift_src,
        "tercile_rule": "pd.qcut on the rank of the per-sample mean drift (3 equal-count bins)",
        "n_rows": int(len(df)), "n_error_rows": int(len(errors)), "n_duplicate_rows_dropped": n_dups,
        "n_samples": int(ps[["model", "sample_id"]].drop_duplicates().shape[0]),
        "n_samples_without_full": int(ps[ps.fidelity.isna()][["model", "sample_id"]].drop_duplicates()
                                      .shape[0]),
        "models": models,
        "baselines": list(baselines),
    }
    return Analysis(per_sample=ps, methods=methods_df, terciles=terciles, correlations=correlations,
                    stability=stability, frontier=frontier, errors=errors, meta=meta)


def _constant_tau(rows: pd.DataFrame) -> float | None:
    for x in rows[Col.TAU]:
        a = _as_2d(x, float)
        if a is not None and a.size:
            v = a[np.isfinite(a)]
            if v.size and np.allclose(v, v[0]):
                return float(v[0])
    return None


def _spearman(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    if len(a) < 3 or np.all(a == a[0]) or np.all(b == b[0]):
        return float("nan"), float("nan")  # undefined (constant input or too few samples)
    r = _scistats.spearmanr(a, b)
    return float(r.statistic), float(r.pvalue)


def _frontier(methods_df: pd.DataFrame) -> pd.DataFrame:
    cols = ["model", "method", "kind", "tau", "refresh_fraction", "fidelity", "fidelity_ci_low",
            "fidelity_ci_high"]
    if methods_df.empty:
        return pd.DataFrame(columns=cols)
    f = methods_df.copy()
    f["kind"] = np.where(f.method.map(parse_sweep_tau).notna(), "sweep", np.where(f.method == RCR, "rcr", "method"))
    f["tau"] = f["sweep_tau"]
    f = f[f.refresh_fraction.notna() & f.fidelity.notna()]
    return f[cols].sort_values(["model", "kind", "refresh_fraction"]).reset_index(drop=True)


# ----------------------------------------------------------------------------------------------------
# Summary table
# ----------------------------------------------------------------------------------------------------
def _fmt_ci(mean, lo, hi, signed=False, digits=3) -> str:
    if mean is None or pd.isna(mean):
        return "-"
    s = f"{mean:+.{digits}f}" if signed else f"{mean:.{digits}f}"
    if pd.isna(lo) or pd.isna(hi):
        return s
    if signed:
        return f"{s} [{lo:+.{digits}f}, {hi:+.{digits}f}]"
    return f"{s} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _fmt_num(x, digits=3) -> str:
    if x is None or pd.isna(x):
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}" if abs(x) < 10 else f"{x:.1f}"


def format_summary(analysis: Analysis) -> str:
    """The table a job prints at the end: per model, one line per method with
    fidelity mean [95% CI], difference from bacon [CI], difference from rcr [CI], realised refresh
    fraction, prefix reads (keys + values) per KV head per layer-step, tokens/s, n and errors; then the
    tercile table, the correlations and the top-position stability, and a line on how it was measured."""
    m = analysis.methods
    lines: list[str] = []
    conf = int(round(analysis.meta.get("confidence", 0.95) * 100))
    if m.empty:
        lines.append("no rows to summarise")
    for model in analysis.meta.get("models", []):
        g = m[m.model == model]
        if g.empty:
            continue
        header = ["method", f"fidelity [{conf}% CI]", "vs bacon [CI]", "vs rcr [CI]", "refresh", "reads/step",
                  "tok/s", "n", "err"]
        body = []
        for _, r in g.iterrows():
            body.append([
                str(r.method),
                _fmt_ci(r.fidelity, r.fidelity_ci_low, r.fidelity_ci_high),
                _fmt_ci(r.get("diff_bacon"), r.get("diff_bacon_ci_low"), r.get("diff_bacon_ci_high"), signed=True),
                _fmt_ci(r.get("diff_rcr"), r.get("diff_rcr_ci_low"), r.get("diff_rcr_ci_high"), signed=True),
                _fmt_num(r.refresh_fraction), _fmt_num(r.reads_per_step, 1), _fmt_num(r.tokens_per_s, 1),
                str(int(r.n)), str(int(r.n_errors)),
            ])
        widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
        lines.append(f"== model: {model or '(unnamed)'} ==")
        lines.append("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))))
        lines.append("  ".join("-" * w for w in widths))
        for b in body:
            lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(b, widths))))
        if g.rougeL_ref.notna().any() or g.cider.notna().any():
            lines.append("against references (ROUGE-L: max over references; CIDEr-D: pycocoevalcap):")
            w = max(len(str(x)) for x in g.method)
            for _, r in g.iterrows():
                lines.append(f"  {str(r.method):<{w}}  ROUGE-L {_fmt_ci(r.rougeL_ref, r.rougeL_ref_ci_low, r.rougeL_ref_ci_high)}"
                             f"   CIDEr {_fmt_ci(r.cider, r.cider_ci_low, r.cider_ci_high)}")
        t = analysis.terciles[analysis.terciles.model == model]
        if not t.empty:
            lines.append(f"drift terciles (sample drift from {analysis.meta.get('drift_source')}): "
                         "refresh fraction / fidelity")
            for tt in ("low", "mid", "high"):
                tr = t[t.tercile == tt]
                if tr.empty:
                    continue
                parts = [f"{r.method} {_fmt_num(r.refresh_fraction)} / {_fmt_num(r.fidelity)}"
                         for _, r in tr.iterrows()]
                lines.append(f"  {tt:<4} n={int(tr.n.max()):<4} drift {tr.drift_min.iloc[0]:.3g}-"
                             f"{tr.drift_max.iloc[0]:.3g}: " + ";  ".join(parts))
        c = analysis.correlations[(analysis.correlations.model == model)]
        c = c[c.method.isin([RCR, FIXED, BACON, "infinigen"])]
        if not c.empty:
            parts = []
            for meth, cg in c.groupby("method", sort=False):
                vals = {r.against: r.spearman_rho for _, r in cg.iterrows()}
                parts.append(f"{meth}: drift {_fmt_num(vals.get('mean_drift'), 2)}, "
                             f"length {_fmt_num(vals.get('output_length'), 2)}")
            lines.append("Spearman of the gap to exact with  " + ";  ".join(parts))
        s = analysis.stability[analysis.stability.model == model]
        if not s.empty:
            lines.append(f"most-attended prefix position unchanged between adjacent steps: "
                         f"{s.fraction_unchanged.iloc[0]:.1%} of {int(s.n_pairs.iloc[0])} layer-step pairs "
                         f"({int(s.n_samples.iloc[0])} samples)")
        lines.append("")
    meta = analysis.meta
    lines.append(f"errors: {meta.get('n_error_rows', 0)} row(s) excluded"
                 + (f"; {meta.get('n_samples_without_full')} sample(s) without a 'full' row"
                    if meta.get("n_samples_without_full") else ""))
    lines.append(f"fidelity: {meta.get('fidelity')}")
    lines.append(f"CI: {meta.get('bootstrap')}")
    lines.append("refresh = realised fraction of refreshed layer-steps; reads/step = prefix keys+values read "
                 "per KV head per layer-step")
    return "\n".join(lines)
