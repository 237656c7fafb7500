"""Text metrics: the project's Unicode tokenizer, ROUGE-L (rouge-score) and CIDEr-D (pycocoevalcap).

Every ROUGE-L in the project is :func:`rouge_l_f1` (the job summary, the statistics, the embedded model's
quality bars), so a score means the same thing wherever it is printed.
"""

from __future__ import annotations

import functools
import os
import unicodedata
from collections.abc import Sequence

import numpy as np
from rouge_score.tokenizers import Tokenizer  # its abstract base, so that RougeScorer accepts ours


def _is_cjk_char(ch: str) -> bool:
    o = ord(ch)
    return (0x4E00 <= o <= 0x9FFF or 0x3400 <= o <= 0x4DBF or 0x20000 <= o <= 0x2EBEF
            or 0xF900 <= o <= 0xFAFF or 0x3040 <= o <= 0x30FF or 0x31F0 <= o <= 0x31FF)


class UnicodeTokenizer(Tokenizer):
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
                 "RougeScorer(['rougeL']) with pipeline.analysis.text_metrics.UnicodeTokenizer (NFKC, lowercase, "
                 "runs of Unicode letters/digits/marks, one token per CJK ideograph/kana, no stemming); "
                 "both empty -> 1.0")
REF_ROUGE_DESC = ("ROUGE-L F1 vs references; rouge-score 0.1.2 with pipeline.analysis.text_metrics.UnicodeTokenizer; "
                  "multi-reference rule: max F1 over the references (RougeScorer.score_multi)")
CIDER_DESC = ("CIDEr-D; package pycocoevalcap 1.2 Cider(n=4, sigma=6) (pure Python; its Java PTB tokenizer "
              "is not used), texts tokenised by pipeline.analysis.text_metrics.UnicodeTokenizer and space-joined; "
              "multi-reference rule: CIDEr consensus (mean over references); IDF from the references of "
              "the samples scored together, one corpus per (model, method)")

_TOKENIZER = UnicodeTokenizer()


@functools.cache
def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False, tokenizer=_TOKENIZER)


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


def reference_length_gaps(candidates: Sequence[str], references: Sequence[Sequence[str]]) -> np.ndarray:
    """Per sample, the smallest difference in words (:func:`cider_scores`' tokens) between ``candidates[i]`` and one
    of ``references[i]``: CIDEr-D's length penalty exp(-d^2 / (2 * 6^2)) is ~0 beyond a few dozen (NaN without
    references)."""
    out = np.full(len(candidates), np.nan)
    for i, (c, refs) in enumerate(zip(candidates, references)):
        n = len(_TOKENIZER.tokenize(c or ""))
        gaps = [abs(n - len(_TOKENIZER.tokenize(r))) for r in (list(refs) if refs is not None else []) if r is not None]
        if gaps:
            out[i] = min(gaps)
    return out


PARALLEL_MIN_CELLS = 50_000_000  # ~20 s of serial scoring: below that, worker start-up is not worth it


def rouge_pairs(pairs: list[tuple[str, str]], n_jobs: int | None = None) -> list[float]:
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

