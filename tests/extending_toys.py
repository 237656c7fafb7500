"""A toy method and a toy task, added the way docs/extending.md says: each is one definition plus one registration.

Loaded as a pytest plugin (``python -m pytest -p tests.extending_toys ...``) it registers both before collection,
so the method contract suite (``tests/rcr/test_method_contracts.py``) parametrizes over the toy method as it would
over any newly registered one. ``tests/test_extending.py`` does that, and runs a one-sample job with both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.tasks import Task
from pipeline.tasks import register as register_task
from rcr.methods import ScorerMethod, StepContext, knob
from rcr.methods import register as register_method


@dataclass
class Recent(ScorerMethod):
    """Re-selects, at every layer-step, the prefix entries nearest the window (or the first ones)."""

    name = "toy_recent"

    end: str = knob("last", "which end of the prefix to keep: 'last' (nearest the window) or 'first'")

    def validate(self) -> None:
        self.need(self.end in ("last", "first"), "end", "must be 'last' or 'first'")

    def score(self, ctx: StepContext) -> torch.Tensor:
        p = ctx.prefix
        pos = torch.arange(p.n_prefix, device=p.valid.device, dtype=torch.float32)  # (Np,)
        pos = pos if self.end == "last" else -pos
        return pos.expand(p.batch_size, p.n_kv_heads, p.n_prefix).masked_fill(~p.prefix_valid.unsqueeze(1),
                                                                             float("-inf"))


TOY_TASK = Task(name="toy_task", prompt="Describe this image in detail.", max_new_tokens=12)


def pytest_configure(config):
    register_method(Recent)
    register_task(TOY_TASK)
