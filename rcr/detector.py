"""Rank-r SVD drift detector, one per (layer, KV head), built once after prefill.

K_P = U S V^T (plain, uncentred SVD in fp32 of the post-RoPE prefix keys); R = V[:, :r] (d, r).
The detector keeps the projected keys K~ = K_P R (Np, r): approximate logits of prefix entries are
(R^T q) . K~ / sqrt(d), i.e. Np*r/d dot-product equivalents per query instead of Np. K~ is stored transposed,
(r, Np), the layout the decode-time matmul (G, r) @ (r, Np) reads contiguously.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Detector:
    basis: torch.Tensor  # (B, Hkv, d, r) fp32
    projected_t: torch.Tensor  # (B, Hkv, r, Np) fp32, contiguous

    @classmethod
    def build(cls, prefix_keys: torch.Tensor, valid: torch.Tensor, rank: int) -> Detector:
        """prefix_keys (B, Hkv, Np, d); valid (B, Np). Padded rows are zeroed so they do not shape the basis."""
        k = prefix_keys.float() * valid[:, None, :, None]
        _, _, vh = torch.linalg.svd(k, full_matrices=False)  # vh (B, Hkv, min(Np, d), d)
        basis = vh[..., :rank, :].transpose(-1, -2).contiguous()  # (B, Hkv, d, r)
        return cls(basis=basis, projected_t=(k @ basis).transpose(-1, -2).contiguous())

    @property
    def projected(self) -> torch.Tensor:  # (B, Hkv, Np, r), a view
        return self.projected_t.transpose(-1, -2)

    @property
    def rank(self) -> int:
        return self.basis.shape[-1]

    def approx_logits(self, qg: torch.Tensor, scaling: float) -> torch.Tensor:
        """qg (B, Hkv, G, d) -> approximate logits over the whole prefix (B, Hkv, G, Np), fp32."""
        qr = torch.matmul(qg.float(), self.basis)  # (B, Hkv, G, r)
        return torch.matmul(qr, self.projected_t).mul_(scaling)
