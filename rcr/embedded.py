"""Where the embedded models live: package data of ``rcr`` (``rcr/embedded_model/``, ``rcr/embedded_drift_model/``),
so that ``rcr.models.load("embedded")`` finds them from any working directory and after a non-editable install.

The embedded models are small Qwen2-VLs trained on synthetic scenes (``docs/embedded.md``); on real photos their
output is meaningless by design. ``embedded`` is the default benchmark; ``embedded-drift`` is the test bed whose
samples drift at different scales (one per-sample property of the image sets how much of a step's attention goes
to the image), for the comparison of a per-sample threshold against a fixed one.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

NAME = "embedded"  # the default
DIRECTORIES = {"embedded": "embedded_model", "embedded-drift": "embedded_drift_model"}  # name -> package folder
RECIPE_FILE = "recipe.json"  # the recipe a model trained by jobs/train_embedded.py carries


def is_embedded(name_or_path: object) -> bool:
    """Whether ``name_or_path`` names one of the shipped embedded models."""
    return isinstance(name_or_path, str) and name_or_path in DIRECTORIES


def model_dir(name: str = NAME) -> Path:
    """The directory of an embedded model and its processor (a real directory: the wheel is not zip-safe)."""
    if not is_embedded(name):
        raise ValueError(f"unknown embedded model {name!r}; the embedded models are {', '.join(DIRECTORIES)}")
    return Path(str(resources.files("rcr") / DIRECTORIES[name]))


def resolve(name_or_path: str) -> str:
    """An embedded model's name -> its package-data directory; anything else unchanged."""
    return str(model_dir(name_or_path)) if is_embedded(name_or_path) else name_or_path


def scene_layout_of(recipe: dict) -> str:
    """The synthetic scene layout a recipe's model answers: its share stage's where it has one, else its own."""
    return recipe["share_layout"] if recipe.get("share_steps") else recipe["layout"]


def recipe_of(name_or_path: str) -> dict | None:
    """The recipe a model's directory carries (an embedded model's name, or a directory ``jobs/train_embedded.py``
    wrote); None for a model without one (a real VLM, a Hub id)."""
    path = Path(resolve(name_or_path)).expanduser() / RECIPE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def scene_layout(name_or_path: str) -> str | None:
    """The synthetic scene layout the model was trained on (``recipe_of``); None for a model without a recipe."""
    recipe = recipe_of(name_or_path)
    return None if recipe is None else scene_layout_of(recipe)
