"""Do the hidden states say where things are? Linear probes, per decoder layer, of the image tokens' cell and of
the cell a description step is describing.

A description step that writes "In row two , column three , a small ..." finds that cell's tokens by content only
if two things hold: the image tokens' keys carry where they are (Qwen2-VL's vision tower has no absolute position
embedding, and M-RoPE gives the decoder an image token's place only relative to the query's own position, which
advances with every word), and the step's own query carries which cell it is on (the words that named it lie
several tokens back). One teacher-forced forward pass over prompt + reference description per held-out detailcaps
scene gives the hidden states at the input of every decoder layer; a ridge regression to the one-hot cell
(``rows * cols`` classes), fitted on the first ``--train`` scenes, names the cell of the remaining scenes'

* image tokens (the keys' side), and
* steps that write an attribute word the text has not already announced (the queries' side; the words
  ``embedded.probes.reading`` scores);

chance is 1 / cells. The ``attention`` probe's column ``cell`` says whether the steps then attend to the cell they
describe.

    python -m embedded.probes.position                                   # the embedded model, layout v4
    python -m embedded.probes.position --model DIR --layout v5 --n 12 --train 8
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
from PIL import Image

from embedded.probes.common import layout_flag, model_layout
from embedded.probes.reading import ATTRIBUTES, scored_positions
from pipeline.data import synthetic as S
from pipeline.tasks import TASKS
from rcr.models import build_inputs, load, with_answer


def probe_accuracy(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray,
                   n_classes: int, ridge: float = 1.0) -> float:
    """Held-out accuracy of a ridge regression (with bias) from features (n, d) to one-hot labels (n,)."""
    def design(x):
        return np.hstack([x, np.ones((len(x), 1))])

    a = design(x_train)
    w = np.linalg.solve(a.T @ a + ridge * np.eye(a.shape[1]), a.T @ np.eye(n_classes)[y_train])
    return float(((design(x_test) @ w).argmax(1) == y_test).mean())


def scene_hidden(model, processor, frames: list[np.ndarray], text: str):
    """One teacher-forced pass over the detailcaps prompt on ``frames`` and the answer ``text``: the hidden states at
    the input of every decoder layer of the image tokens ([layer] (tokens, hidden), merged tokens in raster order)
    and of the steps ([layer] (answer words, hidden): row k is the step that writes answer word k, which reads the
    token before it), the image's grid_thw (3,) and the answer's words."""
    tok = processor.tokenizer
    inputs = build_inputs(processor, [TASKS["detailcaps"].prompt], [[Image.fromarray(f) for f in frames]])
    answer = tok(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        hidden = model(**with_answer(inputs, torch.tensor([answer])), output_hidden_states=True).hidden_states
    n_prompt = inputs["input_ids"].shape[1]
    image = torch.zeros(hidden[0].shape[1], dtype=torch.bool)
    image[:n_prompt] = inputs["input_ids"][0] == model.config.image_token_id
    steps = slice(n_prompt - 1, n_prompt - 1 + len(answer))
    return ([h[0, image].float().numpy() for h in hidden[:-1]], [h[0, steps].float().numpy() for h in hidden[:-1]],
            inputs["image_grid_thw"][0], tok.convert_ids_to_tokens(answer))


def attribute_steps(words: list[str], lay: S.SceneLayout) -> tuple[list[int], list[int]]:
    """(answer word indices, their cell index): the steps that write an attribute word the text has not announced,
    and the cell their description is on."""
    cells, where = S.described_cells(words), scored_positions(words)
    ks = sorted(k for name in ATTRIBUTES for k in where[name] if cells[k] is not None)
    return ks, [cells[k][0] * lay.cols + cells[k][1] for k in ks]


def probe_args(doc: str, argv, n: int, train: int) -> argparse.Namespace:
    """The flags of a hidden-state probe script (this one, the ``attribute`` probe), with --n scenes of which --train
    are fitted on by default; torch threads are set."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded", help="a model directory, or 'embedded' (default)")
    layout_flag(ap)
    ap.add_argument("--n", type=int, default=n, help=f"held-out detailcaps scenes (default {n})")
    ap.add_argument("--train", type=int, default=train,
                    help=f"of them, the scenes the probe is fitted on (default {train})")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args(argv)
    args.layout = model_layout(args.model or "embedded", args.layout)
    if not 0 < args.train < args.n:
        ap.error(f"--train must be between 1 and --n - 1 = {args.n - 1}, got {args.train}")
    torch.set_num_threads(args.threads)
    return args


def main(argv=None) -> None:
    args = probe_args(__doc__, argv, n=12, train=8)
    model, processor = load(args.model)
    lay = S.get_layout(args.layout)
    keys: list[list[np.ndarray]] = []  # [scene][layer] (image tokens, hidden)
    queries: list[list[np.ndarray]] = []  # [scene][layer] (attribute steps, hidden)
    key_cells, query_cells = [], []  # [scene] (tokens,) / (steps,) the cell of each
    for i in range(args.n):
        frames, text = S.render("detailcaps", S.HELDOUT_SEED, i, layout=args.layout)
        image, steps, grid_thw, words = scene_hidden(model, processor, frames, text)
        ks, cells = attribute_steps(words, lay)
        keys.append(image)
        queries.append([h[ks] for h in steps])
        key_cells.append(S.token_cells(lay, grid_thw))
        query_cells.append(np.array(cells))
    n_cells = lay.rows * lay.cols
    print(f"{args.model} | layout {args.layout}, {args.n} held-out scenes ({args.train} to fit) | "
          f"load average {os.getloadavg()[0]:.2f}, {args.threads} thread(s)")
    print(f"cell read back by a linear probe (chance {1 / n_cells:.3f})   image tokens   attribute steps")
    for layer, (k, q) in enumerate(zip(zip(*keys), zip(*queries))):  # [scene] (rows, hidden) of one layer
        acc = [probe_accuracy(np.concatenate(x[:args.train]), np.concatenate(y[:args.train]),
                              np.concatenate(x[args.train:]), np.concatenate(y[args.train:]), n_classes=n_cells)
               for x, y in ((k, key_cells), (q, query_cells))]
        print(f"  input of layer {layer}: {acc[0]:28.3f} {acc[1]:17.3f}")


if __name__ == "__main__":
    main()
