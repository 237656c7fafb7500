"""Quality bars of the embedded default model, on held-out synthetic samples (seed
``pipeline.synthetic.HELDOUT_SEED``; training uses seed 0, so none of these was seen in training).

    python jobs/eval_embedded.py                     # the shipped model in assets/embedded/model
    python jobs/eval_embedded.py --model runs/train_embedded/final --n-detail 50   # quick look

Bars (issue 3):
  * greedy uncompressed output vs ground truth, ROUGE-L F1: detailcaps >= 0.85 (200 samples),
    textcaps >= 0.9, video >= 0.8;
  * attention wanders: on detailcaps, in at most 80% of layer-steps the most-attended prefix position is
    the same as at the step before (``rcr`` telemetry ``top_prefix_pos`` of the ``full`` decode);
  * a static 32+32 selection (``bacon``: 32 selected prefix entries + the 32-token window) loses fidelity:
    its ROUGE-L against the uncompressed output is <= 0.8 on detailcaps.

ROUGE-L is ``rouge_score``'s, with a tokenizer that keeps every token (words and punctuation; the
package's default tokenizer would drop non-alphanumerics). Exit status 1 if a bar is missed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pipeline.data import synthetic as S  # noqa: E402

DEFAULT_MODEL = REPO / "assets" / "embedded" / "model"
MAX_NEW_TOKENS = {"detailcaps": 256, "textcaps": 40, "video": 80}
BARS = {"detailcaps": 0.85, "textcaps": 0.90, "video": 0.80}
WANDER_BAR = 0.80
STATIC_BAR = 0.80


class KeepAllTokenizer:
    """Words and punctuation marks, case kept: every token the model emits counts."""

    _re = re.compile(r"\w+|[^\w\s]", re.UNICODE)

    def tokenize(self, text: str) -> list[str]:
        return self._re.findall(text)


_SCORER = None


def rouge_l(reference: str, candidate: str) -> float:
    global _SCORER
    if _SCORER is None:
        from rouge_score import rouge_scorer

        _SCORER = rouge_scorer.RougeScorer(["rougeL"], tokenizer=KeepAllTokenizer())
    if not reference.strip() and not candidate.strip():
        return 1.0
    return float(_SCORER.score(reference, candidate)["rougeL"].fmeasure)


def load(path: str | Path):
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(str(path))
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(path)).eval()
    return model, processor


def batch_inputs(processor, task: str, frames_list: list[list[np.ndarray]]):
    """Left-padded processor batch for synthetic samples of one task (what the pipeline feeds a model)."""
    from PIL import Image

    kind = "video" if task == "video" else "image"
    messages = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": S.PROMPTS[task]}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    texts = [text] * len(frames_list)
    if task == "video":
        vids = [[Image.fromarray(f) for f in frames] for frames in frames_list]
        return processor(text=texts, videos=vids, padding=True, return_tensors="pt")
    imgs = [Image.fromarray(frames[0]) for frames in frames_list]
    return processor(text=texts, images=imgs, padding=True, return_tensors="pt")


def _have_rcr() -> bool:
    try:
        import rcr  # noqa: F401

        return hasattr(rcr, "generate") and hasattr(rcr, "RCRConfig")
    except ImportError:
        return False


def decode_texts(processor, seqs) -> list[str]:
    return [t.strip() for t in processor.batch_decode(seqs, skip_special_tokens=True)]


def evaluate_task(model, processor, task: str, n: int, seed: int, batch_size: int, static: bool,
                  use_rcr: bool, log=print) -> dict:
    import torch

    truths, fulls, statics, same, total = [], [], [], 0, 0
    t0 = time.time()
    for start in range(0, n, batch_size):
        idx = list(range(start, min(n, start + batch_size)))
        samples = [S.render(task, seed, i) for i in idx]
        inputs = batch_inputs(processor, task, [s[0] for s in samples])
        truths += [s[1] for s in samples]
        with torch.no_grad():
            if use_rcr:
                import rcr

                methods = ["full", "bacon"] if static else ["full"]
                out = rcr.generate(model, inputs, method=methods, max_new_tokens=MAX_NEW_TOKENS[task],
                                   config=rcr.RCRConfig(record_attention=True))
                fulls += decode_texts(processor, out["full"].sequences)
                if static:
                    statics += decode_texts(processor, out["bacon"].sequences)
                for b in range(len(idx)):
                    top = out["full"].sample(b)["top_prefix_pos"]  # (L, steps)
                    if top is not None and top.shape[1] > 1:
                        same += int((top[:, 1:] == top[:, :-1]).sum())
                        total += int(top[:, 1:].size)
            else:
                gen = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS[task], do_sample=False)
                fulls += decode_texts(processor, gen[:, inputs["input_ids"].shape[1]:])
        done = len(fulls)
        log(f"  {task}: {done}/{n} samples, {time.time() - t0:.0f} s", flush=True)
    res = {
        "task": task, "n": n,
        "rouge_vs_truth": float(np.mean([rouge_l(t, f) for t, f in zip(truths, fulls)])),
        "exact_match": float(np.mean([t == f for t, f in zip(truths, fulls)])),
        "mean_truth_tokens": float(np.mean([len(t.split()) for t in truths])),
        "seconds": time.time() - t0,
        "examples": [{"truth": truths[0], "full": fulls[0], **({"static": statics[0]} if statics else {})}],
    }
    if total:
        res["same_top_fraction"] = same / total
    if statics:
        res["static_rouge_vs_full"] = float(np.mean([rouge_l(f, s) for f, s in zip(fulls, statics)]))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--n-detail", type=int, default=200)
    ap.add_argument("--n-textcaps", type=int, default=200)
    ap.add_argument("--n-video", type=int, default=100)
    ap.add_argument("--seed", type=int, default=S.HELDOUT_SEED)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-rcr", action="store_true", help="plain model.generate; skips the wander/static bars")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    use_rcr = _have_rcr() and not args.no_rcr
    model, processor = load(args.model)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {args.model}: {n_params / 1e6:.2f} M params; held-out seed {args.seed}; "
          f"{'rcr.generate (full + bacon)' if use_rcr else 'model.generate (no rcr: wander/static bars skipped)'}")
    results = {}
    for task, n in (("detailcaps", args.n_detail), ("textcaps", args.n_textcaps), ("video", args.n_video)):
        if n > 0:
            results[task] = evaluate_task(model, processor, task, n, args.seed, args.batch_size,
                                          static=(task == "detailcaps"), use_rcr=use_rcr)

    ok = True
    print("\n=== embedded model quality bars (held-out synthetic samples) ===")
    for task, r in results.items():
        bar = BARS[task]
        passed = r["rouge_vs_truth"] >= bar
        ok &= passed
        print(f"{task:10s} n={r['n']:3d}  ROUGE-L(greedy, truth) = {r['rouge_vs_truth']:.4f}  (bar >= {bar})  "
              f"{'PASS' if passed else 'FAIL'}   exact match {r['exact_match']:.2f}, mean truth length "
              f"{r['mean_truth_tokens']:.0f} tokens")
    d = results.get("detailcaps")
    if d is not None and "same_top_fraction" in d:
        passed = d["same_top_fraction"] <= WANDER_BAR
        ok &= passed
        print(f"wander     detailcaps: most-attended prefix position same as previous step in "
              f"{d['same_top_fraction']:.1%} of layer-steps  (bar <= {WANDER_BAR:.0%})  {'PASS' if passed else 'FAIL'}")
    if d is not None and "static_rouge_vs_full" in d:
        passed = d["static_rouge_vs_full"] <= STATIC_BAR
        ok &= passed
        print(f"static     detailcaps: ROUGE-L(bacon 32+32, uncompressed) = {d['static_rouge_vs_full']:.4f}  "
              f"(bar <= {STATIC_BAR})  {'PASS' if passed else 'FAIL'}")
    for task in ("textcaps", "video"):
        r = results.get(task)
        if r is not None and "same_top_fraction" in r:
            print(f"(info)     {task}: same most-attended position in {r['same_top_fraction']:.1%} of layer-steps")
    if d is not None:
        print("\nexample (detailcaps):\n  truth : " + d["examples"][0]["truth"] + "\n  greedy: " + d["examples"][0]["full"]
              + ("\n  bacon : " + d["examples"][0]["static"] if "static" in d["examples"][0] else ""))
    print("\nALL BARS MET" if ok else "\nSOME BARS MISSED")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "rcr": use_rcr, "results": results,
                                               "all_bars_met": ok}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
