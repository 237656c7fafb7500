"""Methods at a test's scale: one shared config and one set of knobs, each knob applied to every method that has it
(``candidates`` to the drift methods, ``page_size`` to the page methods, ``tau`` to fixed, ...), so that one scale
serves the whole registry::

    SMALL = Scale(rcr.RCRConfig(selected=8, window=8), candidates=32, tau0=0.3, page_size=4)
    prefix = rcr.prefill(model, inputs, SMALL.config)
    rcr.decode(model, prefix, SMALL.method("rcr"), 12)
    SMALL.replace(tau0=0.05, exact_drift=True)   # a knob and a shared field
"""

from __future__ import annotations

import dataclasses

from rcr import RCRConfig
from rcr.methods import METHODS, Method, parse_label
from rcr.methods.knobs import knob_fields


def build(label: str, config: RCRConfig, **knobs) -> Method:
    """``label``'s method with ``config`` and each of ``knobs`` that it has (a label's own knobs win)."""
    cls, values = parse_label(label)
    own = {k: v for k, v in knobs.items() if k in knob_fields(cls)}
    return cls(config=config, label=label, **{**own, **values})


@dataclasses.dataclass(frozen=True)
class Scale:
    config: RCRConfig
    knobs: dict

    def __init__(self, config: RCRConfig | None = None, **knobs):
        object.__setattr__(self, "config", config or RCRConfig())
        object.__setattr__(self, "knobs", knobs)

    def replace(self, **changes) -> Scale:
        shared = {f.name for f in dataclasses.fields(RCRConfig)}
        config = self.config.replace(**{k: v for k, v in changes.items() if k in shared})
        return Scale(config, **{**self.knobs, **{k: v for k, v in changes.items() if k not in shared}})

    def __getattr__(self, name: str):
        """A knob or shared field of this scale (``SMALL.candidates``, ``SMALL.selected``), else a knob's default."""
        if name in self.knobs:
            return self.knobs[name]
        if name in {f.name for f in dataclasses.fields(RCRConfig)}:
            return getattr(self.config, name)
        for cls in METHODS.values():
            fields = knob_fields(cls)
            if name in fields:
                return fields[name].default
        raise AttributeError(name)

    def method(self, label: str) -> Method:
        return build(label, self.config, **self.knobs)

    def methods(self, labels) -> list[Method]:
        return [self.method(label) for label in labels]
