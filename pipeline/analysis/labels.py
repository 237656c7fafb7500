"""Method labels with a role in the analyses, their display order (the registry's, ``rcr.METHODS``), and the
fixed-tau sweep labels. Labels are read by their one reader, ``rcr.methods.parse_label`` (``rcr/methods/knobs.py``):
a label of a method this process has not registered has no knobs to read, and sorts last."""

from __future__ import annotations

from collections.abc import Iterable

from rcr.config import ConfigError
from rcr.methods import METHODS, parse_label, parse_method
from rcr.methods.knobs import split_label

FULL, BACON, RCR, EXACT, FIXED = "full", "bacon", "rcr", "exact", "fixed"
PREFILL_ORACLE = "prefill_oracle"
BASELINES = (BACON, RCR)  # every method gets a paired difference from each of these (when present)
TERCILE_METHODS = (RCR, FIXED, EXACT)
DEFAULT_TAU_SWEEP = (0.02, 0.03, 0.05, 0.10, 0.15)


def sweep_methods(taus: Iterable[float] = DEFAULT_TAU_SWEEP, base: str = FIXED) -> list[str]:
    """Method labels of a fixed-tau sweep, e.g. ``["fixed@0.02", ..., "fixed@0.15"]``.

    The job's config can list these next to the ordinary methods; :func:`analyze` recognises them and
    puts them on the cost/quality frontier (fidelity against realised refresh fraction) next to ``rcr``.
    """
    return [f"{base}@{float(t):g}" for t in taus]


def parse_sweep_tau(method: str) -> float | None:
    """``"fixed@0.05"`` or ``"fixed@tau=0.05"`` (fixed with only its threshold set) -> 0.05; ``None`` for labels
    that are not sweep points."""
    values = _knobs(method)
    if split_label(method)[0] != FIXED or values is None or set(values) != {"tau"}:
        return None
    return float(values["tau"])


def method_class(label: str) -> type | None:
    """The method class of ``label``; None for a label this process cannot read (an unregistered method)."""
    try:
        return parse_label(str(label))[0]
    except ConfigError:
        return None


def _knobs(label: str) -> dict | None:
    """The knobs ``label`` sets, typed; None for a label this process cannot read (an unregistered method)."""
    try:
        return parse_label(str(label))[1]
    except ConfigError:
        return None


def _method_sort_key(m: str) -> tuple:
    order = list(METHODS)
    if m in METHODS:
        return (0, order.index(m), 0.0, m)
    tau = parse_sweep_tau(m)
    if tau is not None:
        return (1, 0, tau, m)
    return (2, 0, 0.0, m)


def order_methods(methods: Iterable[str]) -> list[str]:
    """The registry's order (``rcr.METHODS``), then the fixed-tau sweep by tau, then the other labels by name."""
    return sorted(set(methods), key=_method_sort_key)


def target_rho(methods: Iterable[str]) -> float | None:
    """The target refresh fraction of the job's ``rcr`` (its label's ``rho``, else the knob's default), for the
    plots' reference line; None when the job runs no ``rcr``."""
    rcr = [m for m in methods if split_label(m)[0] == RCR and _knobs(m) is not None]
    return float(parse_method(rcr[0]).rho) if rcr else None
