"""The doc functions and metrics of the local caption tasks that ``pipeline/lmms/tasks.py`` writes: lmms-eval
reads the project's input shards (``pipeline.schema.INPUT_SCHEMA``) as Parquet through ``datasets``.

ROUGE-L and CIDEr are scored as lmms-eval scores its own DetailCaps and TextCaps tasks (their ``utils.py``):
pycocoevalcap's PTB tokenizer (Java) on references and predictions, then pycocoevalcap's ``Rouge`` and
``Cider`` over the whole task, each sample against all of its references.
"""

from __future__ import annotations

METRICS = ("ROUGE_L", "CIDEr")


def process_docs(docs):
    """The ``images`` column (PNG/JPEG bytes) as a list of ``datasets.Image``: decoded to PIL on access, and left
    out of lmms-eval's logged samples with the other media."""
    from datasets import Image, List

    return docs.cast_column("images", List(Image()))


def doc_to_visual(doc) -> list:
    return [im.convert("RGB") for im in doc["images"]]


def doc_to_text(doc, lmms_eval_specific_kwargs=None) -> str:
    return doc["prompt"]


def doc_to_target(doc) -> list[str]:
    return list(doc["references"])


def process_results(doc, results) -> dict:
    pred = results[0] if results else ""
    data = {"answer": list(doc["references"]), "pred": pred, "image_id": doc["sample_id"]}
    return {name: data for name in METRICS}


def _coco_score(results: list[dict], scorer) -> float:
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    tokenizer = PTBTokenizer()
    gts = tokenizer.tokenize({r["image_id"]: [{"caption": a} for a in r["answer"]] for r in results})
    res = tokenizer.tokenize({r["image_id"]: [{"caption": r["pred"]}] for r in results})
    score, _ = scorer.compute_score(gts, res)
    return float(score)


def rouge_l(results: list[dict], args=None) -> float:
    from pycocoevalcap.rouge.rouge import Rouge

    return _coco_score(results, Rouge())


def cider(results: list[dict], args=None) -> float:
    from pycocoevalcap.cider.cider import Cider

    return _coco_score(results, Cider())
