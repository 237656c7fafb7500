"""Does a model read the image? Teacher-forced accuracy on the words that only the image can tell.

A synthetic object is written "a <size> <colour> <texture> <shape>" (pipeline/data/synthetic.py). For held-out
samples, one teacher-forced forward pass over prompt + reference answer predicts every answer token; this script
scores the four attribute words of each object phrase (the four tokens after its "a"), and, on layouts that
describe every cell, whether the word after "In row .., column .. ," is "a" or "nothing" (is the cell
occupied? printed where both answers occur).

A model that ignores the image still writes the template perfectly and copies a neighbour's colour and shape from
its own earlier text ("... , left of the blue square . In row one , column two , a small blue ..."), so overall
token accuracy says little; these words sit at chance (printed alongside) unless the model reads the scene.

    python -m embedded.probes.reading                                  # the embedded model, 8 samples per task
    python -m embedded.probes.reading --model /tmp/peek --layout v4 --n 16
"""

from __future__ import annotations

import argparse

import torch
from PIL import Image

from embedded.probes.common import layout_flag, model_layout
from pipeline.data import synthetic as S
from pipeline.tasks import TASKS
from rcr.models import build_inputs, load, with_answer

# attribute words by their offset after "a", and the chance of a uniform guess (the generator draws uniformly)
ATTRIBUTES = {"size": (1, S.SIZES), "colour": (2, tuple(S.COLOURS)), "texture": (3, S.TEXTURES),
              "shape": (4, S.SHAPES)}


def scored_positions(words: list[str]) -> dict[str, list[int]]:
    """Answer-word indices to score, per attribute ("occupied": the a/nothing after a cell's coordinates).
    An object's colour and shape are skipped when the text before it already named them ("left of the blue
    square" announces the next object): they can be copied, not only read."""
    out: dict[str, list[int]] = {k: [] for k in (*ATTRIBUTES, "occupied")}
    announced, phrases = False, set(S.object_phrases(words))
    for i, w in enumerate(words):
        w = w.lower()  # a caption starts with "A"
        if i in phrases:
            for name, (off, vocab) in ATTRIBUTES.items():
                assert words[i + off] in vocab, (words[i:i + 5], name)
                if not (announced and name in ("colour", "shape")):
                    out[name].append(i + off)
            announced = False
        if w in ("a", "nothing") and i >= 3 and words[i - 1] == "," and words[i - 3] == "column":
            out["occupied"].append(i)
        if w == "left" and words[i + 1:i + 3] == ["of", "the"]:
            announced = True
    return out


def probe(model, processor, task: str, layout: str, n: int) -> dict[str, tuple[int, int, float]]:
    """(correct, scored, chance) per word class over ``n`` held-out samples of ``task``; the chance of
    "occupied" is its majority answer's share."""
    tok = processor.tokenizer
    counts = {k: [0, 0] for k in (*ATTRIBUTES, "occupied")}
    n_a = 0
    for i in range(n):
        frames, text = S.render(task, S.HELDOUT_SEED, i, layout=layout)
        inputs = build_inputs(processor, [TASKS[task].prompt], [[Image.fromarray(f) for f in frames]],
                              video=task == "video")
        answer = tok(text, add_special_tokens=False)["input_ids"]
        words = tok.convert_ids_to_tokens(answer)
        n_prompt = inputs["input_ids"].shape[1]
        with torch.no_grad():
            logits = model(**with_answer(inputs, torch.tensor([answer]))).logits[0]
        pred = logits[n_prompt - 1:-1].argmax(-1).tolist()  # position n_prompt - 1 + k predicts answer word k
        for name, where in scored_positions(words).items():
            counts[name][0] += sum(pred[k] == answer[k] for k in where)
            counts[name][1] += len(where)
            n_a += sum(words[k] == "a" for k in where) if name == "occupied" else 0
    chance = {name: 1 / len(vocab) for name, (_, vocab) in ATTRIBUTES.items()}
    chance["occupied"] = max(n_a, counts["occupied"][1] - n_a) / max(1, counts["occupied"][1])
    return {k: (c, m, chance[k]) for k, (c, m) in counts.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    layout_flag(ap)
    ap.add_argument("--tasks", default="detailcaps,textcaps")
    ap.add_argument("--n", type=int, default=8, help="held-out samples per task")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    args.layout = model_layout(args.model or "embedded", args.layout)
    torch.set_num_threads(args.threads)
    from rcr.embedded import model_dir

    model, processor = load(args.model or str(model_dir()))
    print(f"model {args.model or 'embedded'}, layout {args.layout}, {args.n} held-out samples per task; "
          f"accuracy (words scored) [chance]")
    for task in args.tasks.split(","):
        res = probe(model, processor, S.check_task(task), args.layout, args.n)
        cells = [f"{name} {c / m:.2f} ({m}) [{chance:.2f}]" for name, (c, m, chance) in res.items() if m and chance < 1]
        print(f"{task:<11} " + "  ".join(cells))


if __name__ == "__main__":
    main()
