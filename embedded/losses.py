"""The embedded model's training objective: the answer's cross-entropy plus a grounding loss on where one decoder
layer looks, and the optimizer step that takes both.

The grounding loss supervises attention, as grounded-captioning models are taught: at the steps that write an
object's size, colour, texture or shape, the supervised layer's attention is pulled onto the visual tokens of the
cell the sentence is about. It says where to look, never which entries a KV-cache method keeps.
"""

from __future__ import annotations


def grounding_loss(attn, target, spread: bool = False):
    """Supervised attention: the mean over heads and target rows of -log(the attention mass on the row's targets).
    ``attn`` (B, H, T, T) one layer's weights, ``target`` (B, T, T) bool (``BatchBuilder.ground_targets``). With
    ``spread`` the row's term is instead the cross-entropy of its attention against the uniform distribution over
    its n targets, less its minimum log n: -mean over targets of log(n * weight), 0 only when all the mass is on the
    targets and evenly (the whole cell read, not one entry of it). Returns (loss, mean mass on the targets), or
    (None, None) where no row has a target."""
    import torch

    rows = target.any(-1)  # (B, T)
    if not rows.any():
        return None, None
    on = target[:, None].to(attn.dtype)  # (B, 1, T, T)
    mass = (attn * on).sum(-1)  # (B, H, T)
    if spread:
        n = on.sum(-1).clamp_min(1)  # (B, 1, T) targets per row
        ce = -(torch.log(attn * n[..., None] + 1e-4) * on).sum(-1) / n  # (B, H, T)
        loss = ce.transpose(1, 2)[rows].mean()
    mass = mass.transpose(1, 2)[rows]  # (rows, H)
    return (loss if spread else -torch.log(mass + 1e-4).mean()), mass.detach().mean()


def optimizer_step(model, opt, batch: dict, lr: float, ground_weight: float = 0.0, ground_layer: int = -1,
                   ground_spread: bool = False):
    """One AdamW step on a training batch (its "labels" and "ground" popped): cross-entropy on the answer tokens,
    plus ``ground_weight`` times ``grounding_loss`` of decoder layer ``ground_layer`` where the batch has attention
    targets (which needs the text attention eager, to return its weights). Gradient clip 1; each parameter group at
    ``lr`` times its "lr_scale". Returns (loss, logits (B, T-1, V) fp32, targets (B, T-1), the mean attention mass
    on the grounding targets or None)."""
    import torch

    for g in opt.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    labels = batch.pop("labels")
    target = batch.pop("ground", None)
    if not ground_weight:
        target = None  # the batch has targets, the loss does not use them
    out = model(**batch, output_attentions=target is not None)
    logits = out.logits[:, :-1].float()
    tgt = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)
    total, mass = loss, None
    if target is not None:
        aux, mass = grounding_loss(out.attentions[ground_layer], target, ground_spread)
        if aux is not None:  # the batch has target rows
            total = total + ground_weight * aux
    opt.zero_grad(set_to_none=True)
    total.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss, logits, tgt, mass


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
