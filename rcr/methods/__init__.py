"""Method registry. A method is named by a label: a registered name, or ``fixed@TAU`` for the fixed-threshold
baseline at a given tau (the cost/quality sweep)."""

from __future__ import annotations

from ..config import ConfigError, RCRConfig
from .arkvale import ArkVale
from .bacon import Bacon
from .base import BuildContext, Decision, Method, StepContext
from .exact import Exact
from .full import Full
from .infinigen import InfiniGen
from .prefill_oracle import PrefillOracle
from .quest import Quest
from .rcr import RCR, Fixed
from .rcr_layer import RCRLayer
from .scorer import ScorerMethod

METHODS: dict[str, type[Method]] = {m.name: m for m in (Full, Bacon, PrefillOracle, Exact, Fixed, RCR, RCRLayer,
                                                        Quest, ArkVale, InfiniGen)}


def parse_method(label: str, config: RCRConfig | None = None) -> Method:
    """``"rcr"`` -> RCR(config); ``"fixed@0.05"`` -> Fixed(config, tau=0.05). Raises ConfigError naming the label."""
    config = config or RCRConfig()
    if not isinstance(label, str) or not label:
        raise ConfigError(f"method={label!r}: expected a method name, one of {sorted(METHODS)}")
    name, _, arg = label.partition("@")
    if name not in METHODS:
        raise ConfigError(f"method={label!r}: unknown method; known methods are {sorted(METHODS)} "
                          "(and fixed@TAU for a fixed threshold)")
    if not arg:
        return METHODS[name](config=config, label=label)
    if name != "fixed":
        raise ConfigError(f"method={label!r}: only `fixed` takes a parameter (fixed@TAU)")
    try:
        tau = float(arg)
    except ValueError:
        raise ConfigError(f"method={label!r}: TAU in fixed@TAU must be a number") from None
    if not tau >= 0:
        raise ConfigError(f"method={label!r}: TAU in fixed@TAU must be >= 0")
    return Fixed(config=config, label=label, tau=tau)


__all__ = ["METHODS", "parse_method", "Method", "ScorerMethod", "Decision", "StepContext", "BuildContext",
           "Full", "Bacon", "PrefillOracle", "Exact", "Fixed", "RCR", "RCRLayer", "Quest", "ArkVale", "InfiniGen"]
