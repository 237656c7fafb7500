"""Method registry. A method is named by a label: a registered name, with its own knobs after ``@``
(``rcr@rho=0.3,step=0.1``, ``arkvale@rule=recall``; ``fixed@0.05`` sets fixed's threshold; ``rcr.methods.knobs``).
Adding a method is one file in this package and its line in ``METHODS``, or, from a package of one's own, an entry
point in the group ``rcr.methods`` (:data:`ENTRY_POINT_GROUP`; docs/extending.md).

``METHODS`` lists the methods in their display order (tables, plots, ``--methods all``): the ones here, then those
registered later, in the order they were."""

from __future__ import annotations

import types
from importlib.metadata import entry_points

from ..config import ConfigError, RCRConfig
from .arkvale import ArkVale
from .bacon import Bacon
from .base import BuildContext, Decision, Method, StepContext
from .exact import Exact
from .full import Full
from .infinigen import InfiniGen
from .knobs import default_record, describe, knob, parse_knobs, split_label
from .prefill_oracle import PrefillOracle
from .quest import Quest
from .rcr import RCR, Fixed
from .rcr_layer import RCRLayer
from .refreshkv import RefreshKV
from .scorer import ScorerMethod

METHODS: dict[str, type[Method]] = {m.name: m for m in (Full, Bacon, PrefillOracle, Exact, Fixed, RCR, RCRLayer,
                                                        Quest, ArkVale, InfiniGen, RefreshKV)}


def register(cls: type[Method]) -> type[Method]:
    """Add a method class to ``METHODS`` under its ``name`` (a method defined outside this package; the ones here
    are listed above). Returns the class, so it can decorate it."""
    if not (isinstance(cls, type) and issubclass(cls, Method)) or cls.name in ("", "base"):
        raise ConfigError("method", f"{cls!r} is not a Method subclass with its own name")
    if METHODS.get(cls.name, cls) is not cls:
        raise ConfigError("method", f"{cls.name!r} is already registered ({METHODS[cls.name].__qualname__})")
    METHODS[cls.name] = cls
    return cls


ENTRY_POINT_GROUP = "rcr.methods"  # an installed package's methods: `name = "module:Class"`, or a module that registers


def load_entry_points(group: str = ENTRY_POINT_GROUP) -> list[str]:
    """Register the methods that installed packages declare as entry points of ``group``: each names a Method
    subclass, or a module that registers its methods when imported. ``import rcr`` calls it once, so a package's
    method reaches every process that imports rcr (a job's driver and its Ray workers). Returns the entry points'
    names; one that fails to load raises, naming it and its package."""
    names = []
    for ep in entry_points(group=group):
        where = f"entry point {ep.name} = {ep.value} (group {group}, package {ep.dist.name if ep.dist else '?'})"
        try:
            obj = ep.load()
        except Exception as e:
            raise ImportError(f"{where} does not load: {type(e).__name__}: {e}") from e
        if isinstance(obj, type):
            register(obj)
        elif not isinstance(obj, types.ModuleType):
            raise ConfigError("method", f"{where}: names {obj!r}; it must name a Method subclass or a module")
        names.append(ep.name)
    return names


def parse_label(label: str) -> tuple[type[Method], dict]:
    """``"rcr@rho=0.3"`` -> ``(RCR, {"rho": 0.3})``: a label's method class and the knobs it sets, typed. Raises
    ConfigError naming the label and the bad part."""
    if not isinstance(label, str) or not label.strip():
        raise ConfigError("method", f"expected a method label, one of {sorted(METHODS)} (NAME@FIELD=VALUE,... for "
                                    f"a method's own settings), got {label!r}")
    label = label.strip()
    name, args = split_label(label)
    if name not in METHODS:
        where = "" if name == label else f" in {label!r}"
        raise ConfigError("method", f"unknown method {name!r}{where}; known methods are {sorted(METHODS)}")
    cls = METHODS[name]
    return cls, (parse_knobs(cls, args, label) if args is not None else {})


def parse_method(label: str | Method, config: RCRConfig | None = None) -> Method:
    """``"rcr"`` -> RCR(config); ``"rcr@rho=0.3"`` -> RCR(config, rho=0.3); ``"fixed@0.05"`` -> Fixed(config,
    tau=0.05). A Method is returned as it is. Raises ConfigError naming the label and the bad part."""
    if isinstance(label, Method):
        return label
    cls, values = parse_label(label)
    return cls(config=config or RCRConfig(), label=label.strip(), **values)


def describe_methods() -> list[str]:
    """One line per registered method: its knobs with their defaults and meaning."""
    return [describe(cls) for cls in METHODS.values()]


def knob_defaults() -> dict:
    """Every registered method's knob defaults, by method (``rcr.methods.knobs.default_record``)."""
    return default_record(METHODS.values())


__all__ = ["METHODS", "register", "load_entry_points", "ENTRY_POINT_GROUP", "parse_method", "parse_label", "knob",
           "describe_methods", "knob_defaults", "Method", "ScorerMethod", "Decision", "StepContext", "BuildContext",
           "Full", "Bacon", "PrefillOracle", "Exact", "Fixed", "RCR", "RCRLayer", "Quest", "ArkVale", "InfiniGen",
           "RefreshKV"]
