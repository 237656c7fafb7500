"""What differs between the supported model families: where the text layers are, true positions, loading.

Families (by ``model_type``): Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE use M-RoPE (three position rows,
from the model's own ``get_rope_index``); LLaVA-1.5, LLaVA-NeXT, LLaVA-OneVision, InternVL and Gemma 3 use 1-D
positions (``cumsum`` of the attention mask). A layer with a sliding window (Gemma 3's local layers) is
reported in :class:`Geometry` and is not re-selected where the window is shorter than the decode's context: it
keeps every prefix entry and attends within its own window, as transformers does (docs/models.md). A window that
cannot exclude any entry of the context (``window_over``) is a global layer, re-selected like any other.
Everything else in ``rcr`` is family-agnostic.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Geometry:
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    scaling: float
    # per layer: the attention's sliding window (keys within the last `window` positions), None for a global
    # layer. Windowed layers are not re-selected (docs/models.md).
    sliding_windows: tuple[int | None, ...] = ()

    def reselected(self, context: int) -> tuple[bool, ...]:
        """Per layer: whether a method re-selects this layer's prefix in a decode whose longest attention is over
        ``context`` entries (padded prompt + max_new_tokens - 1): every layer whose window is None there
        (``window_over``)."""
        return tuple(window_over(w, context) is None for w in self.sliding_windows)


def window_over(window: int | None, context: int) -> int | None:
    """A layer's sliding window where no attention is over more than ``context`` entries: None (a global layer)
    where it has none, or where it cannot exclude any entry (window >= context). A config that omits
    ``sliding_window`` can inherit a default one (Mistral's 4096): over a shorter context such a layer is global,
    and is compressed like any other."""
    return None if window is None or window >= context else window


def _text_layers(model):
    lm = getattr(model.model, "language_model", None) or model.model
    return lm.layers


def geometry(model) -> Geometry:
    layers = _text_layers(model)
    attn = layers[0].self_attn
    cfg = model.config.get_text_config()
    if getattr(attn, "attn_logit_softcapping", None) is not None:  # the "rcr" attention has no soft-capping
        raise ValueError(f"model_type={model.config.model_type!r}: attention logit soft-capping "
                         f"({attn.attn_logit_softcapping}) is not supported")
    # the window transformers passes to the attention function (None on global layers): the module's own
    # attribute where it has one (per layer type: Gemma 3, Qwen2), else the config's for every layer (Mistral)
    windows = tuple(layer.self_attn.sliding_window if hasattr(layer.self_attn, "sliding_window")
                    else getattr(cfg, "sliding_window", None) for layer in layers)
    return Geometry(n_layers=len(layers), n_q_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads,
                    head_dim=attn.head_dim, scaling=float(attn.scaling), sliding_windows=windows)


class Adapter:
    """Family interface: positions for the prefill and for tokens generated after it."""

    model_types: tuple[str, ...] = ()

    def prefill_positions(self, model, inputs) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Returns (position_ids for the prefill forward, next_position (B,): the true position of the first
        generated token)."""
        raise NotImplementedError

    def positions(self, start: torch.Tensor, length: int) -> torch.Tensor:
        """True positions of ``length`` consecutive new tokens starting at ``start`` (B,)."""
        raise NotImplementedError


class QwenVLAdapter(Adapter):
    """M-RoPE: vision tokens get (t, h, w) rows, text tokens three equal rows continuing after the image."""

    model_types = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")

    def prefill_positions(self, model, inputs):
        mask = inputs["attention_mask"].bool()
        # Qwen2.5-VL spaces video frames by their time (second_per_grid_ts); the others take no such input
        extra = {"second_per_grid_ts": inputs["second_per_grid_ts"]} if "second_per_grid_ts" in inputs else {}
        pos, _ = model.model.get_rope_index(
            inputs["input_ids"], mm_token_type_ids=inputs.get("mm_token_type_ids"),
            image_grid_thw=inputs.get("image_grid_thw"), video_grid_thw=inputs.get("video_grid_thw"),
            attention_mask=inputs["attention_mask"], **extra)  # (3, B, N)
        nxt = pos.masked_fill(~mask.unsqueeze(0), -1).amax(dim=(0, 2)) + 1  # (B,)
        return pos, nxt

    def positions(self, start, length):
        p = start.view(-1, 1) + torch.arange(length, device=start.device)  # (B, q)
        return p.unsqueeze(0).expand(3, -1, -1)  # text tokens: the three M-RoPE rows are equal


class SequentialAdapter(Adapter):
    """1-D positions: image tokens are ordinary sequence positions (LLaVA family, InternVL, Gemma 3)."""

    model_types = ("llava", "llava_next", "llava_onevision", "internvl", "gemma3")

    def prefill_positions(self, model, inputs):
        mask = inputs["attention_mask"].long()
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        return pos, mask.sum(-1)

    def positions(self, start, length):
        return start.view(-1, 1) + torch.arange(length, device=start.device)


ADAPTERS = (QwenVLAdapter(), SequentialAdapter())
SUPPORTED = tuple(t for a in ADAPTERS for t in a.model_types)


def adapter_for(model) -> Adapter:
    mt = model.config.model_type
    for a in ADAPTERS:
        if mt in a.model_types:
            return a
    raise ValueError(f"model_type={mt!r} is not supported; supported families: {list(SUPPORTED)}")


# --- loading and prompts (real checkpoints by name, or local directories laid out the same way) ---

# transformers 5.x still warns, when a Qwen2-VL/Qwen2.5-VL config turns the sliding window on, that it "is not
# implemented for `sdpa`". It is: the window is in the attention mask (create_sliding_window_causal_mask), which
# every implementation applies (tests/rcr/test_models.py checks it). The notice is dropped while a model is built.
STALE_WINDOW_NOTICE = "Sliding Window Attention is enabled but not implemented for"
_STALE_WINDOW_LOGGERS = ("transformers.models.qwen2_vl.modeling_qwen2_vl",
                         "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")


class _DropNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return STALE_WINDOW_NOTICE not in record.getMessage()


@contextlib.contextmanager
def _without_stale_window_notice():
    loggers, drop = [logging.getLogger(name) for name in _STALE_WINDOW_LOGGERS], _DropNotice()
    for lg in loggers:
        lg.addFilter(drop)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(drop)


def load(name_or_path: str, device: str | torch.device = "cpu", dtype: torch.dtype | str = "auto",
         trust_remote_code: bool = False, local_files_only: bool | None = None):
    """Load (model, processor) for a supported family. ``trust_remote_code`` stays off unless asked for.
    ``"embedded"`` names the small synthetic-scene model shipped inside the package (``rcr/embedded.py``)."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from .embedded import resolve

    name_or_path = resolve(name_or_path)

    kw = dict(trust_remote_code=trust_remote_code)
    if local_files_only is not None:
        kw["local_files_only"] = local_files_only
    cfg = AutoConfig.from_pretrained(name_or_path, **kw)
    if cfg.model_type not in SUPPORTED:
        raise ValueError(f"model={name_or_path!r}: model_type {cfg.model_type!r} is not supported; "
                         f"supported families: {list(SUPPORTED)}")
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    with _without_stale_window_notice():
        model = AutoModelForImageTextToText.from_pretrained(name_or_path, dtype=dtype, **kw).to(device).eval()
    processor = AutoProcessor.from_pretrained(name_or_path, **kw)
    processor.tokenizer.padding_side = "left"  # batched decode needs left padding
    return model, processor


def limit_image_tokens(processor, max_tokens: int) -> int | None:
    """Cap an image's visual tokens at ``max_tokens`` where the processor sizes images dynamically (the Qwen-VL
    families: ``size['longest_edge']`` is the most pixels an image keeps, one visual token per merged patch of
    ``(patch_size * merge_size)^2`` pixels; Qwen2-VL's published ``max_pixels`` is 12,845,056, 16,384 tokens). A
    larger image is downscaled, aspect kept, to at most ``max_tokens * (patch_size * merge_size)^2`` pixels; a
    smaller published cap is kept. Returns the pixel cap in force, or None for a processor whose visual tokens
    per image are fixed by its tiling (LLaVA-NeXT's pinpoints, Gemma 3, InternVL, ...): nothing to cap."""
    ip = getattr(processor, "image_processor", None)
    size, merge, patch = getattr(ip, "size", None), getattr(ip, "merge_size", None), getattr(ip, "patch_size", None)
    size = dict(size) if isinstance(size, dict) else vars(size) if size is not None else {}  # a dict or a SizeDict
    longest = size.get("longest_edge")
    if not (longest and merge and patch):
        return None
    cap = int(max_tokens) * (int(patch) * int(merge)) ** 2
    if cap < longest:
        ip.size = {"shortest_edge": min(size.get("shortest_edge") or cap, cap), "longest_edge": cap}
    return min(cap, int(longest))


def build_inputs(processor, prompts: list[str], images: list[list], video: bool = False):
    """Chat-formatted, left-padded processor inputs. ``images[i]`` is sample i's list of PIL images (the frames
    of a video when ``video``)."""
    texts = []
    for prompt, imgs in zip(prompts, images):
        media = [{"type": "video"}] if video else [{"type": "image"} for _ in imgs]
        msgs = [{"role": "user", "content": [*media, {"type": "text", "text": prompt}]}]
        texts.append(processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    processor.tokenizer.padding_side = "left"
    if not any(images):  # text only
        return processor(text=texts, return_tensors="pt", padding=True)
    if video:
        return processor(text=texts, videos=[list(f) for f in images], return_tensors="pt", padding=True)
    return processor(text=texts, images=[list(f) for f in images], return_tensors="pt", padding=True)


def with_answer(inputs, answer_ids: torch.Tensor) -> dict:
    """``build_inputs``' prompt inputs with ``answer_ids`` (B, A) appended: one teacher-forced forward pass over
    prompt + answer. The answer is text (token type 0) and attended."""
    full = dict(inputs)
    full["input_ids"] = torch.cat([inputs["input_ids"], answer_ids], 1)
    full["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(answer_ids)], 1)
    if "mm_token_type_ids" in inputs:
        full["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(answer_ids)], 1)
    return full
