"""Where a model's decode-time attention goes, layer by layer: the properties of real VLM attention the paper relies on.

For a few held-out synthetic samples, the model writes its greedy answer; then one teacher-forced forward pass over
prompt + answer (eager attention, so the weights are materialised) gives every answer token's attention. Per layer,
averaged over answer steps and samples:

* ``prefix``: the attention mass on the prompt (system text, image tokens, question), against the answer so far;
* ``image``: the part of it on image/video tokens (real VLMs put most of the mass on a few sink and text positions);
* ``on-img``: the image/video tokens' share of the step's whole attention (prefix, answer so far and all), the
  figure ``jobs/eval_embedded.py`` reports for the issue's aim of a small image share;
* ``flat``: the part of the image mass on visual tokens whose 28 x 28 pixels are one flat colour (the synthetic
  scenes' empty background; single-image tasks): such tokens all carry the same value, so a head can park its
  idle mass on them as on a sink spread over hundreds of entries, which no 32-entry selection holds;
* ``top-S``: the share of the prefix mass that the best ``--selected`` entries hold, per KV head (what an exact
  per-step selection keeps; the rest is what it drops);
* ``static``: the same for the best ``--selected`` entries over the whole answer, one set per KV head (what the
  prefill oracle's selection keeps in this layer): ``top-S`` minus ``static`` is what a selection fixed for the
  whole answer loses to one re-chosen at every step;
* ``entries``: the effective number of prefix entries attended, exp(entropy) of the prefix distribution;
* ``dwell``: how often the most-attended prefix position (mean over heads, as the pipeline's ``top_prefix_pos``)
  is unchanged from the previous step; the paper measures 41% (Qwen2-VL) to 80% (LLaVA-NeXT) over all layers.
* ``cell`` (detailcaps on a layout that describes every cell): the share of a step's image mass on the cell its
  description is at (the last "row .. , column .." written), against ``1 / cells`` for attention that ignores
  where the description is. A model that reads what it writes puts most of its image mass there.

    python benchmarks/attention_profile.py                               # the embedded model, 4 detailcaps samples
    python benchmarks/attention_profile.py --model /tmp/peek --layout v3 --n 8
    python benchmarks/attention_profile.py --per-head     # also one row per KV head (its group of query heads)

A sliding-window layer is marked ``local``: it keeps its window and no method re-selects it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pipeline.data import synthetic as S  # noqa: E402
from rcr.models import build_inputs, geometry, load, with_answer  # noqa: E402


def layer_profile(attn: torch.Tensor, n_prompt: int, image: torch.Tensor, n_kv: int, selected: int,
                  flat: torch.Tensor | None = None, at_cell: torch.Tensor | None = None) -> dict:
    """One layer's figures from its attention ``attn`` (H, T, T) of one sample; answer queries are rows
    ``n_prompt - 1 ..`` (the step that writes answer token k reads position n_prompt + k - 1). ``image`` and
    ``flat`` are (N,) masks over the prompt positions; ``at_cell`` (steps, N) marks each step's described cell
    (no position on a step before the first cell is named)."""
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


def cell_share(pre: torch.Tensor, image: torch.Tensor, at_cell: torch.Tensor | None) -> float:
    """Mean over steps that are at a cell of the share of their image mass on it; ``pre`` (H, steps, N)."""
    if at_cell is None:
        return float("nan")
    steps = at_cell.any(-1)  # (steps,)
    on_cell = (pre * at_cell).sum(-1)[:, steps]  # (H, steps at a cell)
    on_image = pre[..., image].sum(-1)[:, steps].clamp_min(1e-12)
    return (on_cell / on_image).mean().item() if steps.any() else float("nan")


def cell_masks(words: list[str], lay: S.SceneLayout, image: torch.Tensor, grid_thw: torch.Tensor,
               patch: int = 28) -> torch.Tensor:
    """(steps, N) bool: per answer step, the prompt's image tokens (merged, raster order; ``image`` marks them)
    whose ``patch`` px block lies in the step's described cell."""
    cells = torch.from_numpy(S.token_cells(lay, grid_thw, patch))  # (h * w,)
    masks = torch.zeros(len(words), len(image), dtype=torch.bool)
    where = image.nonzero().squeeze(-1)  # (h * w,) prompt positions of the image tokens
    for k, cell in enumerate(S.described_cells(words)):
        if cell is not None:
            masks[k, where[cells == cell[0] * lay.cols + cell[1]]] = True
    return masks


def flat_tokens(frame: np.ndarray, grid_thw: torch.Tensor, patch: int = 28) -> torch.Tensor:
    """(tokens,) bool: which merged visual tokens (raster order) cover a block of one flat colour. The synthetic
    images are multiples of 28 px, so the processor does not resize them and block k is token k."""
    _, gh, gw = (int(x) for x in grid_thw)
    h, w = gh // 2, gw // 2
    if frame.shape[:2] != (h * patch, w * patch):
        raise ValueError(f"image {frame.shape[:2]} was resized to {h * patch}x{w * patch}: blocks do not map to tokens")
    blocks = frame.reshape(h, patch, w, patch, -1)
    return torch.from_numpy((blocks == blocks[:, :1, :, :1]).all(axis=(1, 3, 4)).reshape(-1))


def held_out_answers(model, processor, task: str, layout: str, n: int, max_new_tokens: int):
    """The first n held-out samples of a task: (frames, processor inputs (batch 1), greedy answer ids (1, T)) each."""
    for i in range(n):
        frames, _ = S.render(task, S.HELDOUT_SEED, i, layout=layout)
        inputs = build_inputs(processor, [S.PROMPTS[task]], [[Image.fromarray(f) for f in frames]],
                              video=task == "video")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        yield frames, inputs, out[:, inputs["input_ids"].shape[1]:]


def sample_args(ap: argparse.ArgumentParser, n: int) -> None:
    """The arguments of a probe over held-out samples: model, layout, task, n, answer length, threads."""
    ap.add_argument("--model", default="embedded", help="a model directory, a Hub id, or 'embedded' (default)")
    ap.add_argument("--layout", default=S.DEFAULT_LAYOUT, choices=sorted(S.LAYOUTS), help="synthetic scene layout")
    ap.add_argument("--task", default="detailcaps", choices=S.TASKS)
    ap.add_argument("--n", type=int, default=n, help=f"held-out samples (default {n})")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")


def profile(model, processor, task: str, layout: str, n: int, selected: int, max_new_tokens: int,
            per_head: bool = False) -> list[dict]:
    """Per layer, the figures of ``layer_profile`` averaged over samples; with ``per_head`` each layer's dict also
    holds ``"heads"``: the same figures for each KV head on its own (its G query heads)."""
    geo = geometry(model)
    group = geo.n_q_heads // geo.n_kv_heads
    image_ids = {model.config.image_token_id, model.config.video_token_id}
    rows: list[list[dict]] = []
    for frames, inputs, answer in held_out_answers(model, processor, task, layout, n, max_new_tokens):
        n_prompt = inputs["input_ids"].shape[1]
        with torch.no_grad():
            attn = model(**with_answer(inputs, answer), output_attentions=True).attentions
        image = torch.tensor([int(t) in image_ids for t in inputs["input_ids"][0]])
        flat = at_cell = None
        if task != "video" and "image_grid_thw" in inputs:
            flat = torch.zeros_like(image)
            flat[image] = flat_tokens(frames[0], inputs["image_grid_thw"][0])
        if task == "detailcaps" and S.get_layout(layout).every_cell:
            words = processor.tokenizer.convert_ids_to_tokens(answer[0].tolist())
            at_cell = cell_masks(words, S.get_layout(layout), image, inputs["image_grid_thw"][0])
        per_layer = []
        for a in attn:
            r = layer_profile(a[0], n_prompt, image, geo.n_kv_heads, selected, flat, at_cell)
            if per_head:
                r["heads"] = [layer_profile(a[0, h * group:(h + 1) * group], n_prompt, image, 1, selected, flat,
                                            at_cell) for h in range(geo.n_kv_heads)]
            per_layer.append(r)
        rows.append(per_layer)

    def mean(dicts: list[dict]) -> dict:
        return {k: float(np.nanmean([d[k] for d in dicts])) for k in dicts[0] if k != "heads"}

    out = []
    for layer in range(len(rows[0])):
        r = mean([s[layer] for s in rows])
        if per_head:
            r["heads"] = [mean([s[layer]["heads"][h] for s in rows]) for h in range(geo.n_kv_heads)]
        out.append(r)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sample_args(ap, n=4)
    ap.add_argument("--selected", type=int, default=32, help="the selection budget S for the top-S share (32)")
    ap.add_argument("--per-head", action="store_true", help="also a row per KV head under each layer")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, processor = load(args.model)
    model.set_attn_implementation("eager")  # the attention weights are materialised only by the eager path
    geo = geometry(model)
    layers = profile(model, processor, args.task, args.layout, args.n, args.selected, args.max_new_tokens,
                     args.per_head)
    print(f"{args.model} | {args.task}, layout {args.layout}, {args.n} held-out samples | "
          f"load average {os.getloadavg()[0]:.2f}, {args.threads} thread(s)")
    top = f"top-{args.selected}"
    lay = S.get_layout(args.layout)
    cells = args.task == "detailcaps" and lay.every_cell
    chance = f"cell (chance {1 / (lay.rows * lay.cols):.3f})" if cells else "cell"
    print(f"{'layer':>5}  {'kind':<6} {'prefix':>7} {'image':>7} {'on-img':>7} {'flat':>7} {top:>7} {'static':>7} "
          f"{'entries':>8} {'dwell':>7}  {chance}")
    for i, r in enumerate(layers):
        kind = "local" if geo.sliding_windows[i] is not None else "global"
        for name, k, row in [(f"{i}", kind, r)] + [(f"kv{h}", "", x) for h, x in enumerate(r.get("heads", []))]:
            print(f"{name:>5}  {k:<6} {row['prefix']:7.3f} {row['image']:7.3f} {row['on_image']:7.3f} "
                  f"{row['flat']:7.3f} {row['top']:7.3f} {row['static']:7.3f} {row['entries']:8.1f} "
                  f"{row['dwell']:7.3f}  {row['cell']:7.3f}")
    treated = [r for i, r in enumerate(layers) if geo.sliding_windows[i] is None]
    print(f"re-selected layers: mean top-{args.selected} share {np.mean([r['top'] for r in treated]):.3f}, "
          f"dwell {np.mean([r['dwell'] for r in treated]):.3f}")


if __name__ == "__main__":
    main()
