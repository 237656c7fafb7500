"""Local model directories at the published models' dimensions, laid out as the Hugging Face Hub lays them out, and a
local DetailCaps-shaped copy at DetailCaps' resolutions: the inputs of ``benchmarks/real_size.py``.

Each directory holds what ``rcr.models.load`` and ``AutoProcessor`` read from a Hub snapshot:

- ``config.json``: the published model's configuration, as published (its keys, its era's format), except the LLaVA
  decoder depth when cut (``num_hidden_layers``);
- random bf16 weights in sharded safetensors with ``model.safetensors.index.json``, under the published checkpoint's
  parameter names (transformers renames them on load, as it does for the real checkpoint);
- the processor's published ``preprocessor_config.json`` (and the video processor's, for Qwen3-VL);
- a tokenizer carrying the family's special tokens at their published ids and a chat template that emits them.
  The tokenizer's ordinary vocabulary is filler words (``t123``), one per id: any id a random model generates
  decodes, and a prompt's words tokenize one token per word, about as many tokens as the real BPE gives.

Published sources (the numbers below come from them):

- Qwen2-VL-2B-Instruct: ``config.json``, ``preprocessor_config.json``, ``chat_template.json`` and
  ``tokenizer_config.json`` of huggingface.co/Qwen/Qwen2-VL-2B-Instruct. The base Qwen2-VL-2B has the same
  architecture: its ``model.safetensors.index.json`` (vendored in github.com/whalefal1/ASR-LLM-TTS-Pipeline-with-live2d,
  ``models/qwen_vl/qwen/Qwen2-VL-2B/``) names the parameters and gives ``total_size`` 4,417,971,200 bytes, which
  the directory written here reproduces.
- Qwen3-VL-2B-Instruct (the smallest published Qwen3-VL): ``config.json``, ``preprocessor_config.json`` and
  ``video_preprocessor_config.json`` of huggingface.co/Qwen/Qwen3-VL-2B-Instruct (its text model is Qwen3-1.7B's:
  28 layers, hidden 2048, 16 query / 8 KV heads of 128, MLP 6144; the vision tower is Qwen3-VL-4B's, whose full
  config has the same ``vision_config`` apart from ``out_hidden_size``).
- LLaVA-NeXT-Mistral-7B: ``config.json``, ``preprocessor_config.json`` and ``processor_config.json`` of
  huggingface.co/llava-hf/llava-v1.6-mistral-7b-hf, made by transformers'
  ``models/llava_next/convert_llava_next_weights_to_hf.py`` from liuhaotian/llava-v1.6-mistral-7b: the text config
  of mistralai/Mistral-7B-Instruct-v0.2 (32 layers, hidden 4096, 32 query / 8 KV heads of 128, MLP 14336,
  ``sliding_window`` null, rope theta 1e6), vocabulary 32000 + ``<image>`` (32000) + ``<pad>`` (32001) padded to
  64 (32064), the CLIP ViT-L/14-336 tower (24 layers, hidden 1024) of openai/clip-vit-large-patch14-336 and its
  image processor's pinpoints.
"""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path

import numpy as np
import torch

IMAGE_MEAN_CLIP = [0.48145466, 0.4578275, 0.40821073]  # OpenAI CLIP's normalisation (Qwen2-VL and LLaVA use it)
IMAGE_STD_CLIP = [0.26862954, 0.26130258, 0.27577711]

# ------------------------------------------------------------------------------------------- Qwen2-VL-2B-Instruct
QWEN2_VL_2B = {
    "architectures": ["Qwen2VLForConditionalGeneration"], "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656,
    "hidden_act": "silu", "hidden_size": 1536, "initializer_range": 0.02, "intermediate_size": 8960,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2_vl",
    "num_attention_heads": 12, "num_hidden_layers": 28, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.41.2", "use_cache": True, "use_sliding_window": False,
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                      "hidden_size": 1536, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
                      "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 151936,
}
QWEN2_VL_PREPROCESSOR = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": IMAGE_MEAN_CLIP, "image_std": IMAGE_STD_CLIP,
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
}
QWEN2_VL_TEMPLATE = (  # chat_template.json of Qwen2-VL-*-Instruct
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)
# added tokens from id 151643 on, in order (tokenizer_config.json's added_tokens_decoder)
QWEN2_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
               "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
               "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]

# ------------------------------------------------------------------------------------------- Qwen3-VL-2B-Instruct
QWEN3_VL_2B = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "image_token_id": 151655, "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "dtype": "bfloat16",
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text", "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000, "tie_word_embeddings": True, "use_cache": True, "vocab_size": 151936},
    "tie_word_embeddings": True, "transformers_version": "4.57.0.dev0", "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1024,
        "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4096, "model_type": "qwen3_vl",
        "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2},
    "vision_end_token_id": 151653, "vision_start_token_id": 151652,
}
QWEN3_VL_PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
}
QWEN3_VL_VIDEO_PREPROCESSOR = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "video_processor_type": "Qwen3VLVideoProcessor",
}
# the image/text part of Qwen3-VL-*-Instruct's chat template (no default system prompt; tools and thinking left out)
QWEN3_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' %}"
    "<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN3_ADDED = QWEN2_ADDED + ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                             "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
                             "<think>", "</think>"]

# ------------------------------------------------------------------------------------------- LLaVA-NeXT-Mistral-7B
PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
LLAVA_NEXT_MISTRAL_7B = {
    "architectures": ["LlavaNextForConditionalGeneration"], "ignore_index": -100,
    "image_grid_pinpoints": PINPOINTS, "image_token_index": 32000, "model_type": "llava_next", "pad_token_id": 32001,
    "projector_hidden_act": "gelu",
    "text_config": {
        "_name_or_path": "mistralai/Mistral-7B-Instruct-v0.2", "architectures": ["MistralForCausalLM"],
        "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0, "sliding_window": None, "torch_dtype": "bfloat16", "vocab_size": 32064},
    "torch_dtype": "float16", "use_image_newline_parameter": True,
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
}
LLAVA_NEXT_PREPROCESSOR = {
    "aspect_ratio_setting": "anyres", "crop_size": {"height": 336, "width": 336}, "do_center_crop": True,
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_grid_pinpoints": PINPOINTS, "image_mean": IMAGE_MEAN_CLIP, "image_std": IMAGE_STD_CLIP,
    "image_processor_type": "LlavaNextImageProcessor", "processor_class": "LlavaNextProcessor", "resample": 3,
    "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 336},
}
LLAVA_NEXT_PROCESSOR = {"image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": 14,
                        "processor_class": "LlavaNextProcessor", "vision_feature_select_strategy": "default"}
LLAVA_NEXT_TEMPLATE = (  # llava-hf's template for the Mistral checkpoints: [INST] <image>\n{text} [/INST]
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ '<<SYS>>\n' + message['content'][0]['text'] "
    "+ '\n<</SYS>>\n\n' }}{% elif message['role'] == 'user' %}{{ '[INST] ' }}{% for content in message['content'] | "
    "selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}{% for content in message['content'] | "
    "selectattr('type', 'equalto', 'text') %}{{ content['text'] }}{% endfor %}{{ ' [/INST]' }}{% elif "
    "message['role'] == 'assistant' %}{{ ' ' + message['content'][0]['text'] + '</s> ' }}{% endif %}{% endfor %}"
)

FAMILIES = ("qwen2_vl", "qwen3_vl", "llava_next")
DIR_NAMES = {"qwen2_vl": "Qwen2-VL-2B-Instruct", "qwen3_vl": "Qwen3-VL-2B-Instruct",
             "llava_next": "llava-v1.6-mistral-7b-hf"}
WORDS = ["system", "You", "are", "a", "helpful", "assistant", "user", "Describe", "this", "image", "in", "detail", ".",
         ",", ":", "!", "?", "the", "of", "and", "[", "]", "[/", "INST"]  # the prompts' words: one token each


# ------------------------------------------------------------------------------------------- tokenizers
def _tokenizer(n_regular: int, specials: list[str], added: list[str], template_bos: str | None, **named):
    """A word-level tokenizer whose ids 0..n_regular-1 are ``specials`` + prompt words + fillers, then ``added`` in
    order (their published ids); ``named``: eos_token, pad_token, ... ."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate([*specials, *WORDS])}
    for i in range(len(vocab), n_regular):
        vocab[f"t{i}"] = i
    unk = specials[0] if specials and specials[0] == "<unk>" else "t0"
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    special = {v for v in named.values() if isinstance(v, str)} | {t for t in added
                                                                    if t.startswith("<|") or t in ("<image>", "<pad>")}
    tok.add_tokens([AddedToken(t, special=t in special, normalized=False) for t in added])
    if template_bos is not None:  # LLaMA/Mistral tokenizers put <s> first
        tok.post_processor = processors.TemplateProcessing(single=f"{template_bos} $A",
                                                           special_tokens=[(template_bos, vocab[template_bos])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **named)
    assert all(fast.convert_tokens_to_ids(t) == n_regular + i for i, t in enumerate(added)), "added ids"
    return fast


def tokenizer_for(family: str):
    if family == "qwen2_vl":
        return _tokenizer(151643, [], QWEN2_ADDED, None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                          extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                                                "vision_start_token": "<|vision_start|>",
                                                "vision_end_token": "<|vision_end|>"})
    if family == "qwen3_vl":
        return _tokenizer(151643, [], QWEN3_ADDED, None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                          extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                                                "vision_start_token": "<|vision_start|>",
                                                "vision_end_token": "<|vision_end|>"})
    # SentencePiece ids 0-2 (<unk>, <s>, </s>), then the conversion's <image> and <pad>
    return _tokenizer(32000, ["<unk>", "<s>", "</s>"], ["<image>", "<pad>"], "<s>", unk_token="<unk>",
                      bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                      extra_special_tokens={"image_token": "<image>"})


# ------------------------------------------------------------------------------------------- configs and names
def published_config(family: str, llava_layers: int | None = None) -> dict:
    cfg = json.loads(json.dumps({"qwen2_vl": QWEN2_VL_2B, "qwen3_vl": QWEN3_VL_2B,
                                 "llava_next": LLAVA_NEXT_MISTRAL_7B}[family]))
    if family == "llava_next" and llava_layers is not None:
        cfg["text_config"]["num_hidden_layers"] = llava_layers  # the decoder cut to fit the machine
    return cfg


def published_name(family: str, name: str) -> str:
    """A parameter's name in the published checkpoint, from its name in transformers 5's module tree (which
    transformers' conversion mapping renames back on load)."""
    if family == "qwen2_vl":  # transformers 4.41 layout: model.layers..., visual...
        return re.sub(r"^model\.visual\.", "visual.", re.sub(r"^model\.language_model\.", "model.", name))
    if family == "llava_next":  # transformers 4.39 layout: language_model.model..., vision_tower..., image_newline
        if name == "lm_head.weight":
            return "language_model.lm_head.weight"
        name = re.sub(r"^model\.language_model\.", "language_model.model.", name)
        name = re.sub(r"^model\.vision_tower\.", "vision_tower.vision_model.", name)  # a CLIPVisionModel's names
        return re.sub(r"^model\.(multi_modal_projector|image_newline)", r"\1", name)
    return name  # Qwen3-VL was published with transformers 4.57's names


def meta_model(config: dict):
    """The model's module tree on the meta device (no memory): its parameters' names, shapes and tying."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(cfg, dtype=torch.bfloat16)


def init_value(name: str, shape: tuple, gen: torch.Generator, device) -> torch.Tensor:
    """Random bf16 values for one parameter: 1-D ``*.weight`` (every norm) ones, biases zeros, the rest N(0, 0.02)
    (the configs' initializer_range)."""
    if len(shape) == 1 and name.endswith(".weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()


def write_weights(out: Path, family: str, config: dict, device="cpu", shard_bytes: int = 2 * 2**30,
                  seed: int = 0) -> int:
    """Random bf16 weights as ``model-0000K-of-0000N.safetensors`` + ``model.safetensors.index.json`` under the
    published names (tied parameters once, as save_pretrained stores them); returns the total bytes."""
    from safetensors.torch import save_file

    model = meta_model(config)  # a tied lm_head is the embedding's parameter: listed once, under the embedding
    params = [(n, tuple(p.shape)) for n, p in model.named_parameters(remove_duplicate=True)]
    total = sum(math.prod(s) * 2 for _, s in params)
    shards, cur, size = [], [], 0  # greedy: a shard closes before it would pass shard_bytes
    for n, s in params:
        b = math.prod(s) * 2
        if cur and size + b > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((n, s))
        size += b
    shards.append(cur)
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {published_name(family, n): init_value(n, s, gen, device) for n, s in shard}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in tensors})
        del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    return total


def write_model_dir(root: Path, family: str, device="cpu", llava_layers: int | None = None,
                    config: dict | None = None) -> Path:
    """One model directory (see the module docstring); kept when already complete with the same config.
    ``config``: another configuration of the family in place of the published one (the tests' tiny ones)."""
    out = root / DIR_NAMES[family]
    config = config or published_config(family, llava_layers)
    done = out / "model.safetensors.index.json"
    if done.is_file() and (out / "config.json").is_file() and json.loads((out / "config.json").read_text()) == config:
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("model*.safetensors*"):
        f.unlink()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok = tokenizer_for(family)
    tok.save_pretrained(str(out))
    if family == "qwen2_vl":
        (out / "preprocessor_config.json").write_text(json.dumps(QWEN2_VL_PREPROCESSOR, indent=2))
        (out / "chat_template.json").write_text(json.dumps({"chat_template": QWEN2_VL_TEMPLATE}, indent=2))
        (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 151643, "pad_token_id": 151643,
                                                                 "eos_token_id": [151645, 151643]}, indent=2))
    elif family == "qwen3_vl":
        (out / "preprocessor_config.json").write_text(json.dumps(QWEN3_VL_PREPROCESSOR, indent=2))
        (out / "video_preprocessor_config.json").write_text(json.dumps(QWEN3_VL_VIDEO_PREPROCESSOR, indent=2))
        (out / "chat_template.json").write_text(json.dumps({"chat_template": QWEN3_VL_TEMPLATE}, indent=2))
        (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 151643, "pad_token_id": 151643,
                                                                 "eos_token_id": [151645, 151643]}, indent=2))
    else:
        (out / "preprocessor_config.json").write_text(json.dumps(LLAVA_NEXT_PREPROCESSOR, indent=2))
        (out / "processor_config.json").write_text(json.dumps(LLAVA_NEXT_PROCESSOR, indent=2))
        (out / "chat_template.json").write_text(json.dumps({"chat_template": LLAVA_NEXT_TEMPLATE}, indent=2))
        (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2,
                                                                 "pad_token_id": 32001}, indent=2))
    write_weights(out, family, config, device)  # last: the index marks the directory complete
    return out


# ------------------------------------------------------------------------------------------- DetailCaps copy
# DetailCaps' images are COCO/SAM-style photographs, mostly 640 x 480 to 1024 x 768; both orientations
SIZES = [(1024, 768), (640, 480), (800, 600), (768, 1024), (640, 427), (1024, 683), (480, 640), (896, 672)]


def scene(w: int, h: int, seed: int) -> bytes:
    """A synthetic scene (random rectangles and ellipses on a gradient with noise) as JPEG bytes."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), np.full_like(x, 128)], -1)
    img = Image.fromarray(np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, w - 40)), int(rng.integers(0, h - 40))
        box = [x0, y0, x0 + int(rng.integers(30, w // 3)), y0 + int(rng.integers(30, h // 3))]
        fill = tuple(int(c) for c in rng.integers(0, 255, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def write_detailcaps(root: Path, sizes=SIZES) -> Path:
    """``DetailCaps-4870.parquet`` in a folder, with the published file's columns: ``image`` (its source name),
    ``binary`` (the encoded image), and the three reference columns; read by ``--dataset <folder>``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = root / "DetailCaps-4870"
    out.mkdir(parents=True, exist_ok=True)
    n = len(sizes)
    table = pa.table({
        "image": [f"synthetic/{i:012d}.jpg" for i in range(n)],
        "binary": [scene(w, h, i) for i, (w, h) in enumerate(sizes)],
        **{c: [f"{c} reference {i}: a synthetic scene of {w}x{h}." for i, (w, h) in enumerate(sizes)]
           for c in ("GT_Caption_GPT4O", "GT_Caption_GPT4V", "GT_Caption_Gemini15Pro")},
    })
    pq.write_table(table, out / "DetailCaps-4870.parquet")
    return out
