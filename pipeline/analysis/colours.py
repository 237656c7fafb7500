"""One colour per method, the same in every plot (``plots.py``, ``frontier_plot.py``) and in the MLflow UI (each
method run's ``mlflow.runColor`` tag, ``tracking.py``), derived from the registry: the i-th method of ``rcr.METHODS``
gets :data:`PALETTE`'s i-th colour, so a method registered later (or from an installed package) gets one too.

A label that sets a method's knobs (``rcr@rho=0.3``, ``fixed@0.05``) is a variant of that method: it gets a lighter or
darker shade of the method's colour, in the order the job's labels are displayed (:func:`label_colours`).
"""

from __future__ import annotations

from collections.abc import Iterable

from matplotlib.colors import to_hex, to_rgb

from pipeline.analysis.labels import method_class, method_order, order_methods

# in registry order: full grey (the reference), bacon blue, prefill_oracle cyan, exact purple, fixed orange, rcr red,
# rcr_layer pink, quest green, arkvale brown, infinigen olive (matplotlib's tab10); then ten more for methods added
PALETTE = ("#7f7f7f", "#1f77b4", "#17becf", "#9467bd", "#ff7f0e", "#d62728", "#e377c2", "#2ca02c", "#8c564b",
           "#bcbd22", "#393b79", "#637939", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354", "#756bb1",
           "#636363", "#ad494a")
UNKNOWN = "#000000"  # method_colour of a label whose method this process has not registered
# the k-th variant of a method: its colour mixed toward white (+) or black (-) by this much (a ninth variant repeats)
SHADES = (0.45, -0.35, 0.7, -0.6, 0.25, -0.15, 0.85, -0.75)


def method_colour(label: str) -> str:
    """The colour of a label's registered method (``rcr@rho=0.3`` -> rcr's)."""
    cls, order = method_class(label), method_order()
    return PALETTE[order.index(cls.name) % len(PALETTE)] if cls is not None and cls.name in order else UNKNOWN


def shade(colour: str, amount: float) -> str:
    """``colour`` mixed toward white (``amount`` > 0) or black (< 0) by ``|amount|``."""
    rgb = to_rgb(colour)
    target = 1.0 if amount > 0 else 0.0
    return to_hex(tuple(c + (target - c) * abs(amount) for c in rgb))


def label_colours(labels: Iterable[str]) -> dict[str, str]:
    """{label: colour} for one job's labels: a method's own name its colour, its variants (in display order) its
    shades, a label of a method this process has not registered the palette's next free colour: every label of the
    job has a colour of its own."""
    out, seen, unknown = {}, {}, len(method_order())
    for label in order_methods(labels):
        cls = method_class(label)
        if cls is None:  # a method this process has not registered: the palette's next colours
            out[label], unknown = PALETTE[unknown % len(PALETTE)], unknown + 1
            continue
        base = method_colour(label)
        if label == cls.name:
            out[label] = base
            continue
        k = seen[cls.name] = seen.get(cls.name, -1) + 1
        out[label] = shade(base, SHADES[k % len(SHADES)])
    return out
