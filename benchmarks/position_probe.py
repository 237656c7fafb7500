"""Does a visual token's hidden state say which cell of the scene it lies in? A linear probe, per decoder layer.

A description step that writes "In row two , column three , a ..." can find that cell's tokens by content only if
their keys carry where they are: Qwen2-VL's vision tower has no absolute position embedding, and M-RoPE gives the
decoder an image token's place only relative to the query's own position. This script takes the image tokens'
hidden states at the input of every decoder layer (one prompt forward pass per held-out detailcaps scene), fits a
ridge regression from them to the one-hot cell (``rows * cols`` classes) on the first ``--train`` scenes, and
prints the share of the remaining scenes' tokens whose cell it names (chance: 1 / cells). benchmarks/
attention_profile.py's column ``cell`` says whether the description steps then attend to the cell they describe.

    python benchmarks/position_probe.py                                   # the embedded model, layout v4
    python benchmarks/position_probe.py --model DIR --layout v5 --n 12 --train 8
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.attention_profile import token_cells  # noqa: E402
from pipeline.data import synthetic as S  # noqa: E402
from rcr.models import build_inputs, load  # noqa: E402


def probe_accuracy(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray,
                   n_classes: int, ridge: float = 1.0) -> float:
    """Held-out accuracy of a ridge regression (with bias) from features (n, d) to one-hot labels (n,)."""
    def design(x):
        return np.hstack([x, np.ones((len(x), 1))])

    a = design(x_train)
    w = np.linalg.solve(a.T @ a + ridge * np.eye(a.shape[1]), a.T @ np.eye(n_classes)[y_train])
    return float(((design(x_test) @ w).argmax(1) == y_test).mean())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded", help="a model directory, or 'embedded' (default)")
    ap.add_argument("--layout", default=S.DEFAULT_LAYOUT, choices=sorted(S.LAYOUTS), help="synthetic scene layout")
    ap.add_argument("--n", type=int, default=12, help="held-out detailcaps scenes (default 12)")
    ap.add_argument("--train", type=int, default=8, help="of them, the scenes the probe is fitted on (default 8)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args(argv)
    if not 0 < args.train < args.n:
        ap.error(f"--train must be between 1 and --n - 1 = {args.n - 1}, got {args.train}")
    torch.set_num_threads(args.threads)
    model, processor = load(args.model)
    lay = S.get_layout(args.layout)
    per_scene: list[list[np.ndarray]] = []  # [scene][layer] (tokens, hidden)
    cells = []
    for i in range(args.n):
        frames, _ = S.render("detailcaps", S.HELDOUT_SEED, i, layout=args.layout)
        inputs = build_inputs(processor, [S.PROMPTS["detailcaps"]], [[Image.fromarray(f) for f in frames]])
        with torch.no_grad():
            hidden = model(**inputs, output_hidden_states=True).hidden_states  # (layers + 1) x (1, T, D)
        image = inputs["input_ids"][0] == model.config.image_token_id
        per_scene.append([h[0, image].float().numpy() for h in hidden[:-1]])  # the input of each decoder layer
        cells.append(token_cells(lay, inputs["image_grid_thw"][0]))
    n_cells = lay.rows * lay.cols
    y_train, y_test = np.concatenate(cells[:args.train]), np.concatenate(cells[args.train:])
    print(f"{args.model} | layout {args.layout}, {args.n} held-out scenes ({args.train} to fit) | "
          f"load average {os.getloadavg()[0]:.2f}, {args.threads} thread(s)")
    print(f"image tokens' cell read back by a linear probe (chance {1 / n_cells:.3f})")
    for layer, scenes in enumerate(zip(*per_scene)):  # [scene] (tokens, hidden) of one layer
        acc = probe_accuracy(np.concatenate(scenes[:args.train]), y_train, np.concatenate(scenes[args.train:]),
                             y_test, n_classes=n_cells)
        print(f"  input of layer {layer}: {acc:.3f}")


if __name__ == "__main__":
    main()
