"""Per-sample decode telemetry, preallocated on the device and copied to the host once per decode.

Buffers are (B, L, T): batch, decoder layers, decode steps. Writes index the step with a Python int, or, in a
compiled decode, with a (1,) device tensor (so the traced step does not depend on a changing Python value).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# rcr::decide (rcr/csrc/decide.cpp) writes RCR's decision straight into the first six, in this order
FIELDS_FLOAT = ("drift", "tau", "trigger", "keys_read", "values_read", "detector_dots", "recalled")


class Telemetry:
    """Device-side recorder. ``trigger`` holds the fraction of the layer's KV heads that refreshed
    (exactly 0 or 1 with the default per-layer trigger); read counts are per KV head, the trigger fraction times
    the method's cost model: the reads a refresh needs (the deployment accounting; GPU-only masked merges issue
    them every step). ``recalled``: a page-caching method's own recalls (ArkVale), NaN for the others.

    ``reselected`` (L,) says which layers have a selection at all: a sliding-window layer keeps its whole window
    and is never re-selected, so its ``trigger`` stays NaN (not 0) and refresh fractions are over the others."""

    def __init__(self, batch: int, layers: int, steps: int, device, exact_drift: bool, record_attention: bool,
                 reselected: list[bool] | None = None):
        def buf(dtype=torch.float32, fill=0.0):
            return torch.full((batch, layers, steps), fill, dtype=dtype, device=device)

        # the fields of FIELDS_FLOAT are views of one (F, B, L, T) buffer: a layer-step's decision is one write
        self.decisions = torch.zeros((len(FIELDS_FLOAT), batch, layers, steps), device=device)
        for i, name in enumerate(FIELDS_FLOAT):
            setattr(self, name, self.decisions[i])
        self.drift.fill_(float("nan"))  # estimated drift (NaN: method has no detector)
        self.tau.fill_(float("nan"))
        self.recalled.fill_(float("nan"))
        for layer, selects in enumerate(reselected or []):
            if not selects:
                self.trigger[:, layer] = float("nan")
        # what a decision without drift, tau or detector records: the fields' initial values
        self._nan = torch.full((batch,), float("nan"), device=device)
        self._zero = torch.zeros(batch, device=device)
        self.drift_exact = buf(fill=float("nan")) if exact_drift else None
        self.top_prefix_pos = buf(torch.int32, -1) if record_attention else None
        # bytes of prefix keys/values copied from host memory to the device, per sample (all KV heads):
        # written on the host by the offload reader (rcr.offload.HostReader); zeros in GPU-only mode
        self.bytes_moved = np.zeros((batch, layers, steps), dtype=np.float64)

    @staticmethod
    def put(buf: torch.Tensor, layer: int, step, value: torch.Tensor) -> None:
        """buf[..., layer, step] = value, for any buffer shaped (..., L, T) with ``value`` shaped
        (...); ``step`` an int or a (1,) long device tensor (the compiled step's counter)."""
        if isinstance(step, torch.Tensor):
            buf.select(-2, layer).index_copy_(-1, step, value.to(buf.dtype).unsqueeze(-1))
        else:
            buf[..., layer, step] = value

    def record_decision(self, layer: int, step, d, cost: dict) -> None:
        """One layer-step's ``Decision``; ``cost`` is the method's cost model (reads per refresh)."""
        trig = d.trigger.float()
        frac = trig.mean(-1) if trig.dim() == 2 else trig  # (B,)
        row = torch.stack([  # (F, B) in FIELDS_FLOAT order
            self._nan if d.drift is None else d.drift,
            self._nan if d.tau is None else d.tau,
            frac,
            frac * cost["keys_per_refresh"],
            frac * cost["values_per_refresh"],
            self._zero if d.detector_dots is None else d.detector_dots,
            self._nan if d.recalled is None else d.recalled])
        self.put(self.decisions, layer, step, row)

    def to_host(self) -> HostTelemetry:
        names = FIELDS_FLOAT + ("drift_exact", "top_prefix_pos")
        return HostTelemetry(**{n: (None if getattr(self, n) is None else getattr(self, n).cpu().numpy())
                                for n in names}, bytes_moved=self.bytes_moved.copy())


@dataclass
class HostTelemetry:
    drift: np.ndarray  # (B, L, T) float32
    tau: np.ndarray
    trigger: np.ndarray
    keys_read: np.ndarray
    values_read: np.ndarray
    detector_dots: np.ndarray
    recalled: np.ndarray | None = None  # (B, L, T) a page-caching method's own recalls per KV head (ArkVale)
    drift_exact: np.ndarray | None = None
    top_prefix_pos: np.ndarray | None = None  # (B, L, T) int32, in the sample's own (unpadded) coordinates
    bytes_moved: np.ndarray | None = None  # (B, L, T) float64: host-to-device prefix bytes (offload mode)
