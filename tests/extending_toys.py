"""A toy method and a toy task, added the way docs/extending.md says: each is one definition plus one registration.

Loaded as a pytest plugin (``python -m pytest -p tests.extending_toys ...``) it registers both before collection,
so the method contract suite (``tests/rcr/test_method_contracts.py``) parametrizes over the toy method as it would
over any newly registered one. ``tests/test_extending.py`` does that, and runs a one-sample job with both.

``install_plugin`` installs another such method and task as a package of one's own, found through the entry point
groups ``rcr.methods`` and ``rcr.tasks`` by every process that imports ``rcr`` or ``pipeline.tasks``.
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


# ------------------------------------------------------------------------------ the same, as an installed package

PLUGIN_METHODS = '''"""A method of an installed package, found through the entry point group rcr.methods."""
from dataclasses import dataclass

import torch

from rcr.methods import ScorerMethod, StepContext, knob


@dataclass
class Newest(ScorerMethod):
    """Re-selects, at every layer-step, the prefix entries nearest the window."""

    name = "toy_plugin"
    rank: int = knob(4, "named like rcr's rank (8): a knob is its method's own")

    def score(self, ctx: StepContext) -> torch.Tensor:
        p = ctx.prefix
        pos = torch.arange(p.n_prefix, device=p.valid.device, dtype=torch.float32)  # (Np,)
        return pos.expand(p.batch_size, p.n_kv_heads, p.n_prefix).masked_fill(~p.prefix_valid.unsqueeze(1),
                                                                             float("-inf"))
'''
PLUGIN_TASKS = '''"""A task of an installed package, found through the entry point group rcr.tasks."""
from pipeline.tasks import Task

TOY_PLUGIN_TASK = Task(name="toy_plugin_task", prompt="Describe this image in detail.", max_new_tokens=8)
'''


ENTRY_POINTS = ("[rcr.methods]\ntoy_plugin = rcr_toy_plugin.methods:Newest\n\n"
                "[rcr.tasks]\ntoy_plugin_task = rcr_toy_plugin.tasks:TOY_PLUGIN_TASK\n")


def forget_plugin(monkeypatch) -> None:
    """Drop ``rcr_toy_plugin`` and its modules from ``sys.modules`` for one test: another test may have imported the
    package from its own ``site``, and Python would look for a new module only under that package's path."""
    import sys

    for name in [n for n in sys.modules if n == "rcr_toy_plugin" or n.startswith("rcr_toy_plugin.")]:
        monkeypatch.delitem(sys.modules, name)


def install_plugin(site, entry_points: str | None = None) -> None:
    """Install the package ``rcr_toy_plugin`` into ``site`` (a directory to put on ``sys.path``/``PYTHONPATH``), as
    pip would: its modules and a ``.dist-info`` whose ``entry_points.txt`` declares its method and its task in the
    groups docs/extending.md names (or ``entry_points``, that file's text)."""
    from pathlib import Path

    pkg, info = Path(site) / "rcr_toy_plugin", Path(site) / "rcr_toy_plugin-0.1.dist-info"
    pkg.mkdir(parents=True)
    info.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "methods.py").write_text(PLUGIN_METHODS)
    (pkg / "tasks.py").write_text(PLUGIN_TASKS)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rcr-toy-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points or ENTRY_POINTS)
