"""Method labels with a role in the analyses, their display order, and the fixed-tau sweep labels."""

from __future__ import annotations

import re
from collections.abc import Iterable

from pipeline.schema import METHOD_ORDER

FULL, BACON, RCR, EXACT, FIXED = "full", "bacon", "rcr", "exact", "fixed"
PREFILL_ORACLE = "prefill_oracle"
BASELINES = (BACON, RCR)  # every method gets a paired difference from each of these (when present)
TERCILE_METHODS = (RCR, FIXED, EXACT)
DEFAULT_TAU_SWEEP = (0.02, 0.03, 0.05, 0.10, 0.15)
# a sweep point: fixed with only its threshold set, as its shorthand or by name (fixed@0.05, fixed@tau=0.05)
_SWEEP_RE = re.compile(r"^(?P<base>[A-Za-z_]+)@(?:tau=)?(?P<tau>[0-9.eE+-]+)$")


def sweep_methods(taus: Iterable[float] = DEFAULT_TAU_SWEEP, base: str = FIXED) -> list[str]:
    """Method labels of a fixed-tau sweep, e.g. ``["fixed@0.02", ..., "fixed@0.15"]``.

    The job's config can list these next to the ordinary methods; :func:`analyze` recognises them and
    puts them on the cost/quality frontier (fidelity against realised refresh fraction) next to ``rcr``.
    """
    return [f"{base}@{float(t):g}" for t in taus]


def parse_sweep_tau(method: str) -> float | None:
    """``"fixed@0.05"`` or ``"fixed@tau=0.05"`` -> 0.05; ``None`` for labels that are not sweep points."""
    m = _SWEEP_RE.match(str(method))
    if not m:
        return None
    try:
        return float(m.group("tau"))
    except ValueError:
        return None


def _method_sort_key(m: str) -> tuple:
    if m in METHOD_ORDER:
        return (0, METHOD_ORDER.index(m), 0.0, m)
    tau = parse_sweep_tau(m)
    if tau is not None:
        return (1, 0, tau, m)
    return (2, 0, 0.0, m)


def order_methods(methods: Iterable[str]) -> list[str]:
    return sorted(set(methods), key=_method_sort_key)


def label_knobs(label: str) -> dict[str, str]:
    """The knobs a label sets, as text: ``"rcr@rho=0.3,step=0.1"`` -> ``{"rho": "0.3", "step": "0.1"}`` (a bare
    shorthand value, ``fixed@0.05``, is left out: its knob is the method's)."""
    _, sep, args = str(label).partition("@")
    return dict(part.split("=", 1) for part in args.split(",") if "=" in part) if sep else {}


def target_rho(methods: Iterable[str]) -> float | None:
    """The target refresh fraction of the job's ``rcr`` (its label's ``rho``, else the knob's default), for the
    plots' reference line; None when the job runs no ``rcr``."""
    rcr = [m for m in methods if str(m).partition("@")[0] == RCR]
    if not rcr:
        return None
    text = label_knobs(rcr[0]).get("rho")
    if text is not None:
        return float(text)
    from rcr.methods import RCR as RCRMethod  # the knob's default, where it is defined
    from rcr.methods.knobs import knob_fields

    return float(knob_fields(RCRMethod)["rho"].default)
