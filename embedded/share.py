"""The share stage: the drift test bed's last stage (``rcr/embedded_drift_model``, docs/embedded.md).

In a real VLM most of a decode step's attention rests on the sink and the text, and the image's share of it differs
from image to image; drift, the attention mass a step would put on evicted entries, scales with that share. The
default embedded model gives the image about the same share in every sample, so every sample drifts alike. This
stage gives each scene a share of its own, set by a property the image shows: on a tinted layout
(``synthetic.scene_tint``), the target share of every description step in the supervised layers is log-linear in
the tint, from ``share_range[0]`` at tint 0 to ``share_range[1]`` at tint 1 (``losses.image_share_loss``). It says
how much of a step's attention goes to the image, never which entries a KV-cache method keeps.

Its batches are the polish stage's (the main stage's last ``share_steps`` plan steps, ``polish_seed``, the polish
mix) on ``share_layout``'s scenes, at the polish rate and cooldown, with the polish stage's grounding (relative to
the image mass where the share loss applies). It starts from the finished polish stage, or from a saved model whose
recipe agrees on every other field (``--init-from``), in both cases with an optimizer of its own
(``share_optimizer``), so that the two starts train alike; it checkpoints to ``share.pt``.
"""

from __future__ import annotations

import math

from pipeline.data import synthetic as S

from .assets import SPECIAL_TOKENS
from .loops import Polisher
from .losses import Share, is_tower_body, make_optimizer
from .recipe import ALL_FIELDS, Recipe


def share_target(tint: float, share_range: tuple[float, float]) -> float:
    """The image share a scene of canvas tint ``tint`` (0-1) is trained to: log-linear over ``share_range``."""
    lo, hi = share_range
    return math.exp(math.log(lo) + tint * (math.log(hi) - math.log(lo)))


def is_value_projection(name: str) -> bool:
    """A decoder layer's value projection (``...language_model.layers.<i>.self_attn.v_proj.*``)."""
    return ".layers." in name and ".self_attn.v_proj." in name and not name.startswith("model.visual.")


def share_optimizer(model, recipe: Recipe):
    """The share stage's AdamW: the tower's body at ``vision_lr_scale`` of the rate, as in the main and polish
    stages, and the decoder's value projections at ``share_value_lr_scale``."""
    def scale(name: str) -> float:
        if is_tower_body(name):
            return recipe.vision_lr_scale
        return recipe.share_value_lr_scale if is_value_projection(name) else 1.0

    return make_optimizer(model, recipe.polish_lr, recipe.weight_decay, scale)


class Sharer(Polisher):
    """``share_steps`` steps of the polish stage's batches on ``share_layout``, with the share loss on
    ``share_tasks`` (module docstring)."""

    name = "share "
    fields = ALL_FIELDS

    def stage_steps(self) -> int:
        return self.r.share_steps

    def layout(self) -> str:
        return self.r.share_layout

    def share(self) -> Share:
        r = self.r
        groups = 1 if r.share_heads == "layer" else self.model.config.text_config.num_key_value_heads
        return Share(r.share_loss, r.share_layers, groups,
                     self.builder.tok.convert_tokens_to_ids(SPECIAL_TOKENS["image"]), r.share_ground == "image")

    def batch(self) -> dict:
        import torch

        batch = super().batch()
        task, lay, items, _ = self.plan()
        if task in self.r.share_tasks and lay == self.layout():
            tints = [S.scene_tint(task, seed, index, lay) for seed, index, _ in items]
            batch["share_target"] = torch.tensor([share_target(t, self.r.share_range) for t in tints])
        return batch


def starts_from(recipe: Recipe, init_recipe: dict | None) -> bool:
    """Whether a model made by ``init_recipe`` (a saved model's recipe.json) is where ``recipe``'s share stage
    starts: it agrees on every field the stages before it depend on, so only the share stage is left to run."""
    from .recipe import POLISH_FIELDS

    if init_recipe is None or not recipe.share_steps:
        return False
    mine = recipe.to_dict()
    theirs = Recipe.from_dict(init_recipe).to_dict()
    return all(mine[k] == theirs[k] for k in POLISH_FIELDS)
