"""Where a model's decode-time attention goes, layer by layer: the properties of real VLM attention RCR relies on.

For a few samples the model writes its greedy answer (``greedy_answers``); one teacher-forced forward pass over
prompt + answer with eager attention (the weights are materialised only there) then gives every answer step's
attention. Per layer, averaged over answer steps and samples (``layer_profile``):

* ``prefix``: the attention mass on the prompt, against the answer so far;
* ``image``: the part of it on image/video tokens;
* ``on_image``: the image/video tokens' share of the step's whole attention (prompt, answer so far and all);
* ``top``: the share of the prefix mass that the best ``selected`` entries hold, per KV head (what an exact
  per-step selection keeps);
* ``static``: the same for the best ``selected`` entries over the whole answer, one set per KV head (what a
  selection fixed for the whole answer keeps): ``top`` minus ``static`` is what staleness costs;
* ``entries``: the effective number of prefix entries attended, exp(entropy) of the prefix distribution;
* ``dwell``: how often the most-attended prefix position (mean over heads, as the pipeline's ``top_prefix_pos``)
  is unchanged from the previous step; the paper measures 41% (Qwen2-VL) to 80% (LLaVA-NeXT) over all layers;
* ``flat`` and ``cell``, where the caller gives the masks (the synthetic scenes: ``embedded.probes``):
  the share of the image mass on ``flat`` visual tokens, and on the cell each step describes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from rcr.models import build_inputs, geometry, with_answer


@dataclass
class Answer:
    """One sample's prompt inputs (batch 1), its greedy answer (1, T) and the caller's optional masks: ``flat``
    (N,) bool over the prompt, ``at_cell`` (T, N) bool per answer step."""

    inputs: dict
    answer: torch.Tensor
    masks: dict[str, torch.Tensor] = field(default_factory=dict)


Done = Callable[[int], None]  # told how many items of a stage are finished (a progress display)


def greedy_answers(model, processor, samples, max_new_tokens: int, done: Done | None = None) -> list[Answer]:
    """``samples``: (prompt, PIL images, is_video) each -> their greedy answers, one sample at a time."""
    out = []
    for prompt, images, video in samples:
        inputs = build_inputs(processor, [prompt], [images], video=video)
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        out.append(Answer(inputs=inputs, answer=ids[:, inputs["input_ids"].shape[1]:]))
        if done:
            done(len(out))
    return out


def visual_token_ids(model) -> set[int]:
    """The ids of the image and video placeholder tokens, whatever the family calls them in its config."""
    cfg = model.config
    names = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
    return {int(v) for v in (getattr(cfg, n, None) for n in names) if v is not None}


def cell_share(pre: torch.Tensor, image: torch.Tensor, at_cell: torch.Tensor | None) -> float:
    """Mean over steps that are at a cell of the share of their image mass on it; ``pre`` (H, steps, N)."""
    if at_cell is None:
        return float("nan")
    steps = at_cell.any(-1)  # (steps,)
    on_cell = (pre * at_cell).sum(-1)[:, steps]  # (H, steps at a cell)
    on_image = pre[..., image].sum(-1)[:, steps].clamp_min(1e-12)
    return (on_cell / on_image).mean().item() if steps.any() else float("nan")


def layer_profile(attn: torch.Tensor, n_prompt: int, image: torch.Tensor, n_kv: int, selected: int,
                  flat: torch.Tensor | None = None, at_cell: torch.Tensor | None = None) -> dict:
    """One layer's figures from its attention ``attn`` (H, T, T) of one sample; answer queries are rows
    ``n_prompt - 1 ..`` (the step that writes answer token k reads position n_prompt + k - 1). ``image`` and
    ``flat`` are (N,) masks over the prompt positions; ``at_cell`` (steps, N) marks each step's described cell."""
    a = attn[:, n_prompt - 1:-1].double()  # (H, steps, T): the queries that produced answer tokens
    pre = a[..., :n_prompt]  # (H, steps, N)
    mass = pre.sum(-1)  # (H, steps)
    grp = pre.reshape(n_kv, -1, *pre.shape[1:]).sum(1)  # (Hkv, steps, N): a KV head's selection sees its group
    p = grp / grp.sum(-1, keepdim=True).clamp_min(1e-12)
    k = min(selected, p.shape[-1])
    top = p.topk(k, dim=-1).values.sum(-1)  # (Hkv, steps)
    best = p.sum(1).topk(k, dim=-1).indices  # (Hkv, S): the entries with the most mass over the whole answer
    static = p.gather(-1, best[:, None, :].expand(-1, p.shape[1], -1)).sum(-1)  # (Hkv, steps)
    entries = torch.exp(-(p * p.clamp_min(1e-12).log()).sum(-1))
    argmax = pre.mean(0).argmax(-1)  # (steps,): the most-attended prefix position, mean over heads
    return {
        "prefix": mass.mean().item(),
        "image": (pre[..., image].sum(-1) / mass.clamp_min(1e-12)).mean().item(),
        "on_image": pre[..., image].sum(-1).mean().item(),  # a row of ``a`` sums to 1 over the whole sequence
        "flat": ((pre[..., flat].sum(-1) / pre[..., image].sum(-1).clamp_min(1e-12)).mean().item()
                 if flat is not None else float("nan")),
        "top": top.mean().item(),
        "static": static.mean().item(),
        "entries": entries.mean().item(),
        "dwell": (argmax[1:] == argmax[:-1]).double().mean().item() if len(argmax) > 1 else float("nan"),
        "cell": cell_share(pre, image, at_cell),
    }


def sample_profiles(model, answers: list[Answer], selected: int, per_head: bool = False,
                    done: Done | None = None) -> list[list[dict]]:
    """Per answer, per layer, the figures of ``layer_profile``; with ``per_head`` each layer's dict also holds
    ``"heads"``: the same figures for each KV head on its own (its G query heads). The model must run eager
    attention (``model.set_attn_implementation("eager")``)."""
    geo = geometry(model)
    group = geo.n_q_heads // geo.n_kv_heads
    visual = visual_token_ids(model)
    rows: list[list[dict]] = []
    for a in answers:
        n_prompt = a.inputs["input_ids"].shape[1]
        with torch.no_grad():
            attn = model(**with_answer(a.inputs, a.answer), output_attentions=True).attentions
        image = torch.tensor([int(t) in visual for t in a.inputs["input_ids"][0]])
        flat, at_cell = a.masks.get("flat"), a.masks.get("at_cell")
        per_layer = []
        for w in attn:
            r = layer_profile(w[0], n_prompt, image, geo.n_kv_heads, selected, flat, at_cell)
            if per_head:
                r["heads"] = [layer_profile(w[0, h * group:(h + 1) * group], n_prompt, image, 1, selected, flat,
                                            at_cell) for h in range(geo.n_kv_heads)]
            per_layer.append(r)
        rows.append(per_layer)
        if done:
            done(len(rows))
    return rows


def mean_profile(rows: list[list[dict]]) -> list[dict]:
    """Per layer, ``sample_profiles``' figures averaged over its answers (NaN where no answer has the figure: flat,
    cell), per KV head too where they have ``"heads"``."""

    def mean(dicts: list[dict]) -> dict:
        out = {}
        for k in (k for k in dicts[0] if k != "heads"):
            v = np.array([d[k] for d in dicts], dtype=float)
            out[k] = float(v[np.isfinite(v)].mean()) if np.isfinite(v).any() else float("nan")
        return out

    out = []
    for layer in range(len(rows[0])):
        r = mean([s[layer] for s in rows])
        if "heads" in rows[0][layer]:
            r["heads"] = [mean([s[layer]["heads"][h] for s in rows]) for h in range(len(rows[0][layer]["heads"]))]
        out.append(r)
    return out


def mean_profiles_by(rows: list[list[dict]], groups: list[str]) -> dict[str, list[dict]]:
    """``mean_profile`` of each group's answers (``groups``: one label per answer of ``rows``), in first-seen order."""
    return {g: mean_profile([r for r, h in zip(rows, groups) if h == g]) for g in dict.fromkeys(groups)}


def profile(model, answers: list[Answer], selected: int, per_head: bool = False) -> list[dict]:
    """Per layer, the figures of ``layer_profile`` averaged over ``answers`` (``sample_profiles``,
    ``mean_profile``)."""
    return mean_profile(sample_profiles(model, answers, selected, per_head))
