"""What the embedded model trains on, step by step: the curriculum's task mix and scenes, and the learning rates.

Every batch is a pure function of (seed, step): batch ``s`` always holds the same samples, so a run that is
interrupted and resumed from its last checkpoint sees exactly the batches it would have seen.

Vision has to be bootstrapped on easy images first: with the final mix from step 0 the tiny model settles on the
language prior and guesses colours at chance for hundreds of steps, while captions of a few objects on a small flat
canvas (``BOOTSTRAP_LAYOUT``) teach colours in a few hundred. On the final layout's 320 visual tokens of textured
canvas, the 1-4 tokens of an object are lost among 300 varied background tokens while answer tokens still attend to
every visual token alike; reading learnt on the flat canvas carries over to a bigger flat one but not to texture, and
a full-strength textured canvas unlearns it, so the texture fades in from flat grey.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from pipeline.data import synthetic as S

BOOTSTRAP_LAYOUT = "v1"
CURRICULUM = (
    # (until frac, {task: weight}, detailcaps objects (lo, hi) or None for the layout's own, share on the recipe's
    #  layout, its canvas strength (at the phase's start, at its end), linear in between; None = full)
    (0.15, {"detailcaps": 0.1, "textcaps": 0.8, "video": 0.1}, (2, 4), 0.0, None),  # vision reads colours first
    (0.30, {"detailcaps": 0.45, "textcaps": 0.3, "video": 0.25}, (2, 14), 0.0, None),  # then whole scenes
    (0.45, {"detailcaps": 0.5, "textcaps": 0.3, "video": 0.2}, (2, 18), 0.5, (0.0, 0.5)),  # the big canvas, flat first
    (0.60, {"detailcaps": 0.6, "textcaps": 0.15, "video": 0.25}, None, 1.0, (0.5, 1.0)),  # its texture fades in
    (1.01, {"detailcaps": 0.6, "textcaps": 0.15, "video": 0.25}, None, 1.0, None),
)
LAST_PHASE = CURRICULUM[-2][0]  # where the last phase starts, as a fraction of the main stage's steps
BATCH_SIZES = {"detailcaps": 5, "textcaps": 8, "video": 6}
# stored in every checkpoint: a run resumes only under the curriculum it started with
CURRICULUM_ID = hashlib.sha256(repr((BOOTSTRAP_LAYOUT, CURRICULUM, BATCH_SIZES)).encode()).hexdigest()[:12]


def batch_plan(seed: int, step: int, total_steps: int, batch_scale: float, layout: str,
               mix: dict[str, float] | None = None):
    """(task, scene layout, [(seed, index, n_objects)], canvas strength) for one step; a pure function of its
    arguments. ``mix`` ({task: weight}) replaces the phase's task mix (the polish stage's); the rest of the plan,
    and the random numbers it is drawn with, stay the phase's."""
    rng = np.random.default_rng([seed, 7, step])
    frac = step / max(1, total_steps)
    phase = next(i for i, c in enumerate(CURRICULUM) if frac < c[0])
    until, weights, n_range, share, canvas = CURRICULUM[phase]
    start = CURRICULUM[phase - 1][0] if phase else 0.0
    strength = 1.0 if canvas is None else canvas[0] + (canvas[1] - canvas[0]) * (frac - start) / (until - start)
    p = np.array([(weights if mix is None else mix).get(t, 0.0) for t in S.TASKS])
    task = S.TASKS[int(rng.choice(len(S.TASKS), p=p / p.sum()))]
    bs = max(1, int(round(BATCH_SIZES[task] * batch_scale)))
    lay = layout if rng.random() < share else BOOTSTRAP_LAYOUT
    n_cells = S.get_layout(lay).rows * S.get_layout(lay).cols
    items = []
    for i in range(bs):
        n_obj = None
        if task == "detailcaps" and n_range is not None:
            n_obj = int(rng.integers(n_range[0], min(n_range[1], n_cells) + 1))
        items.append((seed, step * 64 + i, n_obj))
    return task, lay, items, (min(1.0, strength) if lay == layout else 1.0)


def make_batch(builder, seed: int, step: int, total_steps: int, batch_scale: float, layout: str,
               ground: tuple[str, ...] = (), mix: dict[str, float] | None = None):
    """(task, batch) of one step (``builder``: a ``batches.BatchBuilder``); ``ground`` (tasks) adds the grounding
    loss's attention targets to those tasks' batches on ``layout``'s scenes; ``mix`` as in ``batch_plan``."""
    task, lay, items, strength = batch_plan(seed, step, total_steps, batch_scale, layout, mix)
    samples = [S.render(task, s, idx, n_objects=n, layout=lay, canvas_strength=strength) for s, idx, n in items]
    if task not in ground or lay != layout:
        return task, builder.build(task, samples)
    placed = [S.textcaps_cells(s, idx, lay) for s, idx, _ in items] if task == "textcaps" else None
    return task, builder.build(task, samples, ground=S.get_layout(lay), placed=placed)


def cosine_lr(lr: float, warmup: int, total: int, step: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 5% of ``lr`` at ``total``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def cooled_lr(lr: float, cooldown: float, total: int, step: int) -> float:
    """The polish stage's rate at its ``step`` (0-based): ``lr``, then over its last ``cooldown`` fraction of
    ``total`` steps a linear fall, to lr / (cooldown * total) at the last step (the rate a step to 0 would leave).
    A constant rate would end the stage wherever its last batches put the weights."""
    cool = round(cooldown * total)
    left = total - step  # steps still to take, this one included
    return lr * (min(1.0, left / cool) if cool else 1.0)
