"""The embedded model's recipe: every setting that decides its weights, as one typed, validated record.

The shipped recipe is a file, ``recipe.json`` in the shipped model's directory (``rcr/embedded_model/``): the
trainer reads it by default, and every model the trainer saves carries the recipe that made it. A command-line
flag overrides one field (``--steps 40``); the whole recipe is printed at the start of a run and stored in its
checkpoints, and a run refuses to resume from a checkpoint of another recipe.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.data import synthetic as S
from pipeline.tasks import TASKS
from rcr.config import ConfigError
from rcr.embedded import model_dir

from .assets import MODEL_SIZES
from .curriculum import LAST_PHASE

RECIPE_NAME = "recipe.json"
GROUNDED_TASKS = ("detailcaps", "textcaps")  # the tasks with grounding targets (video has none)
SHARE_HEADS = ("layer", "kv")
SHARE_GROUND = ("image", "whole")


def _bad(name: str, message: str) -> ConfigError:
    """A recipe field with a bad value: ``recipe.<name>``."""
    return ConfigError(f"recipe.{name}", message)


def shipped_recipe_path() -> Path:
    return model_dir() / RECIPE_NAME


def _f(help: str, **kw):
    return field(metadata={"help": help}, **kw)


@dataclass(frozen=True)
class Recipe:
    size: str = _f("model size (assets.MODEL_SIZES)")
    seed: int = _f("seed of the initial weights and of the main and vision stages' scenes")
    layout: str = _f("scene layout of detailcaps/textcaps (synthetic.LAYOUTS)")
    threads: int | str = _f("torch CPU threads: part of the arithmetic (the order of CPU sums), so only a fixed "
                            "count makes the weights a function of the recipe; 'auto' follows the machine's load")
    lr: float = _f("peak learning rate of the vision and main stages")
    warmup: int = _f("linear warm-up steps, then cosine decay to 5%")
    weight_decay: float = _f("AdamW weight decay of the weight matrices")
    batch_scale: float = _f("multiplies the per-task batch sizes (curriculum.BATCH_SIZES)")
    vision_steps: int = _f("vision stage: the tower alone learns to name single objects' attributes; 0 skips it")
    vision_lr_scale: float = _f("main stage: the tower's patch embedding and blocks train at this fraction of lr")
    steps: int = _f("main stage optimizer steps")
    sink_logit: float = _f("the logit every query meets the held attention sink with (sink.HeldSink)")
    sink_ramp: tuple[float, float] | None = _f("hold the sink at its starting logit until fraction FROM of the "
                                               "main stage, then raise it linearly to sink_logit by TO; or none")
    ground_loss: float = _f("weight of the grounding loss (losses.grounding_loss); 0 is off")
    ground_layer: int = _f("the decoder layer the grounding loss supervises (Python index)")
    ground_tasks: tuple[str, ...] = _f("the tasks the main stage's grounding loss supervises")
    polish_steps: int = _f("polish stage: more steps of the curriculum's last phase on fresh scenes; 0 skips it")
    polish_lr: float = _f("the polish stage's learning rate")
    polish_cooldown: float = _f("the polish stage's rate falls linearly to 0 over this last fraction of it")
    polish_seed: int = _f("seed of the polish stage's scenes")
    polish_mix: dict[str, float] | None = _f("the polish stage's task mix, TASK=W (normalised weights); or none "
                                             "for the last phase's")
    polish_ground_tasks: tuple[str, ...] = _f("the tasks the polish stage's grounding loss supervises")
    polish_ground_spread: tuple[str, ...] = _f("tasks whose polish-stage grounding asks for the step's attention "
                                               "spread evenly over the cell's tokens, not only its mass on the cell")
    # The share stage (``embedded/share.py``), after the polish stage: the drift test bed's. Its defaults leave a
    # recipe without it as it was, so a recipe file need not name these fields.
    share_steps: int = _f("share stage: steps of the polish stage's batches on share_layout's scenes with the share "
                          "loss; 0 skips it", default=0)
    share_layout: str = _f("the share stage's scene layout: a tinted one (synthetic.scene_tint sets each sample's "
                           "target)", default="v6")
    share_loss: float = _f("weight of the share loss (losses.image_share_loss)", default=0.3)
    share_range: tuple[float, float] = _f("the target image share at tint 0 and at tint 1, log-linear in between",
                                          default=(0.01, 0.3))
    share_layers: tuple[int, ...] = _f("the decoder layers whose image share the share loss supervises (Python "
                                       "indices)", default=(1, 2, 3))
    share_tasks: tuple[str, ...] = _f("the tasks the share loss supervises", default=("detailcaps",))
    share_heads: str = _f("what the share loss holds to the target: 'layer' (the mean over a layer's heads) or 'kv' "
                          "(each KV head's mean over its query heads)", default="layer")
    share_ground: str = _f("what the share stage's grounding loss asks of a description step that writes an "
                           "attribute: the cell's share of the step's 'image' mass, or of its 'whole' mass (as the "
                           "polish stage, the drift test bed's)", default="whole")
    share_value_lr_scale: float = _f("the share stage trains the decoder's value projections at this multiple of its "
                                     "rate: a read that carries a small share of the attention needs larger values",
                                     default=1.0)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is None and "None" not in str(f.type):
                raise _bad(f.name, "missing")
        self._check_stages()
        self._check_grounding()
        self._check_share()

    def _check_stages(self) -> None:
        if self.size not in MODEL_SIZES:
            raise _bad("size", f"{self.size!r}; choose one of {', '.join(MODEL_SIZES)}")
        if self.layout not in S.LAYOUTS:
            raise _bad("layout", f"{self.layout!r}; choose one of {', '.join(sorted(S.LAYOUTS))}")
        if not (self.threads == "auto" or isinstance(self.threads, int) and self.threads > 0):
            raise _bad("threads", f"{self.threads!r}; give a count > 0 or 'auto'")
        for name in ("lr", "polish_lr", "vision_lr_scale", "batch_scale"):
            if not getattr(self, name) > 0:
                raise _bad(name, f"{getattr(self, name)}; give a value > 0")
        for name in ("warmup", "vision_steps", "steps", "polish_steps", "weight_decay", "ground_loss"):
            if getattr(self, name) < 0:
                raise _bad(name, f"{getattr(self, name)}; give a value >= 0")
        if self.steps < 1:
            raise _bad("steps", f"{self.steps}; give at least 1")
        if self.sink_ramp is not None and not (len(self.sink_ramp) == 2 and
                                               0.0 <= self.sink_ramp[0] < self.sink_ramp[1] <= 1.0):
            raise _bad("sink_ramp", f"{self.sink_ramp}; give fractions FROM < TO of the main stage in [0, 1]")
        if self.polish_steps > (1 - LAST_PHASE) * self.steps:
            raise _bad("polish_steps", f"{self.polish_steps}; give 0 to {int((1 - LAST_PHASE) * self.steps)} "
                                              f"(its batches are the last phase's, the last {1 - LAST_PHASE:.0%} of "
                                              "the main stage's steps)")
        if not 0 <= self.polish_cooldown <= 1:
            raise _bad("polish_cooldown", f"{self.polish_cooldown}; give a fraction of the stage, 0 to 1")
        for name in ("seed", "polish_seed"):  # scene (seed, i) is the same scene in training and in evaluation
            if getattr(self, name) == S.HELDOUT_SEED:
                raise _bad(name, f"{S.HELDOUT_SEED} is the seed held-out evaluation draws its scenes with")
        if self.polish_mix is not None:
            bad = [t for t, w in self.polish_mix.items() if t not in TASKS or not 0 <= w < float("inf")]
            if bad or not sum(self.polish_mix.values()) > 0:
                raise _bad("polish_mix", f"{self.polish_mix}; give weights >= 0 (some > 0) of tasks among "
                                                f"{', '.join(TASKS)}")

    def _check_grounding(self) -> None:
        n_layers = MODEL_SIZES[self.size]["layers"]
        if not -n_layers <= self.ground_layer < n_layers:
            raise _bad("ground_layer", f"{self.ground_layer}; size {self.size} has {n_layers} decoder layers")
        for name in ("ground_tasks", "polish_ground_tasks", "polish_ground_spread"):
            bad = [t for t in getattr(self, name) if t not in GROUNDED_TASKS]
            if bad:
                raise _bad(name, f"{bad}; give tasks among {', '.join(GROUNDED_TASKS)}")
        if self.ground_loss and "detailcaps" in self.ground_tasks and not S.get_layout(self.layout).every_cell:
            raise _bad("ground_tasks", f"grounding detailcaps needs a layout whose descriptions walk every "
                                              f"cell, not {self.layout}")
        if self.polish_ground_spread and not (self.polish_steps and self.ground_loss):
            raise _bad("polish_ground_spread", "acts on the grounding loss in the polish stage: needs "
                                                      "polish_steps and ground_loss")

    def _check_share(self) -> None:
        if self.share_steps < 0:
            raise _bad("share_steps", f"{self.share_steps}; give a value >= 0")
        if self.share_layout not in S.LAYOUTS or not S.get_layout(self.share_layout).tinted:
            tinted = [n for n, lay in S.LAYOUTS.items() if lay.tinted]
            raise _bad("share_layout", f"{self.share_layout!r}; choose a tinted layout: {', '.join(tinted)}")
        if not self.share_loss >= 0:
            raise _bad("share_loss", f"{self.share_loss}; give a value >= 0")
        if self.share_ground not in SHARE_GROUND:
            raise _bad("share_ground", f"{self.share_ground!r}; choose one of {', '.join(SHARE_GROUND)}")
        if not self.share_value_lr_scale > 0:
            raise _bad("share_value_lr_scale", f"{self.share_value_lr_scale}; give a value > 0")
        if not (len(self.share_range) == 2 and 0 < self.share_range[0] <= self.share_range[1] < 1):
            raise _bad("share_range", f"{self.share_range}; give shares LOW <= HIGH in (0, 1)")
        n_layers = MODEL_SIZES[self.size]["layers"]
        if not self.share_layers or self.share_steps and any(not -n_layers <= i < n_layers for i in self.share_layers):
            raise _bad("share_layers", f"{self.share_layers}; size {self.size} has {n_layers} decoder layers")
        bad = [t for t in self.share_tasks if t not in GROUNDED_TASKS]
        if bad:
            raise _bad("share_tasks", f"{bad}; give tasks among {', '.join(GROUNDED_TASKS)} (video has no tint)")
        if self.share_heads not in SHARE_HEADS:
            raise _bad("share_heads", f"{self.share_heads!r}; choose one of {', '.join(SHARE_HEADS)}")
        if self.share_steps and self.share_steps > (1 - LAST_PHASE) * self.steps:
            raise _bad("share_steps", f"{self.share_steps}; give 0 to {int((1 - LAST_PHASE) * self.steps)} (its "
                                      "batches are the last phase's, as the polish stage's are)")

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "recipe") -> Recipe:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise _bad(unknown[0], f"unknown field in {source}; the fields are {', '.join(sorted(names))}")
        missing = sorted(names - set(d) - set(_DEFAULTS))
        if missing:
            raise _bad(missing[0], f"missing from {source}")
        return cls(**{k: _normalise(k, v) for k, v in d.items()})

    @classmethod
    def load(cls, path: str | Path | None = None) -> Recipe:
        """The recipe in ``path`` (a recipe file, or a model directory carrying one); default the shipped one."""
        p = Path(path) if path is not None else shipped_recipe_path()
        if p.is_dir():
            p = p / RECIPE_NAME
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise _bad("recipe", f"no recipe file at {p}") from None
        except json.JSONDecodeError as exc:
            raise _bad("recipe", f"{p} is not JSON ({exc})") from None
        return cls.from_dict(data, source=str(p))

    def to_dict(self, full: bool = False) -> dict[str, Any]:
        """Every field (``full``), or every field but the share stage's where the recipe has none: a recipe
        without it is written as it was before the stage existed (the default model's recipe.json)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if full or self.share_steps or f.name not in _DEFAULTS}

    def replace(self, **changes) -> Recipe:
        return Recipe.from_dict({**self.to_dict(), **changes})


def _normalise(name: str, value):
    """One spelling per value, so that equal recipes compare equal: tasks sorted and unique, pairs as tuples, the
    polish mix in TASKS order."""
    if name in ("ground_tasks", "polish_ground_tasks", "polish_ground_spread"):
        return tuple(sorted(set(value)))
    if name in ("sink_ramp", "share_range") and value is not None:
        return tuple(float(x) for x in value)
    if name == "share_tasks":
        return tuple(sorted(set(value)))
    if name == "share_layers":
        return tuple(sorted(set(int(x) for x in value)))
    if name == "polish_mix" and value is not None:
        return {t: float(value[t]) for t in TASKS if t in value} | {t: w for t, w in value.items() if t not in TASKS}
    return value


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Recipe) if f.default is not dataclasses.MISSING}

# The fields each stage's weights depend on: a checkpoint of one stage serves every recipe that agrees on them.
VISION_FIELDS = ("size", "seed", "layout", "lr", "warmup", "weight_decay", "vision_steps")
MAIN_FIELDS = tuple(f.name for f in dataclasses.fields(Recipe) if not f.name.startswith(("polish", "share")) and
                    f.name != "threads")
POLISH_FIELDS = tuple(f.name for f in dataclasses.fields(Recipe) if not f.name.startswith("share") and
                      f.name != "threads")  # every stage before the share stage
ALL_FIELDS = tuple(f.name for f in dataclasses.fields(Recipe) if f.name != "threads")


def differences(stored: dict[str, Any], recipe: Recipe, fields: tuple[str, ...]) -> list[str]:
    """``fields`` on which a checkpoint's stored recipe and ``recipe`` differ, as 'name stored (this run: ...)'."""
    now = recipe.to_dict(full=True)
    stored = {**{k: _plain(v) for k, v in _DEFAULTS.items()}, **stored}  # a recipe stored without its share fields
    return [f"{k} {stored.get(k)!r} (this run: {now[k]!r})" for k in fields if stored.get(k) != now[k]]
