"""The embedded model's training objective: the answer's cross-entropy plus a grounding loss on where one decoder
layer looks, and the optimizer step that takes both.

The grounding loss supervises attention, as grounded-captioning models are taught: at the steps that write an
object's size, colour, texture or shape, the supervised layer's attention is pulled onto the visual tokens of the
cell the sentence is about. It says where to look, never which entries a KV-cache method keeps.

The share stage's loss (``image_share_loss``) says how much of a step's attention goes to the image at all, per
sample. The grounding loss keeps asking the steps that write an attribute for their cell's share of the whole mass,
so those steps still read their cell with most of their attention while the other steps give the image little; the
recipe's ``share_ground`` can instead ask for the cell's share of the image mass, so that the two losses say
different things (where in the image; how much on the image).
"""

from __future__ import annotations

from dataclasses import dataclass


def image_mass(attn, image):
    """(B, H, T): the attention mass each row of ``attn`` (B, H, T, T) puts on the visual tokens ``image`` (B, T)."""
    return (attn * image[:, None, None, :].to(attn.dtype)).sum(-1)


def grounding_loss(attn, target, spread: bool = False, image=None):
    """Supervised attention: the mean over heads and target rows of -log(the attention mass on the row's targets).
    ``attn`` (B, H, T, T) one layer's weights, ``target`` (B, T, T) bool (``BatchBuilder.ground_targets``). With
    ``spread`` the row's term is instead the cross-entropy of its attention against the uniform distribution over
    its n targets, less its minimum log n: -mean over targets of log(n * weight), 0 only when all the mass is on the
    targets and evenly (the whole cell read, not one entry of it). With ``image`` ((B, T) bool, the visual tokens)
    the weights are taken as shares of the row's mass on the image. Returns (loss, mean mass on the targets), or
    (None, None) where no row has a target."""
    import torch

    rows = target.any(-1)  # (B, T)
    if not rows.any():
        return None, None
    if image is not None:
        attn = attn / image_mass(attn, image).clamp_min(1e-6)[..., None]  # (B, H, T, T), rows sum to 1 on the image
    on = target[:, None].to(attn.dtype)  # (B, 1, T, T)
    mass = (attn * on).sum(-1)  # (B, H, T)
    if spread:
        n = on.sum(-1).clamp_min(1)  # (B, 1, T) targets per row
        ce = -(torch.log(attn * n[..., None] + 1e-4) * on).sum(-1) / n  # (B, H, T)
        loss = ce.transpose(1, 2)[rows].mean()
    mass = mass.transpose(1, 2)[rows]  # (rows, H)
    return (loss if spread else -torch.log(mass + 1e-4).mean()), mass.detach().mean()


@dataclass(frozen=True)
class Share:
    """The share loss of a step: its weight, the decoder layers it supervises, how many head groups it holds to the
    target (1: the mean over a layer's heads; H_kv: each KV head's mean over its query heads), the visual tokens'
    id, and whether the grounding loss takes the cell's share of the image mass (``ground_on_image``) or of the
    whole mass where the share loss applies."""

    weight: float
    layers: tuple[int, ...]
    groups: int
    image_token_id: int
    ground_on_image: bool = False


def image_share_loss(attentions, rows, image, target, groups: int = 1):
    """The squared distance, in log-odds, between the image's share of each answer step's attention and the
    sample's target: the mean over ``attentions`` (one (B, H, T, T) per supervised layer), answer steps and
    ``groups`` means over consecutive heads (1: the layer's head mean; H_kv: each KV head's mean over its query
    heads). ``rows`` (B, T) bool the steps that write an answer token, ``image`` (B, T) bool the visual tokens,
    ``target`` (B,) each sample's share. Log-odds, because a share near 0.01 and one near 0.3 must both be
    reachable: a squared difference of shares barely moves a small one. Returns (loss, the share (rows,) of each
    supervised row, averaged over layers and heads, detached)."""
    import torch

    goal = torch.logit(target.to(attentions[0].dtype))[:, None, None]  # (B, 1, 1)
    terms, seen = [], []
    for a in attentions:
        share = image_mass(a, image)  # (B, H, T)
        held = share.unflatten(1, (groups, share.shape[1] // groups)).mean(2)  # (B, groups, T)
        gap = torch.logit(held.clamp(1e-4, 1 - 1e-4)) - goal  # (B, held, T)
        terms.append(gap.square().transpose(1, 2)[rows])  # (rows, held)
        seen.append(share.mean(1).detach()[rows])  # (rows,)
    return torch.cat(terms, 1).mean(), torch.stack(seen).mean(0)


def answer_rows(labels):
    """(B, T) bool: the positions whose next token is an answer token (the steps that write the answer)."""
    import torch

    rows = torch.zeros_like(labels, dtype=torch.bool)
    rows[:, :-1] = labels[:, 1:] != -100
    return rows


def optimizer_step(model, opt, batch: dict, lr: float, ground_weight: float = 0.0, ground_layer: int = -1,
                   ground_spread: bool = False, share: Share | None = None):
    """One AdamW step on a training batch (its "labels", "ground" and "share_target" popped): cross-entropy on the
    answer tokens, plus ``ground_weight`` times ``grounding_loss`` of decoder layer ``ground_layer`` where the batch
    has attention targets, plus ``share.weight`` times ``image_share_loss`` where it has share targets (either needs
    the text attention eager, to return its weights; with a share loss and ``share.ground_on_image`` the grounding
    is relative to the image mass). Gradient clip 1; each parameter group at ``lr`` times its
    "lr_scale". Returns (loss, logits (B, T-1, V) fp32, targets (B, T-1), the mean attention mass on the grounding
    targets or None, and the per-sample mean image share (B,) where the share loss applied, else None)."""
    import torch

    for g in opt.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    labels = batch.pop("labels")
    target = batch.pop("ground", None)
    share_target = batch.pop("share_target", None)
    if not ground_weight:
        target = None  # the batch has targets, the loss does not use them
    if share is None or not share.weight:
        share_target = None
    out = model(**batch, output_attentions=target is not None or share_target is not None)
    logits = out.logits[:, :-1].float()
    tgt = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)
    total, mass, shares = loss, None, None
    image = batch["input_ids"] == share.image_token_id if share is not None else None  # (B, T)
    if target is not None:
        relative = share_target is not None and share.ground_on_image
        aux, mass = grounding_loss(out.attentions[ground_layer], target, ground_spread,
                                   image=image if relative else None)
        if aux is not None:  # the batch has target rows
            total = total + ground_weight * aux
    if share_target is not None:
        rows = answer_rows(labels)
        aux, seen = image_share_loss([out.attentions[i] for i in share.layers], rows, image, share_target,
                                     share.groups)
        total = total + share.weight * aux
        counts = rows.sum(1)  # (B,) answer steps per sample
        shares = torch.zeros(len(counts)).index_add_(0, rows.nonzero()[:, 0], seen) / counts.clamp_min(1)
    opt.zero_grad(set_to_none=True)
    total.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss, logits, tgt, mass, shares


def make_optimizer(model, lr: float, weight_decay: float, lr_scale=lambda name: 1.0):
    """AdamW with weight decay on the weight matrices only; each group carries the ``lr_scale`` of its parameters'
    names, which ``optimizer_step`` multiplies the step's learning rate by."""
    import torch

    groups: dict[tuple[bool, float], list] = {}
    for name, p in model.named_parameters():
        groups.setdefault((p.ndim >= 2, lr_scale(name)), []).append(p)
    return torch.optim.AdamW([{"params": ps, "weight_decay": weight_decay if decay else 0.0, "lr_scale": scale}
                              for (decay, scale), ps in groups.items()], lr=lr, betas=(0.9, 0.98))


def is_tower_body(name: str) -> bool:
    """The vision tower's patch embedding and blocks (``model.visual.*`` but its merger): what a recipe's
    ``vision_lr_scale`` slows in the main stage."""
    return name.startswith("model.visual.") and not name.startswith("model.visual.merger.")
