"""``bacon``: BACON's initial selection kept static (docs/algorithms.md, "bacon").

The score itself is ``rcr.bacon_score``: it is also the initial selection of every compressed method (the
base class's ``initial_scores``), so this baseline overrides nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Method


@dataclass
class Bacon(Method):
    name = "bacon"
