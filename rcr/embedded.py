"""Where the embedded model lives: package data of ``rcr`` (``rcr/embedded_model/``), so that
``rcr.models.load("embedded")`` finds it from any working directory and after a non-editable install.

The embedded model is a small Qwen2-VL trained on synthetic scenes (``docs/embedded.md``); on real photos
its output is meaningless by design.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

NAME = "embedded"


def model_dir() -> Path:
    """The directory of the embedded model and its processor (a real directory: the wheel is not zip-safe)."""
    return Path(str(resources.files("rcr") / "embedded_model"))


def resolve(name_or_path: str) -> str:
    """``"embedded"`` -> the package-data directory; anything else unchanged."""
    return str(model_dir()) if name_or_path == NAME else name_or_path
