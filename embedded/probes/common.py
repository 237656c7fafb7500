"""What the probes of the embedded model share: held-out synthetic samples, their greedy answers with the
synthetic scenes' masks (flat canvas, described cell), the probes' common flags, and the pipeline's own evaluator
over held-out samples.

Held-out samples are drawn with ``synthetic.HELDOUT_SEED``, which training never uses.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd
import torch
from PIL import Image

from pipeline.data import synthetic as S
from pipeline.diagnose.attention import Answer, greedy_answers, visual_token_ids
from pipeline.run.actor import SampleEvaluator
from pipeline.run.config import JobConfig
from pipeline.tasks import TASKS


def layout_flag(ap: argparse.ArgumentParser) -> None:
    """``--layout``, whose default is the layout the model was trained on (``model_layout``)."""
    ap.add_argument("--layout", default=None, choices=sorted(S.LAYOUTS),
                    help="synthetic scene layout (default: the one the model was trained on, from its recipe)")


def model_layout(model: str, layout: str | None) -> str:
    """``layout`` where given, else the scene layout ``model`` was trained on (the recipe its directory carries),
    else the default embedded model's."""
    from rcr.embedded import scene_layout

    return layout or scene_layout(model) or S.DEFAULT_LAYOUT


def sample_args(ap: argparse.ArgumentParser, n: int) -> None:
    """The arguments of a probe over held-out samples: model, layout, task, n, answer length, threads."""
    ap.add_argument("--model", default="embedded", help="a model directory, a Hub id, or an embedded model's "
                    "name ('embedded', the default, or 'embedded-drift')")
    layout_flag(ap)
    ap.add_argument("--task", default="detailcaps", choices=S.TASKS)
    ap.add_argument("--n", type=int, default=n, help=f"held-out samples (default {n})")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")


def flat_tokens(frame: np.ndarray, grid_thw: torch.Tensor, patch: int = 28) -> torch.Tensor:
    """(tokens,) bool: which merged visual tokens (raster order) cover a block of one flat colour (the empty
    background). The synthetic images are multiples of 28 px, so the processor does not resize them and block k
    is token k."""
    _, gh, gw = (int(x) for x in grid_thw)
    h, w = gh // 2, gw // 2
    if frame.shape[:2] != (h * patch, w * patch):
        raise ValueError(f"image {frame.shape[:2]} was resized to {h * patch}x{w * patch}: blocks do not map to tokens")
    blocks = frame.reshape(h, patch, w, patch, -1)
    return torch.from_numpy((blocks == blocks[:, :1, :, :1]).all(axis=(1, 3, 4)).reshape(-1))


def cell_masks(words: list[str], lay: S.SceneLayout, image: torch.Tensor, grid_thw: torch.Tensor,
               patch: int = 28) -> torch.Tensor:
    """(steps, N) bool: per answer step, the prompt's image tokens (merged, raster order; ``image`` marks them)
    whose ``patch`` px block lies in the step's described cell."""
    cells = torch.from_numpy(S.token_cells(lay, grid_thw, patch))  # (h * w,)
    masks = torch.zeros(len(words), len(image), dtype=torch.bool)
    where = image.nonzero().squeeze(-1)  # (h * w,) prompt positions of the image tokens
    for k, cell in enumerate(S.described_cells(words)):
        if cell is not None:
            masks[k, where[cells == cell[0] * lay.cols + cell[1]]] = True
    return masks


def held_out_answers(model, processor, task: str, layout: str, n: int | list[int], max_new_tokens: int,
                     seed: int = S.HELDOUT_SEED) -> list[Answer]:
    """The greedy answers to the first ``n`` held-out samples of ``task`` (or those of the indices ``n``), with the
    masks of the flat canvas (single images) and, for descriptions that walk every cell, of each step's described
    cell."""
    scenes = [S.render(task, seed, i, layout=layout)[0] for i in (range(n) if isinstance(n, int) else n)]
    samples = [(TASKS[task].prompt, [Image.fromarray(f) for f in frames], task == "video") for frames in scenes]
    answers = greedy_answers(model, processor, samples, max_new_tokens)
    visual = visual_token_ids(model)
    lay = S.get_layout(layout)
    for frames, a in zip(scenes, answers):
        if task == "video" or "image_grid_thw" not in a.inputs:
            continue
        image = torch.tensor([int(t) in visual for t in a.inputs["input_ids"][0]])
        grid = a.inputs["image_grid_thw"][0]
        flat = torch.zeros_like(image)
        flat[image] = flat_tokens(frames[0], grid)
        a.masks["flat"] = flat
        if task == "detailcaps" and lay.every_cell:
            words = processor.tokenizer.convert_ids_to_tokens(a.answer[0].tolist())
            a.masks["at_cell"] = cell_masks(words, lay, image, grid)
    return answers


def evaluate_task(cfg: JobConfig, task: str, n: int, seed: int, layout: str, log=print,
                  n_objects: int | None = None, label: str | None = None) -> pd.DataFrame:
    """Output rows (the job's Parquet schema, as a DataFrame) of ``n`` held-out samples of ``task`` through the
    pipeline's own evaluator (``SampleEvaluator``, the callable class a Ray actor runs), in batches of
    ``max(batch_size, 8)`` samples (detailcaps scenes of ``n_objects`` objects if given; ``label`` names them in
    the progress lines)."""
    ev = SampleEvaluator(cfg.to_dict())
    parts, t0, step = [], time.time(), max(cfg.batch_size, 8)
    for start in range(0, n, step):
        recs = [S.make_record(task, seed, i, layout=layout, n_objects=n_objects)
                for i in range(start, min(n, start + step))]
        batch = {k: [r[k] for r in recs] for k in recs[0]}
        parts.append(ev(batch).to_pandas())
        log(f"  {label or task}: {min(n, start + step)}/{n} samples, {time.time() - t0:.0f} s", flush=True)
    rows = pd.concat(parts, ignore_index=True)
    errors = rows[rows["error"].notna()]
    if len(errors):
        raise SystemExit(f"{len(errors)} error row(s), e.g. {errors.iloc[0]['sample_id']}: {errors.iloc[0]['error']}")
    return rows
