"""``full``: the uncompressed reference. Every prefix entry is resident, in its original order
(docs/algorithms.md, "full")."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Method


@dataclass
class Full(Method):
    name = "full"
    uncompressed = True

    def initial_scores(self, ctx, layer):
        return None  # keep the whole prefix

    def n_selected(self, prefix) -> int:
        return prefix.n_prefix
