"""Checkpoints of a training run, and how its final weights compare with a reference model's.

A checkpoint is written atomically every few minutes and at a clean stop; it stores the recipe, the curriculum's
id and the thread count, so that a resume is refused when it would not continue the same run, and noted when its
thread count differs (the weights then match neither count's straight run).
"""

from __future__ import annotations

from pathlib import Path

from rcr.fileio import atomic_path

from .curriculum import CURRICULUM_ID
from .recipe import Recipe, differences


class CheckpointError(SystemExit):
    """A checkpoint that cannot continue this run (another recipe or curriculum, or none where one is needed)."""


def save(obj: dict, path: Path) -> None:
    import torch

    with atomic_path(path) as fh:
        torch.save(obj, fh)


def read(path: Path, recipe: Recipe, fields: tuple[str, ...], device, resume: bool = True) -> dict:
    """The checkpoint at ``path``, checked against ``recipe`` on ``fields`` (the fields the stage's weights
    depend on, so that one finished stage may start several later ones); to ``resume`` training also the same
    curriculum, and a note when it was written at another thread count."""
    import torch

    ck = torch.load(path, map_location=device, weights_only=False)  # our own checkpoint, not dataset content
    differ = differences(ck.get("recipe", {}), recipe, fields)
    if differ:
        raise CheckpointError(f"checkpoint {path} was made with another recipe: {', '.join(differ)}; train with the "
                              "same recipe, or pass --fresh")
    if resume and ck.get("curriculum", CURRICULUM_ID) != CURRICULUM_ID:
        raise CheckpointError(f"checkpoint {path} was made under another curriculum ({ck.get('curriculum')}, this "
                              f"trainer has {CURRICULUM_ID}): its remaining batches would differ; pass --fresh")
    before = ck.get("recipe", {}).get("threads")
    if resume and before is not None and str(before) != str(recipe.threads):
        print(f"note: {path} was written at threads {before} and this process runs at threads {recipe.threads}: "
              "the weights will match a run that changes its thread count at this step, not a straight run at "
              "either count", flush=True)
    return ck


def reference_weights(same_as: str | None):
    """--same-as's tensors by name, read at the start (the run may overwrite that directory)."""
    if same_as is None:
        return None
    path = Path(same_as) / "model.safetensors"
    if not path.is_file():
        raise CheckpointError(f"--same-as {same_as}: no model.safetensors there (give a model directory)")
    from safetensors.torch import load_file

    return load_file(path)


def weights_verdict(saved: Path, reference: dict, name: str) -> str:
    """One line on how the weights saved in the model dir ``saved`` compare with ``reference`` (--same-as)."""
    import torch
    from safetensors.torch import load_file

    got = load_file(Path(saved) / "model.safetensors")
    if got.keys() != reference.keys():
        return f"weights differ from {name}'s: other tensors ({len(got.keys() ^ reference.keys())} names differ)"
    differ = [k for k in got if not torch.equal(got[k], reference[k])]  # False for tensors of other shapes too
    if not differ:
        return f"weights equal {name}'s bit for bit ({len(got)} tensors)"
    same_shape = [k for k in differ if got[k].shape == reference[k].shape]
    gap = max((float((got[k] - reference[k]).abs().max()) for k in same_shape), default=float("nan"))
    return f"weights differ from {name}'s: {len(differ)} of {len(got)} tensors differ; max abs diff {gap:.2g}"


def init_weights_from(model, path: str) -> None:
    """Start from the weights of a saved model directory of the same size and tokenizer."""
    from transformers import Qwen2VLForConditionalGeneration

    sd = Qwen2VLForConditionalGeneration.from_pretrained(path).state_dict()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"--init-from {path}: weights do not fit (missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]})")
    print(f"initialised from {path}", flush=True)
