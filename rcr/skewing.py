"""InfiniGen's skewing: skew matrices, partial columns, and the calibration files that hold them
(docs/algorithms.md, "infinigen").

Used by the method (``rcr.methods.infinigen``: per-sample calibration, loading a calibration directory) and by
the offline calibration command (``python -m rcr.calibrate_infinigen``, which writes one). Kept apart from
that command's module so that ``import rcr`` does not import the command (``python -m`` would then warn and
run it twice).

A calibration directory holds ``infinigen.safetensors`` (per layer l: ``skew.l`` (Hkv, d, d) fp32 and
``cols.l`` (Hkv, c) long) and ``calibration.json`` (how it was made; its ``description`` is what a decode
reports as ``GenerationResult.cost["calibration"]``, with the tensor file's sha256). A checkpoint directory may
carry one as ``infinigen_calibration/`` (the embedded model does): it is used when its ``model_sha256`` is the
digest of the checkpoint's weights (:func:`weights_digest`), and refused as stale otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

from .config import ConfigError
from .fileio import atomic_path

CALIBRATION_TENSORS = "infinigen.safetensors"
CALIBRATION_META = "calibration.json"
SHIPPED_DIR = "infinigen_calibration"  # a calibration inside a checkpoint directory
PER_SAMPLE = "per_sample"  # RCRConfig.infinigen_calibration: each sample calibrated from its own prefill
ORTHO_TOL = 1e-4


def skew_from_grams(gram_q: torch.Tensor, gram_k: torch.Tensor) -> torch.Tensor:
    """A from the Gram matrices Q^T Q and K^T K (..., d, d): the right singular vectors of Q (eigenvectors of
    Q^T Q, singular values sqrt of its eigenvalues) ordered by s_q * s_k, descending. Computed in fp64."""
    eq, vq = torch.linalg.eigh(gram_q.double())  # ascending
    ek = torch.linalg.eigvalsh(gram_k.double())
    s_q = eq.clamp_min(0).sqrt().flip(-1)  # descending, with the matching vectors
    vq = vq.flip(-1)
    s_k = ek.clamp_min(0).sqrt().flip(-1)
    order = (s_q * s_k).argsort(dim=-1, descending=True, stable=True)
    return torch.gather(vq, -1, order.unsqueeze(-2).expand_as(vq)).float()


def check_orthogonal(a: torch.Tensor, what: str = "skew matrix") -> None:
    """Raises when A^T A is not the identity (then skewing would change q.k). Runs at load/build, not per step."""
    eye = torch.eye(a.shape[-1], dtype=torch.float64, device=a.device)
    err = float((a.double().transpose(-1, -2) @ a.double() - eye).abs().max()) if a.numel() else 0.0
    if not err <= ORTHO_TOL:
        raise ValueError(f"InfiniGen {what} is not orthogonal: max |A^T A - I| = {err:.2e} > {ORTHO_TOL}")


def partial_columns(abs_q: torch.Tensor, abs_k: torch.Tensor, c: int) -> torch.Tensor:
    """InfiniGen's column rule at an exact size: abs_q, abs_k (..., d) = sum over tokens of |QA|, |KA|. A column
    enters the union at rank min(rank_q, rank_k); the first c to enter are kept (ties: the other rank, then
    the column index). Returns (..., c) column indices, ascending."""
    d = abs_q.shape[-1]
    rq = abs_q.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    rk = abs_k.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    key = torch.minimum(rq, rk) * d * d + torch.maximum(rq, rk) * d + torch.arange(d, device=abs_q.device)
    return key.argsort(dim=-1)[..., :c].sort(dim=-1).values


def n_partial(ratio: float, head_dim: int) -> int:
    """Partial columns per KV head: round(ratio * d), at least 1."""
    return max(1, round(ratio * head_dim))


def _serialize(skews: list[torch.Tensor], cols: list[torch.Tensor]) -> bytes:
    """The tensor file's bytes (safetensors): what :func:`calibration_digest` hashes."""
    from safetensors.torch import save

    tensors = {}
    for layer, (a, c) in enumerate(zip(skews, cols)):
        check_orthogonal(a, f"skew matrix of layer {layer}")
        tensors[f"skew.{layer}"] = a.float().contiguous().cpu()
        tensors[f"cols.{layer}"] = c.long().contiguous().cpu()
    return save(tensors)


def tensors_digest(skews: list[torch.Tensor], cols: list[torch.Tensor]) -> str:
    """The digest a calibration held in memory would have as a file (:func:`calibration_digest`)."""
    return _digest(_serialize(skews, cols))


def save_calibration(out_dir: str, skews: list[torch.Tensor], cols: list[torch.Tensor], meta: dict) -> None:
    """skews[l] (Hkv, d, d) fp32, cols[l] (Hkv, c) long. Writes both files atomically (``rcr.fileio``)."""
    os.makedirs(out_dir, exist_ok=True)
    with atomic_path(os.path.join(out_dir, CALIBRATION_TENSORS), "wb") as fh:
        fh.write(_serialize(skews, cols))
    with atomic_path(os.path.join(out_dir, CALIBRATION_META), "w") as fh:
        json.dump(meta, fh, indent=2, sort_keys=True)


def _tensor_file(path: str, owner: str = "infinigen") -> str:
    f = os.path.join(path, CALIBRATION_TENSORS)
    if not os.path.isfile(f):
        raise ConfigError(f"{owner}.calibration", f"no {CALIBRATION_TENSORS} in {path!r}; write one with "
                                                  "`python -m rcr.calibrate_infinigen --model PATH --out DIR`")
    return f


def weights_digest(model_dir: str | os.PathLike) -> str:
    """sha256 (16 hex digits) of a checkpoint's weights: its ``*.safetensors`` files' bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")):
        with open(os.path.join(model_dir, name), "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def shipped_calibration(model_dir: str | os.PathLike | None, owner: str = "infinigen") -> str | None:
    """The calibration a checkpoint directory carries (``<model_dir>/infinigen_calibration``), or None. A ConfigError
    when it was made for other weights (its ``model_sha256`` is not :func:`weights_digest` of the checkpoint)."""
    if not model_dir or not os.path.isdir(model_dir):
        return None
    d = os.path.join(model_dir, SHIPPED_DIR)
    if not os.path.isfile(os.path.join(d, CALIBRATION_TENSORS)):
        return None
    made_for, these = calibration_meta(d, owner).get("model_sha256"), weights_digest(model_dir)
    if made_for != these:
        raise ConfigError(f"{owner}.calibration", f"the calibration shipped in {d} was made for other weights (model "
                                                  f"sha256 {made_for}, these are {these}); write it again with "
                                                  f"`python -m rcr.calibrate_infinigen --model {model_dir} --out {d}`")
    return d


def calibration_meta(path: str, owner: str = "infinigen") -> dict:
    """A calibration directory's ``calibration.json`` plus ``sha256``, its tensor file's digest."""
    meta_f = os.path.join(path, CALIBRATION_META)
    meta = {}
    if os.path.isfile(meta_f):
        with open(meta_f) as fh:
            meta = json.load(fh)
    return {**meta, "sha256": calibration_digest(path, owner)}


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def calibration_digest(path: str, owner: str = "infinigen") -> str:
    """sha256 (first 16 hex digits) of a calibration directory's tensor file: what the output rows record."""
    with open(_tensor_file(path, owner), "rb") as fh:
        return _digest(fh.read())


def load_calibration(path: str) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """(skews, cols, meta) from a directory written by ``save_calibration``; checks orthogonality. ``meta`` is
    its ``calibration.json`` plus ``sha256``, the digest of the tensor file (:func:`calibration_digest`)."""
    from safetensors.torch import load

    f = _tensor_file(path)
    with open(f, "rb") as fh:
        data = fh.read()
    t = load(data)  # safetensors: tensors only, nothing executable
    n = len([k for k in t if k.startswith("skew.")])
    skews = [t[f"skew.{i}"] for i in range(n)]
    cols = [t[f"cols.{i}"] for i in range(n)]
    for i, a in enumerate(skews):
        check_orthogonal(a, f"skew matrix of layer {i} in {f}")
    meta = calibration_meta(path)
    return skews, cols, meta
