"""Offline InfiniGen calibration on the target model's own prompts (docs/algorithms.md, "infinigen").

    python -m rcr.calibrate_infinigen --model PATH --out DIR [--images DIR] [--n 8] [--prompt TEXT]

Runs the model's prefill on image + text prompts (synthetic scenes of coloured shapes by default, since no
dataset is assumed; or the images of ``--images``) with the task prompt, records post-RoPE queries and keys of
every layer, and writes per layer and KV head the skew matrix A (Hkv, d, d) and the partial columns (Hkv, c)
to DIR/infinigen.safetensors, plus DIR/calibration.json with the exact command, the model, the prompts and
the library versions (``rcr.skewing`` holds the file format, the writer and the reader). Point
``RCRConfig.infinigen_calibration`` at DIR. Two passes over the prompts: the Gram matrices Q^T Q and K^T K
first (memory does not grow with the prompt count), then sum |QA| and |KA| for the partial columns.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from .attention import rcr_attention_enabled
from .models import adapter_for, build_inputs, geometry
from .skewing import check_orthogonal, n_partial, partial_columns, save_calibration, skew_from_grams, weights_digest

DEFAULT_PROMPT = "Describe this image in detail."  # DetailCaps' prompt (lmms-eval's detailcaps task)


def synthetic_scene(seed: int, size: int = 448):
    """A random scene of coloured rectangles and ellipses on a plain background (PIL image)."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (size, size), tuple(int(c) for c in rng.integers(0, 256, 3)))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 9))):
        x0, y0 = rng.integers(0, size - size // 8, 2)
        w, h = rng.integers(size // 16, size // 3, 2)
        box = [int(x0), int(y0), int(min(size - 1, x0 + w)), int(min(size - 1, y0 + h))]
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.rectangle if rng.random() < 0.5 else draw.ellipse)(box, fill=colour)
    return img


class _Recorder:
    """Attention hook for a calibration prefill: plain SDPA, accumulating per layer either the Gram matrices
    (pass 1) or the column sums of |QA| and |KA| (pass 2). Batch 1, no padding.

    The tokens are those a decode scores and speculates with, as in the per-sample calibration
    (``rcr.methods.infinigen``): the queries of the prompt's last ``window`` tokens (text, as decode queries
    are; InfiniGen calibrates on running text) and the keys of the prefix region before them (the entries a
    decode selects among, mostly visual)."""

    def __init__(self, n_kv: int, window: int, skews: list[torch.Tensor] | None = None):
        self.n_kv, self.window, self.skews = n_kv, window, skews
        self.acc: dict[int, list[torch.Tensor]] = {}
        self.tokens = 0

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        layer = module.layer_idx
        _, Hq, N, d = query.shape
        W = min(self.window, N - 1)  # at least one prefix key
        q = query[0, :, N - W:].double().reshape(self.n_kv, Hq // self.n_kv * W, d)  # (Hkv, G*W, d): the group's
        k = key[0, :, : N - W].double()  # (Hkv, N - W, d): the prefix region
        if self.skews is None:
            parts = [q.transpose(1, 2) @ q, k.transpose(1, 2) @ k]
        else:
            a = self.skews[layer].double().to(q.device)
            parts = [(q @ a).abs().sum(1), (k @ a).abs().sum(1)]
        if layer in self.acc:
            self.acc[layer] = [x + y for x, y in zip(self.acc[layer], parts)]
        else:
            self.acc[layer] = parts
        if layer == 0:
            self.tokens += N  # prompt tokens run (W queries and N - W keys of each recorded)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


Progress = Callable[[str], None]  # told after each prefill: "pass 1 of 2 (Gram matrices): prompt 3 of 8 (2353 tokens)"


@torch.no_grad()
def _run(model, inputs_list, recorder, what: str, progress: Progress | None) -> None:
    adapter = adapter_for(model)
    with rcr_attention_enabled(model):
        for i, inputs in enumerate(inputs_list):
            inputs = inputs.to(model.device)
            pos, _ = adapter.prefill_positions(model, inputs)
            model(**inputs, position_ids=pos, use_cache=False, rcr_hook=recorder, logits_to_keep=1)
            if progress is not None:
                progress(f"{what}: prompt {i + 1} of {len(inputs_list)} ({inputs['input_ids'].shape[1]} tokens)")


@torch.no_grad()
def calibrate(model, inputs_list: list, partial_ratio: float = 0.25, window: int = 32,
              progress: Progress | None = None) -> tuple[list, list, dict]:
    """(skews[l] (Hkv, d, d), cols[l] (Hkv, c), stats) from prefills of ``inputs_list`` (processor outputs of
    batch 1): the queries of each prompt's last ``window`` tokens (``RCRConfig.window``) and the keys before them.
    Two prefills per prompt; ``progress`` is told after each (a real-size model on a CPU takes minutes each)."""
    geo = geometry(model)
    rec = _Recorder(geo.n_kv_heads, window)
    _run(model, inputs_list, rec, "pass 1 of 2 (Gram matrices)", progress)
    skews = [skew_from_grams(*rec.acc[layer]).cpu() for layer in range(geo.n_layers)]
    for layer, a in enumerate(skews):
        check_orthogonal(a, f"skew matrix of layer {layer}")
    rec2 = _Recorder(geo.n_kv_heads, window, skews)
    _run(model, inputs_list, rec2, "pass 2 of 2 (partial columns)", progress)
    c = n_partial(partial_ratio, geo.head_dim)
    cols = [partial_columns(*rec2.acc[layer], c).cpu() for layer in range(geo.n_layers)]
    stats = {"n_prompts": len(inputs_list), "n_tokens": rec.tokens, "query_window": window, "partial_columns": c,
             "n_layers": geo.n_layers, "n_kv_heads": geo.n_kv_heads, "head_dim": geo.head_dim}
    return skews, cols, stats


def calibrate_to_dir(model, inputs_list: list, out_dir: str, partial_ratio: float = 0.25, window: int = 32,
                     meta: dict | None = None, progress: Progress | None = None) -> dict:
    """:func:`calibrate`, then write ``out_dir`` (``rcr.skewing.save_calibration``) with ``calibration.json`` =
    ``meta`` (its ``description`` is what decodes report) plus the partial ratio, the dtype, the library versions,
    the time, and, for a model loaded from a local directory, the digest of its weights (``model_sha256``: the
    directory's calibration is used only for those weights). Returns that meta."""
    import transformers

    skews, cols, stats = calibrate(model, inputs_list, partial_ratio, window, progress)
    src = getattr(model, "name_or_path", None)
    meta = {**(meta or {}), "partial_ratio": partial_ratio, "dtype": str(next(model.parameters()).dtype),
            "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "rcr_commit": _git_commit(), "torch": torch.__version__, "transformers": transformers.__version__,
            **({"model_sha256": weights_digest(src)} if src and os.path.isdir(src) else {}), **stats}
    save_calibration(out_dir, skews, cols, meta)
    return meta


def _git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=False).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(prog="python -m rcr.calibrate_infinigen", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model directory or hub id (a supported VLM family)")
    ap.add_argument("--out", required=True, help="output directory (give this to RCRConfig.infinigen_calibration)")
    ap.add_argument("--images", help="directory of images to calibrate on (default: synthetic scenes)")
    ap.add_argument("--n", type=int, default=8, help="number of prompts (default 8)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT,
                    help=f"text prompt after the image (default: {DEFAULT_PROMPT!r})")
    ap.add_argument("--image-size", type=int, default=448, help="synthetic scene size in pixels (default 448)")
    ap.add_argument("--partial-ratio", type=float, default=0.25,
                    help="partial columns as a fraction of the head dim (default 0.25: Np/4 key equivalents)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error("--n must be >= 1")
    if not 0 < args.partial_ratio <= 1:
        ap.error("--partial-ratio must be in (0, 1]")

    from PIL import Image

    from .models import load

    model, processor = load(args.model, device=args.device, dtype=args.dtype)
    if args.images:
        files = sorted(f for f in os.listdir(args.images)
                       if f.lower().endswith((".png", ".jpg", ".jpeg", ".webp", ".bmp")))[: args.n]
        if not files:
            ap.error(f"--images {args.images}: no image files")
        images = [Image.open(os.path.join(args.images, f)).convert("RGB") for f in files]
        source = {"images": os.path.abspath(args.images), "files": files}
        description = f"{len(files)} images of {os.path.basename(os.path.abspath(args.images))}"
    else:
        images = [synthetic_scene(args.seed + i, args.image_size) for i in range(args.n)]
        source = {"synthetic_scenes": {"n": args.n, "seed": args.seed, "size": args.image_size}}
        description = f"{args.n} synthetic scenes of rcr.calibrate_infinigen (seed {args.seed}, {args.image_size} px)"
    inputs_list = [build_inputs(processor, [args.prompt], [[img]]) for img in images]
    t0 = time.perf_counter()

    def progress(line: str) -> None:
        print(f"[calibrate] {line}, {time.perf_counter() - t0:.0f}s elapsed", flush=True)

    stats = calibrate_to_dir(model, inputs_list, args.out, args.partial_ratio, meta={
        "command": "python -m rcr.calibrate_infinigen " + shlex.join(argv), "cwd": os.getcwd(), "model": args.model,
        "prompt": args.prompt, "source": source, "description": f"offline: {description}"}, progress=progress)
    print(f"wrote {os.path.join(os.path.abspath(args.out), 'infinigen.safetensors')}: {stats['n_layers']} layers x "
          f"{stats['n_kv_heads']} KV heads, skew {stats['head_dim']}x{stats['head_dim']}, "
          f"{stats['partial_columns']} partial columns, {stats['n_tokens']} tokens from {stats['n_prompts']} prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
