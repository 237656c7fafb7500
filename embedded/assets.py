"""The embedded model's assets: its word-level tokenizer, its Qwen2-VL processor and chat template, the model
itself (one of ``MODEL_SIZES``), and the directory a trained model is saved as.

Everything is built locally, so the saved directory loads offline with ``from_pretrained`` and runs through the
same code paths as Qwen2-VL-7B.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from pipeline.data import synthetic as S
from pipeline.tasks import TASKS

SPECIAL_TOKENS = {
    "pad": "<|endoftext|>",
    "im_start": "<|im_start|>",
    "im_end": "<|im_end|>",
    "vision_start": "<|vision_start|>",
    "vision_end": "<|vision_end|>",
    "image": "<|image_pad|>",
    "video": "<|video_pad|>",
    "unk": "<unk>",
}

# Qwen2-VL's default system prompt: like the real template, a conversation without a system message gets it.
# Real VLMs park much of their attention on such fixed leading text (attention sinks), which the paper's
# drift figures reflect; the embedded model sees the same kind of prompt.
SYSTEM_PROMPT = "You are a helpful assistant ."
SYSTEM_PROMPT_ROLE = "system"  # the word after the first <|im_start|>: position 1 of every prompt, and only there

# A minimal Qwen2-VL-style chat template over the word-level vocabulary. Message content may be a
# string or a list of {"type": "image"|"video"|"text"} parts, as with the real Qwen2-VL processor.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system " + SYSTEM_PROMPT + " <|im_end|> {% endif %}"
    "<|im_start|>{{ message['role'] }} "
    "{% if message['content'] is string %}{{ message['content'] }} "
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|> "
    "{% elif part['type'] == 'video' or 'video' in part %}<|vision_start|><|video_pad|><|vision_end|> "
    "{% elif part['type'] == 'text' %}{{ part['text'] }} {% endif %}"
    "{% endfor %}{% endif %}<|im_end|> "
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)

# text hidden / layers / heads / kv heads / mlp ; vision dim / depth / heads; a sliding-window first layer; the
# M-RoPE sections and rotary base.
MODEL_SIZES = {
    # The shipped model. Its first layer is local (a sliding window of 32 tokens, as in Qwen2's
    # `use_sliding_window` configs): a global first layer learns to average the whole image, which real 28-layer
    # VLMs confine to their first one or two layers. Qwen2-VL hands out the rotary frequencies in three blocks
    # (t, h, w), so with 16 frequency pairs the image's rows and columns would get only the slow ones and a query
    # could not tell one 4-token cell from its neighbour; the sections cycle t, h, w (Qwen2-VL applies section k to
    # position component k % 3, the interleaving Qwen3-VL adopted), giving rows 1.0, 0.32, 0.1 and columns 0.56,
    # 0.18, 0.056 rad per token at theta 1e4, and the 10 slowest pairs (0.032 down to 1.8e-4 rad per token) to time,
    # as a pretrained VLM's rotary has them, so a key can keep its logit across a 700-token sample (a sink).
    "mini_2d_slow": dict(hidden=128, layers=4, heads=4, kv=2, mlp=512, vdim=64, vdepth=2, vheads=4,
                         local_layers=1, local_window=32, mrope=[0, 1, 1] * 3 + [10, 0, 0], rope_theta=10000.0),
    # for tests and smoke runs: seconds per step
    "tiny": dict(hidden=64, layers=2, heads=2, kv=1, mlp=128, vdim=32, vdepth=1, vheads=2),
}


def build_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = S.vocabulary() + ["user", "assistant", SYSTEM_PROMPT_ROLE] + SYSTEM_PROMPT.split()
    specials = list(SPECIAL_TOKENS.values())
    vocab = {tok: i for i, tok in enumerate(specials)}
    for w in words:
        vocab.setdefault(w, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS["unk"]))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token=SPECIAL_TOKENS["unk"],
        pad_token=SPECIAL_TOKENS["pad"],
        eos_token=SPECIAL_TOKENS["im_end"],
        additional_special_tokens=[SPECIAL_TOKENS[k] for k in ("im_start", "vision_start", "vision_end")],
        extra_special_tokens={
            "image_token": SPECIAL_TOKENS["image"],
            "video_token": SPECIAL_TOKENS["video"],
            "vision_start_token": SPECIAL_TOKENS["vision_start"],
            "vision_end_token": SPECIAL_TOKENS["vision_end"],
        },
        padding_side="left",
        model_max_length=4096,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_processor(tokenizer):
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    video_processor = Qwen2VLVideoProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 768, cap_pixels_per_frame=True)
    return Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def _config(tokenizer, p: dict):
    """The ``Qwen2VLConfig`` of a size ``p`` (an entry of ``MODEL_SIZES``) over ``tokenizer``'s vocabulary."""
    from transformers import Qwen2VLConfig

    head_dim = p["hidden"] // p["heads"]
    half = head_dim // 2
    t = half // 4
    mrope = p.get("mrope", [t, (half - t) // 2, half - t - (half - t) // 2])
    if sum(mrope) != half or len(mrope) % 3:
        raise ValueError(f"mrope sections {mrope} must sum to head_dim/2 = {half}, in (t, h, w) triples")
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in SPECIAL_TOKENS.items()}
    n_local = p.get("local_layers", 0)
    local = dict(use_sliding_window=True, sliding_window=p["local_window"], max_window_layers=p["layers"],
                 layer_types=["sliding_attention"] * n_local + ["full_attention"] * (p["layers"] - n_local),
                 ) if n_local else {}
    special = dict(bos_token_id=ids["im_start"], eos_token_id=ids["im_end"], pad_token_id=ids["pad"],
                   tie_word_embeddings=True)
    return Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=p["hidden"], intermediate_size=p["mlp"],
            num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_key_value_heads=p["kv"],
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": p.get("rope_theta", 10000.0),
                             "mrope_section": mrope},
            **special, **local,
        ),
        vision_config=dict(
            depth=p["vdepth"], embed_dim=p["vdim"], hidden_size=p["hidden"], num_heads=p["vheads"], mlp_ratio=4,
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
        ),
        image_token_id=ids["image"], video_token_id=ids["video"], vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"], **special,
    )


def build_model(tokenizer, size: str, seed: int):
    """A freshly initialised model of ``size`` (``MODEL_SIZES``), weights drawn after ``torch.manual_seed(seed)``."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    if size not in MODEL_SIZES:
        raise ValueError(f"size {size!r}: choose one of {', '.join(MODEL_SIZES)}")
    config = _config(tokenizer, MODEL_SIZES[size])
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    gen = model.generation_config
    gen.eos_token_id = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS["im_end"])
    gen.pad_token_id = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS["pad"])
    gen.bos_token_id = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS["im_start"])
    gen.do_sample = False
    return model


def messages_for(task: str) -> list[dict]:
    kind = "video" if task == "video" else "image"
    return [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": TASKS[task].prompt}]}]


def processor_inputs(processor, task: str, frames: list[np.ndarray], return_tensors="pt"):
    """What inference feeds the model for one synthetic sample (the reference the trainer's batches must match)."""
    from PIL import Image

    text = processor.apply_chat_template(messages_for(task), add_generation_prompt=True, tokenize=False)
    pil = [Image.fromarray(f) for f in frames]
    if task == "video":
        return processor(text=[text], videos=[pil], return_tensors=return_tensors, return_mm_token_type_ids=True)
    return processor(text=[text], images=pil, return_tensors=return_tensors, return_mm_token_type_ids=True)


def save_assets(model, processor, out: Path, recipe: dict | None = None) -> None:
    """Save the model (fp32 safetensors), tokenizer and processor, and the ``recipe`` that trained it
    (``recipe.json``), into ``out`` atomically."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    processor.save_pretrained(tmp)
    if recipe is not None:
        (tmp / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
