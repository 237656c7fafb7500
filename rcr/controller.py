"""The rate controller: a multiplicative integral controller on the drift threshold tau.

After each layer: tau <- tau * exp(step * (f - rho)). In steady state E[f] = rho, i.e. tau tracks the
(1 - rho)-quantile of drift, so about rho of the layer-steps refresh whatever the drift scale of a sample.
Everything is a device tensor; nothing here reads a value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RateController:
    tau0: float = 0.03
    step: float = 0.05
    rho: float = 0.4

    def init(self, shape: tuple[int, ...], device) -> torch.Tensor:
        """One tau per sample (shape (B,)), or per sample and layer ((B, L)) for per-layer thresholds."""
        return torch.full(shape, self.tau0, dtype=torch.float32, device=device)

    def update(self, tau: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        """f: realised refresh indicator (or fraction of heads) of this layer, same shape as tau."""
        return tau * torch.exp(self.step * (f.float() - self.rho))
