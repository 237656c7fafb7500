"""Does an object's visual token say what the object is? A linear probe per attribute and decoder layer.

A description step can only read an object's size, colour, texture and shape from the image if the tokens it
attends to carry them. This script takes the hidden states of the image tokens that cover an object (tokens not
flat on the scene's flat-canvas twin) at the input of every decoder layer, fits a ridge regression from them to
their object's attribute on the first ``--train`` held-out detailcaps scenes, and prints the share of the remaining
scenes' object tokens it names, beside the commonest value's share (what a probe that learnt nothing scores).
The ``position`` probe asks the same of a token's cell; the ``reading`` probe whether the decoder's words then get
the attributes right.

    python -m embedded.probes.attribute                                  # the embedded model, layout v4
    python -m embedded.probes.attribute --model DIR --n 16 --train 11
"""

from __future__ import annotations

import os

import numpy as np
import torch

from embedded.probes.common import flat_tokens
from embedded.probes.position import probe_accuracy, probe_args, scene_hidden
from embedded.probes.reading import ATTRIBUTES
from pipeline.data import synthetic as S
from rcr.models import load


def cell_objects(text: str, lay: S.SceneLayout) -> dict[int, list[str]]:
    """{cell index (row * cols + col): [size, colour, texture, shape]} of a detailcaps description."""
    number = {w: i for i, w in enumerate(S.NUMBER_WORDS)}
    words, out = text.split(), {}
    for i in range(len(words) - 7):  # "row two , column three , a <size> <colour> <texture> <shape>"
        if words[i] == "row" and words[i + 3] == "column" and words[i + 6] == "a":
            out[number[words[i + 1]] * lay.cols + number[words[i + 4]]] = words[i + 7:i + 11]
    return out


def object_token_labels(text: str, lay: S.SceneLayout, flat_twin: np.ndarray,
                        grid_thw: torch.Tensor) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(keep (tokens,) bool, {attribute: (kept,) value index}): the merged tokens that cover part of an object
    (not flat on ``flat_twin``, the scene on a flat canvas), and each one's object's attributes."""
    cells = S.token_cells(lay, grid_thw)
    objects = cell_objects(text, lay)
    keep = ~flat_tokens(flat_twin, grid_thw).numpy() & np.isin(cells, list(objects))
    labels = {name: np.array([vocab.index(objects[c][off - 1]) for c in cells[keep]])
              for name, (off, vocab) in ATTRIBUTES.items()}
    return keep, labels


def main(argv=None) -> None:
    args = probe_args(__doc__, argv, n=16, train=11)
    model, processor = load(args.model)
    lay = S.get_layout(args.layout)
    per_scene, labels = [], []  # [scene][layer] (object tokens, hidden); [scene] {attribute: (object tokens,)}
    for i in range(args.n):
        frames, text = S.render("detailcaps", S.HELDOUT_SEED, i, layout=args.layout)
        twin, _ = S.render("detailcaps", S.HELDOUT_SEED, i, layout=args.layout, canvas_strength=0.0)
        hidden, _, grid_thw, _ = scene_hidden(model, processor, frames, text)
        keep, lab = object_token_labels(text, lay, twin[0], grid_thw)
        per_scene.append([h[keep] for h in hidden])
        labels.append(lab)
    print(f"{args.model} | layout {args.layout}, {args.n} held-out scenes ({args.train} to fit), "
          f"{sum(len(x['size']) for x in labels)} object tokens | load average {os.getloadavg()[0]:.2f}, "
          f"{args.threads} thread(s)")
    layers = len(per_scene[0])
    print(f"object tokens' attribute read back by a linear probe, input of layer {' / '.join(map(str, range(layers)))}")
    for name, (_, vocab) in ATTRIBUTES.items():
        y_train = np.concatenate([x[name] for x in labels[:args.train]])
        y_test = np.concatenate([x[name] for x in labels[args.train:]])
        common = np.bincount(y_test, minlength=len(vocab)).max() / len(y_test)
        accs = [probe_accuracy(np.concatenate(scenes[:args.train]), y_train, np.concatenate(scenes[args.train:]),
                               y_test, n_classes=len(vocab)) for scenes in zip(*per_scene)]
        print(f"  {name:8s} commonest {common:.3f} | " + " / ".join(f"{a:.3f}" for a in accs))


if __name__ == "__main__":
    main()
