"""Tiny random-weight models of the three supported families, built from configs (no downloads).

Each factory returns ``(model, processor)`` in eval mode on CPU, fp32: 3 text layers, 4 query heads over 2 KV
heads, a 1-2 layer vision tower. They are small enough that a 20-token decode of every method on all three
families runs in seconds on 2 cores.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = [f"w{i}" for i in range(96)]
QWEN_SPECIAL = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}{IMAGE}{% elif c['type'] == 'video' %}{VIDEO}"
    "{% else %}{{ c['text'] }} {% endif %}{% endfor %}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def chat_template(image: str, video: str = "") -> str:
    """The tests' chat template with the family's image (and video) placeholder text."""
    return CHAT_TEMPLATE.replace("{IMAGE}", image).replace("{VIDEO}", video)


QWEN_TEMPLATE = chat_template("<|vision_start|> <|image_pad|> <|vision_end|> ",
                              "<|vision_start|> <|video_pad|> <|vision_end|> ")


def _tokenizer(extra: list[str], special: dict[str, str]) -> PreTrainedTokenizerFast:
    vocab_list = ["<pad>", "<eos>", "<bos>", "<unk>", "<|im_start|>", "<|im_end|>", *extra, *WORDS,
                  "user", "assistant", "system"]
    vocab = {w: i for i, w in enumerate(vocab_list)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>",
        extra_special_tokens=special,
    )
    fast.padding_side = "left"
    return fast


def random_image(seed: int, size: int = 112) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))


def random_prompt(seed: int, n_words: int) -> str:
    rng = np.random.default_rng(seed + 1000)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n_words))


def _ids(tok) -> dict:
    return dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def _qwen_tokenizer():
    return _tokenizer(QWEN_SPECIAL, {
        "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
        "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>",
    })


@functools.cache
def qwen2_vl(seed: int = 0):
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    tok = _qwen_tokenizer()
    cfg = Qwen2VLConfig(
        text_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=4096, **_ids(tok),
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [6, 5, 5]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=128, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    ip = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=448 * 448)
    proc = Qwen2VLProcessor(image_processor=ip, tokenizer=tok, video_processor=Qwen2VLVideoProcessor(),
                            chat_template=QWEN_TEMPLATE)
    return model, proc


@functools.cache
def qwen3_vl(seed: int = 0):
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    tok = _qwen_tokenizer()
    cfg = Qwen3VLConfig(
        text_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=len(tok), max_position_embeddings=4096,
                         **_ids(tok),
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [6, 5, 5],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=128,
                           deepstack_visual_indexes=[0], num_position_embeddings=64),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(cfg).eval()
    ip = Qwen2VLImageProcessor(min_pixels=64 * 64, max_pixels=512 * 512, patch_size=16,
                               image_mean=[0.5] * 3, image_std=[0.5] * 3)
    proc = Qwen3VLProcessor(image_processor=ip, tokenizer=tok, video_processor=Qwen3VLVideoProcessor(),
                            chat_template=QWEN_TEMPLATE)
    return model, proc


@functools.cache
def llava_next(seed: int = 0):
    from transformers import (
        CLIPVisionConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
        MistralConfig,
    )

    tok = _tokenizer(["<image>"], {"image_token": "<image>"})
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=56, patch_size=14)
    text = MistralConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=4096,
                         sliding_window=None, head_dim=32, **_ids(tok))
    cfg = LlavaNextConfig(vision_config=vision, text_config=text, image_grid_pinpoints=[[56, 56], [56, 112]],
                          vision_feature_layer=-1, vision_feature_select_strategy="default",
                          image_token_index=tok.convert_tokens_to_ids("<image>"),
                          pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(cfg).eval()
    ip = LlavaNextImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56},
                                 image_grid_pinpoints=[[56, 56], [56, 112]])
    proc = LlavaNextProcessor(image_processor=ip, tokenizer=tok, patch_size=14, num_additional_image_tokens=1,
                              vision_feature_select_strategy="default",
                              chat_template=chat_template("<image> "))
    return model, proc


# --- the families added after the paper's three: hidden 64, 2 text layers, tiny vision towers ---

def _small_text(tok, **kw) -> dict:
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=len(tok), max_position_embeddings=4096,
                initializer_range=0.3,  # larger than the default 0.02: varied greedy tokens, so a wrong position shows
                **_ids(tok), **kw)


def _qwen_ids(tok) -> dict:
    return dict(image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
                video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
                vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
                vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"), **_ids(tok))


MROPE = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}  # sums to head_dim / 2


@functools.cache
def qwen2_5_vl(seed: int = 0):
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    tok = _qwen_tokenizer()
    cfg = Qwen2_5_VLConfig(
        text_config=_small_text(tok, rope_parameters=MROPE),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                           out_hidden_size=64),
        **_qwen_ids(tok))
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    proc = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112),
                               tokenizer=tok, video_processor=Qwen2VLVideoProcessor(), chat_template=QWEN_TEMPLATE)
    return model, proc


@functools.cache
def qwen3_vl_moe(seed: int = 0):
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    tok = _qwen_tokenizer()
    cfg = Qwen3VLMoeConfig(
        text_config=_small_text(tok, rope_parameters={**MROPE, "mrope_interleaved": True}, num_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                           deepstack_visual_indexes=[0], num_position_embeddings=64),
        **_qwen_ids(tok))
    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(cfg).eval()
    ip = Qwen2VLImageProcessor(min_pixels=64 * 64, max_pixels=128 * 128, patch_size=16,
                               image_mean=[0.5] * 3, image_std=[0.5] * 3)
    proc = Qwen3VLProcessor(image_processor=ip, tokenizer=tok, video_processor=Qwen3VLVideoProcessor(),
                            chat_template=QWEN_TEMPLATE)
    return model, proc


def _clip(image_size: int):
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                            image_size=image_size, patch_size=14)


@functools.cache
def llava_onevision(seed: int = 0):
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
        Qwen2Config,
        SiglipVisionConfig,
    )

    tok = _tokenizer(["<image>", "<video>"], {"image_token": "<image>", "video_token": "<video>"})
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    cfg = LlavaOnevisionConfig(vision_config=vision, text_config=Qwen2Config(**_small_text(tok)),
                               image_grid_pinpoints=[[28, 28], [28, 56]], vision_feature_layer=-1,
                               vision_feature_select_strategy="full",
                               image_token_index=tok.convert_tokens_to_ids("<image>"),
                               video_token_index=tok.convert_tokens_to_ids("<video>"), **_ids(tok))
    torch.manual_seed(seed)
    model = LlavaOnevisionForConditionalGeneration(cfg).eval()
    ip = LlavaOnevisionImageProcessor(size={"height": 28, "width": 28}, image_grid_pinpoints=[[28, 28], [28, 56]])
    vp = LlavaOnevisionVideoProcessor(size={"height": 28, "width": 28})
    proc = LlavaOnevisionProcessor(image_processor=ip, tokenizer=tok, video_processor=vp,
                                   num_image_tokens=4, vision_feature_select_strategy="full",
                                   chat_template=chat_template("<image> ", "<video> "))
    return model, proc


@functools.cache
def internvl(seed: int = 0):
    from transformers import (
        GotOcr2ImageProcessor,
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLProcessor,
        InternVLVideoProcessor,
        Qwen2Config,
    )

    tok = _tokenizer(["<img>", "</img>", "<IMG_CONTEXT>", "<video>"], {
        "start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>"})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=[56, 56], patch_size=[14, 14])
    cfg = InternVLConfig(vision_config=vision, text_config=Qwen2Config(**_small_text(tok)).to_dict(),
                         image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"), image_seq_length=4,
                         downsample_ratio=0.5, **_ids(tok))
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(cfg).eval()
    ip = GotOcr2ImageProcessor(size={"height": 56, "width": 56}, crop_to_patches=False)
    vp = InternVLVideoProcessor(size={"height": 56, "width": 56})
    proc = InternVLProcessor(image_processor=ip, tokenizer=tok, video_processor=vp,
                             image_seq_length=4, chat_template=chat_template("<IMG_CONTEXT> ", "<video> "))
    return model, proc


GEMMA_SLIDING_WINDOW = 12  # shorter than every test prompt, so the window really drops keys during decode


@functools.cache
def gemma3(seed: int = 0):
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
        SiglipVisionConfig,
    )

    tok = _tokenizer(["<start_of_image>", "<end_of_image>", "<image_soft_token>"], {
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=56, patch_size=14)
    text = _small_text(tok, sliding_window=GEMMA_SLIDING_WINDOW, query_pre_attn_scalar=16, tie_word_embeddings=False,
                       layer_types=["sliding_attention", "full_attention"],
                       rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                        "full_attention": {"rope_type": "default", "rope_theta": 1e5}})
    # untied output head: with tied embeddings a random model keeps repeating its input token
    cfg = Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=4, initializer_range=0.3,
                       tie_word_embeddings=False,
                       boi_token_index=tok.convert_tokens_to_ids("<start_of_image>"),
                       eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"),
                       image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"), **_ids(tok))
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    ip = Gemma3ImageProcessor(size={"height": 56, "width": 56})
    proc = Gemma3Processor(image_processor=ip, tokenizer=tok, image_seq_length=4,
                           chat_template=chat_template("<start_of_image> "))
    return model, proc


@functools.cache
def llava(seed: int = 0):
    from transformers import CLIPImageProcessor, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tok = _tokenizer(["<image>"], {"image_token": "<image>"})
    cfg = LlavaConfig(vision_config=_clip(28), text_config=LlamaConfig(**_small_text(tok)), vision_feature_layer=-1,
                      vision_feature_select_strategy="default", image_token_index=tok.convert_tokens_to_ids("<image>"),
                      **_ids(tok))
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).eval()
    ip = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    proc = LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=14, num_additional_image_tokens=1,
                          vision_feature_select_strategy="default",
                          chat_template=chat_template("<image> "))
    return model, proc


FAMILIES = {"qwen2_vl": qwen2_vl, "qwen3_vl": qwen3_vl, "llava_next": llava_next, "qwen2_5_vl": qwen2_5_vl,
            "qwen3_vl_moe": qwen3_vl_moe, "llava_onevision": llava_onevision, "internvl": internvl,
            "gemma3": gemma3, "llava": llava}


def batch_inputs(processor, n_words: list[int], image_size: int = 112, seed: int = 0):
    """A left-padded batch: sample i has ``n_words[i]`` prompt words and one random image."""
    texts, images = [], []
    for i, n in enumerate(n_words):
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": random_prompt(seed + i, n)}]}]
        texts.append(processor.apply_chat_template(msgs, add_generation_prompt=True))
        images.append([random_image(seed + i, image_size)])  # one list per sample (Gemma 3 needs the nesting)
    processor.tokenizer.padding_side = "left"
    return processor(text=texts, images=images, return_tensors="pt", padding=True)
