"""``rcr_layer``: RCR with one threshold per layer per sample instead of one shared by all layers.

The paper leaves per-layer thresholds unexplored (docs/algorithms.md, "rcr_layer"). Everything else is RCR's:
the same detector, drift estimate, candidates, masked merge and controller law,
tau_l <- tau_l * exp(step * (f_l - rho)), but
tau_l is updated only by layer l's own refreshes. Each layer therefore refreshes about rho of its steps,
instead of the shared threshold letting high-drift layers take most of the refreshes. Every tau_l starts at
tau0. State: tau (B, L) on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rcr import RCR, RCRState


@dataclass
class RCRLayer(RCR):
    name = "rcr_layer"

    def tau_shape(self, prefix) -> tuple[int, ...]:
        return (prefix.batch_size, len(prefix.layers))

    def current_tau(self, state: RCRState, layer: int) -> torch.Tensor:
        return state.tau[:, layer]

    def update_tau(self, state: RCRState, layer: int, f: torch.Tensor) -> None:
        state.tau[:, layer] = self.controller.update(state.tau[:, layer], f)  # in place (decide cloned its tau)
