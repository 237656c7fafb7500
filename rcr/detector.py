"""Rank-r SVD drift detector, one per (layer, KV head), built once after prefill.

K_P = U S V^T (plain, uncentred SVD in fp32 of the post-RoPE prefix keys); R = V[:, :r] (d, r).
The detector keeps the projected keys K~ = K_P R (Np, r): approximate logits of prefix entries are
(R^T q) . K~ / sqrt(d), i.e. Np*r/d dot-product equivalents per query instead of Np. K~ is stored transposed,
(r, Np), the layout the decode-time matmul (G, r) @ (r, Np) reads contiguously.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scoring import NEG_INF


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

    def evicted_lse_and_scores(self, qg: torch.Tensor, selection: torch.Tensor, valid: torch.Tensor | None,
                               scaling: float, how: str, fused: bool, kept: torch.Tensor | None = None,
                               lse_res: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """RCR's pass over the prefix logits: the drift's evicted log-sum-exp and the candidate scores.

        qg (B, Hkv, G, d); selection (B, Hkv, S) the kept (resident) prefix entries; valid (B, Np), or None when the
        batch has no padding (nothing is masked then). ``kept`` (B, Hkv, G, S): the exact logits of the kept entries
        (the resident slots [0, S)), which stand in for their approximate logits in the candidate scores (None:
        every entry by its approximate logit). ``lse_res`` (B, Hkv, G): the exact log-sum-exp over the resident
        slots; with it, ``mean_prob`` normalises each query head over its whole context, estimated as
        logaddexp(lse_res, lse_ev) (None: the softmax over the prefix).

        Returns lse_ev (B, Hkv, G), the log-sum-exp of the approximate logits over the evicted valid entries (-inf
        when there are none), and the candidate scores (B, Hkv, Np) by ``how`` (``mean_prob``: the mean over G of
        the probabilities; ``max_logit``), -inf on padding. ``fused``: one C++ kernel (``rcr.fused``, CPU only,
        once ``rcr.fused.available()``); otherwise the composed torch ops below, its reference.
        """
        if fused:  # registered by rcr.fused.available(), which the caller checked
            qr = torch.matmul(qg.float(), self.basis)  # (B, Hkv, G, r)
            return torch.ops.rcr.detector_pass(qr, self.projected_t, selection, valid, kept, lse_res, scaling,
                                               how == "mean_prob")
        # One softmax serves the drift and the candidate scores. The kept entries' exact logits and the padding's
        # -inf are written in place (lg is this step's own tensor); a sample with no valid entry gives NaN rows -> 0.
        lg = self.approx_logits(qg, scaling)  # (B, Hkv, G, Np)
        if kept is not None:
            lg.scatter_(3, selection.unsqueeze(2).expand(kept.shape), kept.float())
        valid_p = None if valid is None else valid[:, None, None, :]  # (B, 1, 1, Np)
        if valid_p is not None:
            lg.masked_fill_(~valid_p, NEG_INF)
        probs = torch.softmax(lg, dim=-1)
        if valid_p is not None:
            probs.nan_to_num_(0.0)
        # LSE over the evicted entries = LSE over all valid entries + log(softmax mass on the evicted ones); at
        # the row's max logit m the softmax is exp(m - LSE), so LSE = m - log(max prob): two max passes instead
        # of a masked copy and a log-sum-exp pass. The evicted mass is summed directly (no 1 - resident mass,
        # which would cancel when the resident entries hold almost all of it), and is exactly 0 when nothing
        # is evicted. The evicted entries' logits are the approximate ones whatever ``kept`` is.
        B, H, G, n_prefix = lg.shape
        evicted = torch.ones(B, H, 1, n_prefix, device=probs.device)
        evicted.scatter_(3, selection.unsqueeze(2), 0.0)  # (B, Hkv, 1, Np); padding has probability 0
        mass_ev = (probs * evicted).sum(-1)  # (B, Hkv, G)
        lse_all = lg.amax(-1) - probs.amax(-1).log()  # (B, Hkv, G) over the valid prefix
        lse_ev = torch.where(mass_ev > 0, lse_all + mass_ev.log(), NEG_INF)  # also a sample with no valid entry
        if how != "mean_prob":
            scores = lg.amax(dim=2)  # (B, Hkv, Np)
        elif lse_res is None:
            scores = probs.mean(dim=2)
        else:  # the prefix softmax rescaled to the context's: exp(lse_all - norm) is the prefix's share per head
            share = torch.exp(lse_all - torch.logaddexp(lse_res, lse_ev)).div_(G)  # (B, Hkv, G), over the mean
            if valid_p is not None:
                share.nan_to_num_(0.0)  # a sample with no valid entry
            scores = torch.matmul(share.unsqueeze(2), probs).squeeze(2)  # (B, Hkv, Np)
        if valid_p is not None:
            scores.masked_fill_(~valid_p.squeeze(2), NEG_INF)
        return lse_ev, scores
