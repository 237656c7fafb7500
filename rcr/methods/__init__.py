"""Method registry. A method is named by a label: a registered name, with its own knobs after ``@``
(``rcr@rho=0.3,step=0.1``, ``arkvale@rule=recall``; ``fixed@0.05`` sets fixed's threshold; ``rcr.methods.knobs``).
Adding a method is one file in this package and its line in ``METHODS`` (docs/extending.md)."""

from __future__ import annotations

from ..config import ConfigError, RCRConfig
from .arkvale import ArkVale
from .bacon import Bacon
from .base import BuildContext, Decision, Method, StepContext
from .exact import Exact
from .full import Full
from .infinigen import InfiniGen
from .knobs import default_record, describe, knob, parse_knobs
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


def parse_method(label: str | Method, config: RCRConfig | None = None) -> Method:
    """``"rcr"`` -> RCR(config); ``"rcr@rho=0.3"`` -> RCR(config, rho=0.3); ``"fixed@0.05"`` -> Fixed(config,
    tau=0.05). A Method is returned as it is. Raises ConfigError naming the label and the bad part."""
    if isinstance(label, Method):
        return label
    config = config or RCRConfig()
    if not isinstance(label, str) or not label.strip():
        raise ConfigError("method", f"expected a method label, one of {sorted(METHODS)} (NAME@FIELD=VALUE,... for "
                                    f"a method's own settings), got {label!r}")
    label = label.strip()
    name, sep, args = label.partition("@")
    if name not in METHODS:
        where = "" if name == label else f" in {label!r}"
        raise ConfigError("method", f"unknown method {name!r}{where}; known methods are {sorted(METHODS)}")
    cls = METHODS[name]
    values = parse_knobs(cls, args, label) if sep else {}
    return cls(config=config, label=label, **values)


def describe_methods() -> list[str]:
    """One line per registered method: its knobs with their defaults and meaning."""
    return [describe(cls) for cls in METHODS.values()]


def knob_defaults() -> dict:
    """Every registered method's knob defaults, flat (``rcr.methods.knobs.default_record``)."""
    return default_record(METHODS.values())


__all__ = ["METHODS", "register", "parse_method", "knob", "describe_methods", "knob_defaults", "Method",
           "ScorerMethod", "Decision", "StepContext", "BuildContext", "Full", "Bacon", "PrefillOracle", "Exact",
           "Fixed", "RCR", "RCRLayer", "Quest", "ArkVale", "InfiniGen", "RefreshKV"]
