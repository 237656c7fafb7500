"""The embedded default's bars: the premise check on held-out synthetic samples, plus the embedded model's own bars
(``embedded/evaluate.py``). Exit status 1 if a bar is missed. Installed: ``rcr-eval-embedded``.

    python jobs/eval_embedded.py                                   # the shipped model, 100 samples per task
    python jobs/eval_embedded.py --model ~/rcr-runs/train_embedded/model --n 20   # a candidate, quick look
"""

from embedded.evaluate import main

if __name__ == "__main__":
    raise SystemExit(main())
