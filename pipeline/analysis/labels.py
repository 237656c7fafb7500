"""Method labels with a role in the analyses, their display order (the registry's, ``rcr.METHODS``), and the
fixed-tau sweep labels. Labels are read by their one reader, ``rcr.methods.parse_label`` (``rcr/methods/knobs.py``):
a label of a method this process has not registered has no knobs to read, and sorts last.

The registry is imported when a function here first needs it, not with this module: it brings the library (torch)
with it, which importing the analysis' modules does not."""

from __future__ import annotations

from collections.abc import Iterable

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
    parsed = _parsed(method)
    if parsed is None or parsed[0].name != FIXED or set(parsed[1]) != {"tau"}:
        return None
    return float(parsed[1]["tau"])


def _parsed(label: str) -> tuple[type, dict] | None:
    """``rcr.methods.parse_label(label)``: its method class and typed knobs; None for a label this process cannot
    read (an unregistered method)."""
    from rcr.config import ConfigError
    from rcr.methods import parse_label

    try:
        return parse_label(str(label))
    except ConfigError:
        return None


def method_class(label: str) -> type | None:
    """The method class of ``label``; None for a label this process cannot read."""
    parsed = _parsed(label)
    return parsed[0] if parsed else None


def method_order() -> list[str]:
    """The registered methods' names in display order: the registry's (``rcr.METHODS``)."""
    from rcr.methods import METHODS

    return list(METHODS)


def _method_sort_key(m: str, order: list[str]) -> tuple:
    if m in order:
        return (0, order.index(m), 0.0, m)
    tau = parse_sweep_tau(m)
    if tau is not None:
        return (1, 0, tau, m)
    return (2, 0, 0.0, m)


def order_methods(methods: Iterable[str]) -> list[str]:
    """The registry's order (``rcr.METHODS``), then the fixed-tau sweep by tau, then the other labels by name."""
    order = method_order()
    return sorted(set(methods), key=lambda m: _method_sort_key(m, order))


def target_rho(methods: Iterable[str]) -> float | None:
    """The target refresh fraction of the job's ``rcr`` (its label's ``rho``, else the knob's default), for the
    plots' reference line; None when the job runs no ``rcr``."""
    from rcr.methods import parse_method

    rcr = [m for m in methods if getattr(method_class(m), "name", None) == RCR]
    return float(parse_method(rcr[0]).rho) if rcr else None
