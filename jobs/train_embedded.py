"""Train the embedded default model: a tiny Qwen2-VL on the synthetic scenes and videos.

Everything is built locally (word-level tokenizer over the grammar, Qwen2-VL processor with a chat
template, a tiny ``Qwen2VLForConditionalGeneration``) and saved in Hugging Face format, so the result
loads offline with ``from_pretrained(<dir>)`` and runs through the same code paths as Qwen2-VL-7B.

    python jobs/train_embedded.py --layout v5 --vision-steps 800 --vision-lr-scale 0.1 --hold-sink \
        --sink-logit 10 --sink-ramp 0.3 0.45 --ground-loss 1 --steps 4500 --polish-steps 1200 --polish-lr 5e-4 \
        --polish-ground-tasks detailcaps textcaps --polish-ground-spread detailcaps --polish-cooldown 0.25 \
        --polish-mix detailcaps=0.45 textcaps=0.3 video=0.25 --seed 6 --threads 2 \
        --out runs/embedded --same-as rcr/embedded_model   # the shipped model (run ADCM), ~92 min; resumes
    python jobs/train_embedded.py                       # run I's recipe on v4, bootstrapped on v1 (no sink)
    python jobs/train_embedded.py --device cuda         # minutes on a GPU
    python jobs/train_embedded.py --minutes 2 --out runs/smoke --run-dir runs/smoke   # smoke run
    python jobs/train_embedded.py --export runs/peek    # a running run's last checkpoint, as a model directory

Training data is a pure function of (--seed, step): batch ``s`` always holds the same samples, so a
run that is interrupted and resumed from its last checkpoint (written every --ckpt-minutes into
--run-dir, atomically) sees exactly the batches it would have seen.

The training batches are built with a numpy re-implementation of the processor's patchification
(``patchify``); tests/integration/test_embedded_model.py checks that it equals the saved processor's output.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pipeline.data import synthetic as S  # noqa: E402

DEFAULT_OUT = REPO / "rcr" / "embedded_model"
DEFAULT_RUN_DIR = REPO / "runs" / "train_embedded"

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

# text hidden / layers / heads / kv heads / mlp ; vision dim / depth / heads
_MINI = dict(hidden=128, layers=4, heads=4, kv=2, mlp=512, vdim=64, vdepth=2, vheads=4)
_MINI_LOCAL = dict(_MINI, local_layers=1, local_window=32)

MODEL_SIZES = {
    "mini": _MINI,
    # mini with a local first layer (sliding window of 32 tokens), as in Qwen2's `use_sliding_window` configs:
    # a global first layer learns to average the whole image (uniform attention over every visual token, in v1
    # and v2 alike), which real 28-layer VLMs confine to their first one or two layers (docs/embedded.md)
    "mini_local": _MINI_LOCAL,
    # mini_local whose spatial M-RoPE can resolve a cell: Qwen2-VL hands out the rotary frequencies in three blocks
    # (t, h, w), so with 16 frequency pairs the image's row and column get only the slow ones (at most 0.1 and 0.006
    # rad per token at theta 1e4): a decoder query cannot tell one 4-token cell from its neighbour by position and
    # reads a blur of cells. The section list below cycles t, h, w three times (Qwen2-VL applies section k to
    # position component k % 3), the interleaving Qwen3-VL adopted for this reason, and theta 100 puts the fastest
    # row and column frequencies at 0.75 and 0.42 rad per token.
    "mini_2d": dict(_MINI_LOCAL, mrope=[1, 2, 2, 1, 2, 2, 2, 2, 2], rope_theta=100.0),
    # mini_2d with the sections one frequency pair each, rows and columns first: row, column, time, row, ... so the
    # fastest pairs (1.0 and 0.75 rad per token) resolve the image; the leading and trailing 0 keep the list in
    # (t, h, w) triples
    "mini_2d_fine": dict(_MINI_LOCAL, mrope=[0] + [1] * 16 + [0], rope_theta=100.0),
    # mini_2d's fast row and column pairs at theta 1e4, and the 10 slowest pairs (0.032 down to 1.8e-4 rad per token)
    # on time, as a pretrained VLM's rotary has them: at theta 100 every pair turns by at least 0.013 rad per token,
    # so no key keeps its logit across a 700-token sample and no token can be a sink (docs/embedded.md, round 5);
    # here rows get 1.0, 0.32, 0.1 and columns 0.56, 0.18, 0.056 rad per token
    "mini_2d_slow": dict(_MINI_LOCAL, mrope=[0, 1, 1] * 3 + [10, 0, 0], rope_theta=10000.0),
    "small": dict(hidden=192, layers=4, heads=6, kv=3, mlp=512, vdim=96, vdepth=2, vheads=4),
    "base": dict(hidden=256, layers=4, heads=8, kv=4, mlp=640, vdim=96, vdepth=2, vheads=4),
    "tiny": dict(hidden=64, layers=2, heads=2, kv=1, mlp=128, vdim=32, vdepth=1, vheads=2),
}


# ------------------------------------------------------------------------------------- build assets
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


def build_model(tokenizer, size: str = "base", seed: int = 0):
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    p = MODEL_SIZES[size]
    head_dim = p["hidden"] // p["heads"]
    half = head_dim // 2
    t = half // 4
    mrope = p.get("mrope", [t, (half - t) // 2, half - t - (half - t) // 2])
    if sum(mrope) != half or len(mrope) % 3:
        raise ValueError(f"size {size!r}: mrope sections {mrope} must sum to head_dim/2 = {half}, in (t, h, w) triples")
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in SPECIAL_TOKENS.items()}
    n_local = p.get("local_layers", 0)
    local = dict(use_sliding_window=True, sliding_window=p["local_window"], max_window_layers=p["layers"],
                 layer_types=["sliding_attention"] * n_local + ["full_attention"] * (p["layers"] - n_local),
                 ) if n_local else {}
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=p["hidden"],
            intermediate_size=p["mlp"],
            num_hidden_layers=p["layers"],
            num_attention_heads=p["heads"],
            num_key_value_heads=p["kv"],
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": p.get("rope_theta", 10000.0),
                             "mrope_section": mrope},
            bos_token_id=ids["im_start"],
            eos_token_id=ids["im_end"],
            pad_token_id=ids["pad"],
            tie_word_embeddings=True,
            **local,
        ),
        vision_config=dict(
            depth=p["vdepth"], embed_dim=p["vdim"], hidden_size=p["hidden"], num_heads=p["vheads"], mlp_ratio=4,
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
        ),
        image_token_id=ids["image"],
        video_token_id=ids["video"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
        bos_token_id=ids["im_start"],
        eos_token_id=ids["im_end"],
        pad_token_id=ids["pad"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = ids["im_end"]
    model.generation_config.pad_token_id = ids["pad"]
    model.generation_config.bos_token_id = ids["im_start"]
    model.generation_config.do_sample = False
    return model


def plant_attention_sink(model, token_id: int, logit: float = 6.0) -> None:
    """Start every text layer with an attention sink on ``token_id`` (``<|im_start|>``, the first token).

    A real VLM's decoder is a pretrained LLM, and pretrained LLMs put most of a head's attention on one or two
    sink tokens when it has nothing to read, a habit learnt over trillions of tokens that a model trained from
    scratch on a few million never forms: its idle heads spread their mass over the image instead. This plants
    the LLM's starting point and leaves the rest to training: one hidden dimension ``s`` of the token's
    embedding is large and every other token's is zero (a "massive activation"); each layer's key reads ``s``
    into the slowest rotary pair (dimension ``d/2 - 1``), and a query bias on the same pair makes a query meet it
    with a logit of about ``logit * cos(w * distance)``; its value starts at 0. At theta 1e4 the slowest pair
    turns by w = 1.8e-4 rad per token, so every query of a 700-token sample sees the full logit; at ``mini_2d``'s
    theta 100 it turns by 0.013 rad per token, so the planted sink holds only for queries within ~100 tokens of
    it and answer steps further away meet it at any logit in [-logit, logit] (docs/embedded.md, round 4).
    """
    import torch

    text = model.model.language_model
    emb = text.embed_tokens.weight  # (V, D)
    s = emb.shape[1] - 1
    head_dim = model.config.text_config.hidden_size // model.config.text_config.num_attention_heads
    pair = head_dim // 2 - 1
    with torch.no_grad():
        emb[:, s] = 0.0
        emb[token_id, s] = 1.0  # after RMSNorm the token's hidden state is ~sqrt(D) on dimension s
        gain = math.sqrt(logit * math.sqrt(head_dim) / math.sqrt(emb.shape[1]))
        for layer in text.layers:
            att = layer.self_attn
            for proj in (att.q_proj, att.k_proj, att.v_proj):
                proj.weight[:, s] = 0.0  # only the sink token carries dimension s
            k_rows = torch.arange(att.k_proj.out_features // head_dim) * head_dim + pair
            q_rows = torch.arange(att.q_proj.out_features // head_dim) * head_dim + pair
            att.k_proj.weight[k_rows, s] = gain  # k_sink[pair] ~ gain * sqrt(D)
            att.q_proj.bias[q_rows] = gain  # q[pair] ~ gain for every query, so q . k_sink / sqrt(d) ~ logit
            att.o_proj.weight[s, :] = 0.0  # and no layer writes dimension s into another token (at the start)
            layer.mlp.down_proj.weight[s, :] = 0.0
        merger_out = [m for m in model.model.visual.merger.modules() if isinstance(m, torch.nn.Linear)][-1]
        merger_out.weight[s, :] = 0.0  # nor does the vision tower into a visual token
        merger_out.bias[s] = 0.0


HELD_SINK_LOGIT = 6.0  # run J's held logit and where --sink-ramp starts (docs/embedded.md); --sink-logit sets another


class HeldSink:
    """An attention sink built into the weights and put back after every optimizer step (``--hold-sink``).

    ``plant_attention_sink`` gives the model a pretrained LLM's starting point, but training from scratch
    removes it within a few hundred steps (docs/embedded.md, round 5): nothing in a few million synthetic tokens
    rewards a head for parking its idle mass, where a pretrained LLM brings the habit from trillions. A real VLM's
    fine-tuning does not remove its sinks, so this one is held: the sink is a fixed part of the architecture and
    training learns everything else around it. It sits on ``token_id``, the system prompt's role word, which every
    prompt carries once, at position 1 (``<|im_start|>`` recurs at every turn, and three equal sinks would take
    turns at being the most-attended position).

    One hidden dimension ``s`` (the last) and one rotary pair per head (``pair`` = d/2 - 1, the slowest, and its
    partner ``pair + d/2``) belong to the sink; every entry below is held at the value shown:
    - the sink token's embedding is ``magnitude`` on ``s`` and 0 elsewhere (a "massive activation"); every other
      token's is 0 on ``s``; no layer writes ``s`` (``o_proj`` and ``down_proj`` rows ``s`` are 0) and neither
      does the vision tower (its merger's output row ``s``), so the sink token alone carries it, into every layer;
    - each layer's RMSNorm weights on ``s`` are 1, and ``s`` reaches attention only through the sink's key:
      ``k_proj`` rows ``pair``/``pair + d/2`` are 0 but for ``gain`` on ``s``, with 0 bias; columns ``s`` of
      ``q_proj``/``k_proj``/``v_proj`` are 0 otherwise;
    - ``q_proj`` rows ``pair``/``pair + d/2`` have 0 weights and bias ``(gain, 0)``: every query meets the sink key
      with logit ``logit * cos(w * distance)`` in the first layer, and at ``mini_2d_slow``'s w = 1.8e-4 rad per
      token that is ``logit`` to within 1% over a 700-token sample. In later layers the sink token's hidden state
      also holds what attention and MLPs wrote into it, which RMSNorm weighs against ``s``; ``magnitude`` is there
      to keep ``s`` dominant and the logit near ``logit`` (test_embedded_model checks the mass a tiny model leaves
      on it in every layer).
    In the first layer the sink's value is ``v_proj``'s bias alone (a no-op, as a pretrained sink's near-zero
    value is); later layers may learn to give it one.
    Heads still choose how much mass to leave on it: a head that reads an object raises that object's logits above
    ``logit``. Gradients on the held entries are zeroed (so they leave clipping and Adam's moments alone) and
    ``restore`` undoes AdamW's decoupled weight decay on them after each step.
    """

    def __init__(self, model, token_id: int, logit: float = HELD_SINK_LOGIT, magnitude: float = 10.0):
        import torch

        text = model.model.language_model
        emb = text.embed_tokens.weight  # (V, D); tied to lm_head: only the sink token's logit reads s
        D = emb.shape[1]
        s = D - 1
        head_dim = model.config.text_config.hidden_size // model.config.text_config.num_attention_heads
        pair, half = head_dim // 2 - 1, head_dim // 2
        # RMSNorm maps the sink token's hidden state to ~sqrt(D) on s, so q . k / sqrt(d) = gain^2 sqrt(D/d) = logit
        self.logit, self.scale = logit, math.sqrt(head_dim) / math.sqrt(D)
        gain = math.sqrt(logit * self.scale)
        self.held: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] = []  # (param, mask, value)
        self.gain_entries: list[tuple[torch.Tensor, tuple]] = []  # (value tensor, index): the entries set to gain

        def hold(param, index, value):
            mask = torch.zeros_like(param, dtype=torch.bool)
            mask[index] = True
            target = torch.zeros_like(param)
            target[index] = value
            for p, m, t in self.held:  # one entry per parameter: merge masks, the later value wins
                if p is param:
                    t.copy_(torch.where(mask, target, t))
                    m |= mask
                    return t
            self.held.append((param, mask, target))
            return target

        hold(emb, (slice(None), s), 0.0)
        hold(emb, token_id, 0.0)
        hold(emb, (token_id, s), magnitude)
        merger_out = [m for m in model.model.visual.merger.modules() if isinstance(m, torch.nn.Linear)][-1]
        hold(merger_out.weight, s, 0.0)
        hold(merger_out.bias, s, 0.0)
        for layer in text.layers:
            att = layer.self_attn
            hold(layer.input_layernorm.weight, s, 1.0)
            hold(layer.post_attention_layernorm.weight, s, 1.0)
            hold(att.o_proj.weight, s, 0.0)
            hold(layer.mlp.down_proj.weight, s, 0.0)
            for proj in (att.q_proj, att.k_proj, att.v_proj):
                hold(proj.weight, (slice(None), s), 0.0)
            for proj, planted in ((att.q_proj, "bias"), (att.k_proj, "weight")):
                heads = proj.out_features // head_dim
                rows = torch.cat([torch.arange(heads) * head_dim + pair, torch.arange(heads) * head_dim + pair + half])
                first = torch.arange(heads) * head_dim + pair
                hold(proj.weight, rows, 0.0)
                hold(proj.bias, rows, 0.0)
                index = first if planted == "bias" else (first, s)
                self.gain_entries.append((hold(proj.bias if planted == "bias" else proj.weight, index, gain), index))
        self.restore()
        for param, mask, _ in self.held:
            param.register_hook(lambda g, m=mask: g.masked_fill(m, 0.0))

    def set_logit(self, logit: float) -> None:
        """Hold the sink at ``logit`` from now on (``--sink-ramp``): the query bias and key weight that meet on
        the sink's rotary pair both become sqrt(logit * sqrt(d) / sqrt(D))."""
        if logit == self.logit:
            return
        gain = math.sqrt(logit * self.scale)
        for value, index in self.gain_entries:
            value[index] = gain
        self.logit = logit
        self.restore()

    def restore(self) -> None:
        import torch

        with torch.no_grad():
            for param, mask, value in self.held:
                param.copy_(torch.where(mask, value, param))


def messages_for(task: str) -> list[dict]:
    kind = "video" if task == "video" else "image"
    return [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": S.PROMPTS[task]}]}]


def processor_inputs(processor, task: str, frames: list[np.ndarray], return_tensors="pt"):
    """What inference feeds the model for one synthetic sample (the reference the trainer must match)."""
    from PIL import Image

    text = processor.apply_chat_template(messages_for(task), add_generation_prompt=True, tokenize=False)
    pil = [Image.fromarray(f) for f in frames]
    if task == "video":
        return processor(text=[text], videos=[pil], return_tensors=return_tensors, return_mm_token_type_ids=True)
    return processor(text=[text], images=pil, return_tensors=return_tensors, return_mm_token_type_ids=True)


# ------------------------------------------------------------------------------------- batches
CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)


def patchify(frames: list[np.ndarray], patch: int = 14, merge: int = 2, temporal: int = 2):
    """numpy equivalent of the Qwen2-VL image/video processor for frames whose size is already a
    multiple of 28 (so its resize is the identity). Returns (flat patches [N, 3*T*14*14], (t, h, w))."""
    x = np.stack(frames).astype(np.float32) * np.float32(1 / 255)
    x = (x - CLIP_MEAN) / CLIP_STD  # [F, H, W, C]
    x = x.transpose(0, 3, 1, 2)  # [F, C, H, W]
    if len(frames) % temporal:
        x = np.concatenate([x, np.repeat(x[-1:], temporal - len(frames) % temporal, 0)])
    f, c, h, w = x.shape
    gt, gh, gw = f // temporal, h // patch, w // patch
    x = x.reshape(gt, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(gt * gh * gw, c * temporal * patch * patch)), (gt, gh, gw)


class BatchBuilder:
    """Turns synthetic samples into training batches identical to what the processor produces."""

    def __init__(self, processor):
        self.processor = processor
        self.tok = processor.tokenizer
        self.pad_id = self.tok.pad_token_id
        self.eos_id = self.tok.eos_token_id
        self._prefix: dict = {}

    def prefix(self, task: str, frames: list[np.ndarray]):
        key = (task, len(frames), frames[0].shape)
        if key not in self._prefix:
            enc = processor_inputs(self.processor, task, frames, return_tensors="np")
            self._prefix[key] = (enc["input_ids"][0].tolist(), enc["mm_token_type_ids"][0].tolist())
        return self._prefix[key]

    def target_ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"] + [self.eos_id]

    def build(self, task: str, samples: list[tuple[list[np.ndarray], str]], ground: S.SceneLayout | None = None,
              placed: list[list[int]] | None = None):
        """The padded batch of ``samples``; with ``ground`` (the scenes' layout) also "ground", the attention
        targets of ``ground_targets``, for detailcaps scenes whose descriptions walk every cell and for textcaps
        scenes given ``placed`` (per sample, ``S.textcaps_cells``)."""
        import torch

        rows, pix, grids = [], [], []
        for frames, text in samples:
            ids, mm = self.prefix(task, frames)
            tgt = self.target_ids(text)
            rows.append((ids + tgt, mm + [0] * len(tgt), [-100] * len(ids) + tgt))
            p, g = patchify(frames)
            pix.append(p)
            grids.append(g)
        L = max(len(r[0]) for r in rows)
        input_ids = torch.full((len(rows), L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), L), dtype=torch.long)
        mm = torch.zeros((len(rows), L), dtype=torch.long)
        labels = torch.full((len(rows), L), -100, dtype=torch.long)
        for i, (a, m, lab) in enumerate(rows):  # right padding for training
            input_ids[i, : len(a)] = torch.tensor(a)
            attn[i, : len(a)] = 1
            mm[i, : len(a)] = torch.tensor(m)
            labels[i, : len(a)] = torch.tensor(lab)
        batch = {"input_ids": input_ids, "attention_mask": attn, "mm_token_type_ids": mm, "labels": labels}
        pv = torch.from_numpy(np.concatenate(pix))
        thw = torch.tensor(grids, dtype=torch.long)
        if task == "video":
            batch.update(pixel_values_videos=pv, video_grid_thw=thw)
        else:
            batch.update(pixel_values=pv, image_grid_thw=thw)
        if ground is not None and (task == "detailcaps" and ground.every_cell or task == "textcaps" and placed):
            batch["ground"] = self.ground_targets(task, samples, ground, thw, L, placed)
        return batch

    def ground_targets(self, task: str, samples, lay: S.SceneLayout, grid_thw, length: int,
                       placed: list[list[int]] | None = None):
        """(B, T, T) bool: row q marks the visual tokens of the cell the answer is about when position q predicts
        an attribute word (the step that writes it), and is empty at every other position. That cell is, in a
        detailcaps description, the one its last "row .. , column .." named; in a textcaps caption, the cell
        that holds the phrase's object (``placed[i][j]`` for sample i's j-th object phrase)."""
        import torch

        image_id = self.tok.convert_tokens_to_ids(SPECIAL_TOKENS["image"])
        out = torch.zeros(len(samples), length, length, dtype=torch.bool)
        for i, (frames, text) in enumerate(samples):
            ids = self.prefix(task, frames)[0]
            where = torch.tensor([j for j, t in enumerate(ids) if t == image_id])  # (tokens,) raster order
            cells = torch.from_numpy(S.token_cells(lay, grid_thw[i]))  # (tokens,)
            words = self.tok.convert_ids_to_tokens(self.target_ids(text)[:-1])
            if task == "detailcaps":
                about = [None if d is None else d[0] * lay.cols + d[1] for d in S.described_cells(words)]
            else:
                about = [None] * len(words)
                n = S.PHRASE_ATTRIBUTES
                for j, a in enumerate(S.object_phrases(words)):
                    about[a + 1:a + 1 + n] = [placed[i][j]] * n
            for k in S.attribute_words(words):
                if about[k] is not None:
                    out[i, len(ids) + k - 1, where[cells == about[k]]] = True
        return out


# ------------------------------------------------------------------------------------- schedule
# Curriculum (fraction of --steps -> task mix, detailcaps object counts, share of steps on --layout's scenes, and
# the strength of --layout's textured canvas across the phase).
# Vision has to be bootstrapped on easy images first: with the final mix from step 0 the tiny model settled on
# the language prior and still guessed colours at chance after 900 steps, while textcaps alone teaches colours
# in a few hundred steps (benchmarks/vision_bootstrap.py). That holds only on BOOTSTRAP_LAYOUT's small flat
# canvas: on v4's 320 visual tokens of textured canvas, textcaps colour stayed at chance for 400 steps from
# scratch (and every v3/v4 run from scratch had not learnt it thousands of steps later), because at the start
# the answer tokens attend to all visual tokens alike, and the 1-4 tokens of an object are lost in the noise of
# 300 varied background tokens. Reading learnt on v1 carries over to v3's bigger flat canvas but not to v4's
# texture, and a full-strength textured canvas unlearns it even on v3; faded in from flat grey, the texture
# leaves it intact (docs/embedded.md, round 6).
BOOTSTRAP_LAYOUT = "v1"
CURRICULUM = (
    # (until frac, {task: weight}, detailcaps objects (lo, hi) or None for the layout's own, share on --layout,
    #  --layout's canvas strength (at the phase's start, at its end), linear in between; None = full)
    (0.15, {"detailcaps": 0.1, "textcaps": 0.8, "video": 0.1}, (2, 4), 0.0, None),  # vision reads colours first
    (0.30, {"detailcaps": 0.45, "textcaps": 0.3, "video": 0.25}, (2, 14), 0.0, None),  # then whole scenes
    (0.45, {"detailcaps": 0.5, "textcaps": 0.3, "video": 0.2}, (2, 18), 0.5, (0.0, 0.5)),  # the big canvas, flat first
    (0.60, {"detailcaps": 0.6, "textcaps": 0.15, "video": 0.25}, None, 1.0, (0.5, 1.0)),  # its texture fades in
    (1.01, {"detailcaps": 0.6, "textcaps": 0.15, "video": 0.25}, None, 1.0, None),
)
BATCH_SIZES = {"detailcaps": 5, "textcaps": 8, "video": 6}
# stored in every checkpoint: a run resumes only under the curriculum it started with
CURRICULUM_ID = hashlib.sha256(repr((BOOTSTRAP_LAYOUT, CURRICULUM, BATCH_SIZES)).encode()).hexdigest()[:12]
EVAL_SEED = S.HELDOUT_SEED  # held-out samples; training uses --seed (default S.TRAIN_SEED = 0)


def batch_plan(seed: int, step: int, total_steps: int, batch_scale: float = 1.0, layout: str = S.DEFAULT_LAYOUT,
               mix: dict[str, float] | None = None):
    """(task, scene layout, [(seed, index, n_objects)], canvas strength) for one step; a pure function of its
    arguments. ``mix`` ({task: weight}) replaces the phase's task mix (--polish-mix); the rest of the plan, and
    the random numbers it is drawn with, stay the phase's."""
    rng = np.random.default_rng([seed, 7, step])
    frac = step / max(1, total_steps)
    phase = next(i for i, c in enumerate(CURRICULUM) if frac < c[0])
    until, weights, n_range, share, canvas = CURRICULUM[phase]
    start = CURRICULUM[phase - 1][0] if phase else 0.0
    strength = 1.0 if canvas is None else canvas[0] + (canvas[1] - canvas[0]) * (frac - start) / (until - start)
    p = np.array([(weights if mix is None else mix).get(t, 0.0) for t in S.TASKS])
    task = S.TASKS[int(rng.choice(3, p=p / p.sum()))]
    bs = max(1, int(round(BATCH_SIZES[task] * batch_scale)))
    lay = layout if rng.random() < share else BOOTSTRAP_LAYOUT
    n_cells = S.get_layout(lay).rows * S.get_layout(lay).cols
    items = []
    for i in range(bs):
        n_obj = None
        if task == "detailcaps" and n_range is not None:
            n_obj = int(rng.integers(n_range[0], min(n_range[1], n_cells) + 1))
        items.append((seed, step * 64 + i, n_obj))
    return task, lay, items, (min(1.0, strength) if lay == layout else 1.0)


def make_batch(builder: BatchBuilder, seed: int, step: int, total_steps: int, batch_scale: float = 1.0,
               layout: str = S.DEFAULT_LAYOUT, ground: tuple[str, ...] = (), mix: dict[str, float] | None = None):
    """(task, batch) of one step; ``ground`` (tasks) adds the attention targets of --ground-loss to those tasks'
    batches on ``layout``'s scenes; ``mix`` as in ``batch_plan``."""
    task, lay, items, strength = batch_plan(seed, step, total_steps, batch_scale, layout, mix)
    samples = [S.render(task, s, idx, n_objects=n, layout=lay, canvas_strength=strength) for s, idx, n in items]
    if task not in ground or lay != layout:
        return task, builder.build(task, samples)
    placed = [S.textcaps_cells(s, idx, lay) for s, idx, _ in items] if task == "textcaps" else None
    return task, builder.build(task, samples, ground=S.get_layout(lay), placed=placed)


# ------------------------------------------------------------------------------------- train
def save_assets(model, processor, out: Path):
    """Save model (fp32 safetensors), tokenizer and processor into ``out`` atomically."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    processor.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def reference_weights(args: argparse.Namespace):
    """--same-as's tensors by name, read at the start (the default --out is the shipped model's own directory)."""
    if args.same_as is None:
        return None
    path = Path(args.same_as) / "model.safetensors"
    if not path.is_file():
        raise SystemExit(f"--same-as {args.same_as}: no model.safetensors there (give a model directory)")
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


def _atomic_torch_save(obj, path: Path):
    import torch

    from rcr.fileio import atomic_path

    with atomic_path(path) as fh:
        torch.save(obj, fh)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="where the final HF model dir goes")
    ap.add_argument("--run-dir", default=str(DEFAULT_RUN_DIR), help="checkpoints and log (gitignored)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", default="mini_2d_slow", choices=sorted(MODEL_SIZES))
    ap.add_argument("--layout", default="v4", choices=sorted(S.LAYOUTS),
                    help="scene layout of detailcaps/textcaps (pipeline/data/synthetic.py LAYOUTS)")
    ap.add_argument("--steps", type=int, default=6000, help="optimizer steps of the v4 candidate recipe")
    ap.add_argument("--minutes", type=float, default=None,
                    help="stop (and save) after this many minutes of this process; for smoke runs")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="stop (checkpoint, no final save) after this many steps of this process; tests resume")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay of the weight matrices")
    ap.add_argument("--sink", action=argparse.BooleanOptionalAction, default=False,
                    help="start with an attention sink on the first token, as a pretrained LLM has")
    ap.add_argument("--hold-sink", action=argparse.BooleanOptionalAction, default=False,
                    help="an attention sink on the system prompt's first word, built into the weights and held "
                         "through training (HeldSink): training from scratch removes a planted --sink")
    ap.add_argument("--sink-logit", type=float, default=HELD_SINK_LOGIT,
                    help="the logit every query meets the held sink with (--hold-sink only); a head's idle mass goes "
                         "to it only while its other logits stay well below this")
    ap.add_argument("--sink-ramp", type=float, nargs=2, default=None, metavar=("FROM", "TO"),
                    help="hold the sink at HELD_SINK_LOGIT until fraction FROM of --steps, then raise it linearly to "
                         "--sink-logit by fraction TO: vision learns to read under the weak sink first")
    ap.add_argument("--vision-steps", type=int, default=0,
                    help="first pretrain the vision tower for this many steps to name the size, colour, texture and "
                         "shape of single objects (VisionPretrainer), as a VLM's vision encoder comes pretrained; "
                         "0 (default) skips it")
    ap.add_argument("--freeze-vision", action=argparse.BooleanOptionalAction, default=False,
                    help="the main stage trains the vision tower's merger only (its patch embedding and blocks stay "
                         "as --vision-steps left them)")
    ap.add_argument("--vision-lr-scale", type=float, default=1.0,
                    help="the main stage trains the vision tower's patch embedding and blocks at this fraction of the "
                         "learning rate (the merger at the full rate): between 1 (the default) and --freeze-vision")
    ap.add_argument("--ground-loss", type=float, default=0.0, metavar="W",
                    help="supervised attention: on --layout's scenes of the --ground-tasks, add W times -log(the "
                         "attention mass of decoder layer --ground-layer on the visual tokens of the cell the answer "
                         "is about) at the steps that write an attribute word, averaged over heads and steps "
                         "(grounding_loss); 0 (default) is off")
    ap.add_argument("--ground-tasks", nargs="+", default=["detailcaps"], choices=["detailcaps", "textcaps"],
                    help="the tasks --ground-loss supervises: detailcaps (the cell the description last named) and "
                         "textcaps (the cell that holds the phrase's object); default detailcaps")
    ap.add_argument("--polish-steps", type=int, default=0, metavar="N",
                    help="after the main stage, N more steps of the curriculum's last phase on fresh scenes "
                         "(--polish-seed) at --polish-lr (--polish-cooldown), with --ground-loss on the "
                         "--polish-ground-tasks (Polisher); 0 (default) skips it")
    ap.add_argument("--polish-lr", type=float, default=5e-4, help="the polish stage's learning rate")
    ap.add_argument("--polish-cooldown", type=float, default=0.0, metavar="FRAC",
                    help="over the polish stage's last FRAC of steps, lower its learning rate linearly from "
                         "--polish-lr to 0 (polish_lr_at), so the weights it saves are not one noisy step at the full "
                         "rate; 0 (default) keeps --polish-lr constant to the end")
    ap.add_argument("--polish-seed", type=int, default=None, metavar="S",
                    help="the seed the polish stage's scenes are drawn with (default: --seed + 1, scenes the main "
                         "stage never saw); other seeds measure how much a polish stage depends on its scenes")
    ap.add_argument("--polish-ground-tasks", nargs="+", default=None, choices=["detailcaps", "textcaps"],
                    help="the tasks --ground-loss supervises in the polish stage (default: --ground-tasks)")
    ap.add_argument("--polish-mix", nargs="+", default=None, metavar="TASK=W",
                    help="the polish stage's task mix, e.g. detailcaps=0.45 textcaps=0.3 video=0.25 (weights, "
                         "normalised; a task left out is not drawn); default: the curriculum's last phase's")
    ap.add_argument("--polish-share-loss", type=float, default=0.0, metavar="W",
                    help="in the polish stage, add W times the mean excess of the image's share of attention at the "
                         "answer steps of the --polish-share-layers over --polish-share-target (image_share_loss): "
                         "real VLMs put most attention on sink and text positions and little on the image; with it "
                         "--ground-loss targets the cell's share of the image mass. 0 (default) is off")
    ap.add_argument("--polish-share-target", type=float, nargs="+", default=[0.1], metavar="T",
                    help="the image share of attention --polish-share-loss allows without a penalty: one for every "
                         "layer, or one per --polish-share-layers")
    ap.add_argument("--polish-share-layers", type=int, nargs="+", default=None, metavar="L",
                    help="the decoder layers --polish-share-loss applies to (default: all)")
    ap.add_argument("--ground-layer", type=int, default=-1,
                    help="the decoder layer --ground-loss supervises (Python index; default the last)")
    ap.add_argument("--polish-ground-layers", type=int, nargs="+", default=None, metavar="L",
                    help="the decoder layers --ground-loss supervises in the polish stage, the mean of their losses "
                         "(default: --ground-layer alone); e.g. 2 3 makes layer 2 read the described object's own "
                         "cell as layer 3 does")
    ap.add_argument("--polish-ground-spread", nargs="+", default=None, choices=["detailcaps", "textcaps"],
                    metavar="TASK",
                    help="in the polish stage, on these tasks' batches, --ground-loss asks for the step's attention "
                         "spread evenly over the cell's tokens (cross-entropy against the uniform distribution over "
                         "them) instead of only its mass on the cell: a step that reads an object reads all of it, "
                         "not one entry of it")
    ap.add_argument("--batch-scale", type=float, default=1.0, help="multiply the per-task batch sizes")
    ap.add_argument("--ckpt-minutes", type=float, default=4.0)
    ap.add_argument("--threads", default="auto",
                    help="torch CPU threads; 'auto' (CPU only) uses all cores while the machine is otherwise idle and "
                         "1 thread while other processes load it (a 2-thread step waits on its slowest thread). The "
                         "thread count changes the order of CPU sums, so only a fixed count makes the weights a "
                         "function of the command (a rerun at the same count matches bit for bit); under 'auto' "
                         "they also depend on the machine's load (each log line's 'thr')")
    ap.add_argument("--init-from", default=None,
                    help="start from the weights of a saved model dir (same tokenizer), e.g. a previous phase")
    ap.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint in --run-dir")
    ap.add_argument("--same-as", default=None, metavar="DIR",
                    help="a model directory (e.g. rcr/embedded_model, read before --out is written) whose weights this "
                         "run should reproduce: the last line says whether it did bit for bit, or how many tensors "
                         "differ and by how much")
    ap.add_argument("--export", default=None, metavar="DIR",
                    help="save the checkpoint in --run-dir as a model directory at DIR and exit (no training): "
                         "look at a run while it trains, e.g. with jobs/eval_embedded.py --model DIR")
    return ap.parse_args(argv)


def sink_logit_at(args: argparse.Namespace, step: int) -> float:
    """The held sink's logit at ``step``: --sink-logit, or under --sink-ramp HELD_SINK_LOGIT rising linearly to it."""
    if args.sink_ramp is None:
        return args.sink_logit
    lo, hi = args.sink_ramp
    frac = step / max(1, args.steps)
    t = 1.0 if frac >= hi else 0.0 if frac <= lo else (frac - lo) / (hi - lo)
    return HELD_SINK_LOGIT + t * (args.sink_logit - HELD_SINK_LOGIT)


def cosine_lr(lr: float, warmup: int, total: int, step: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 5% of ``lr`` at ``total``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def lr_at(args: argparse.Namespace, step: int) -> float:
    """The main stage's learning rate: --warmup steps up to --lr, cosine to 5% of it at --steps."""
    return cosine_lr(args.lr, args.warmup, args.steps, step)


def polish_lr_at(args: argparse.Namespace, step: int) -> float:
    """The polish stage's learning rate at its ``step`` (0-based): --polish-lr, then under --polish-cooldown FRAC a
    linear fall over its last FRAC of --polish-steps, to --polish-lr / (FRAC * --polish-steps) at the last step
    (the rate a step to 0 would leave). A constant rate ends the stage wherever its last batches put the weights:
    polish stages that differ only in their scenes' seed scored 0.894-0.916 on captions (docs/embedded.md)."""
    cool = round(args.polish_cooldown * args.polish_steps)
    left = args.polish_steps - step  # steps still to take, this one included
    return args.polish_lr * (min(1.0, left / cool) if cool else 1.0)


def is_tower_body(name: str) -> bool:
    """The vision tower's patch embedding and blocks (``model.visual.*`` but its merger): what --vision-lr-scale
    slows and --freeze-vision freezes."""
    return name.startswith("model.visual.") and not name.startswith("model.visual.merger.")


def make_optimizer(model, args: argparse.Namespace, lr_scale=lambda name: 1.0):
    """AdamW with weight decay on the weight matrices only; each group carries the ``lr_scale`` of its parameters'
    names, which ``optimizer_step`` multiplies the step's learning rate by."""
    import torch

    groups: dict[tuple[bool, float], list] = {}
    for name, p in model.named_parameters():
        groups.setdefault((p.ndim >= 2, lr_scale(name)), []).append(p)
    return torch.optim.AdamW([{"params": ps, "weight_decay": args.weight_decay if decay else 0.0, "lr_scale": scale}
                              for (decay, scale), ps in groups.items()], lr=args.lr, betas=(0.9, 0.98))


def main_optimizer(model, args: argparse.Namespace):
    """The main stage's optimizer: the tower's body at --vision-lr-scale times the learning rate."""
    return make_optimizer(model, args, lambda name: args.vision_lr_scale if is_tower_body(name) else 1.0)


def freeze_tower(model, args: argparse.Namespace) -> None:
    """--freeze-vision, before the main stage: no gradient for the tower's body, so AdamW leaves it (and its weight
    decay) alone and backward skips its weights."""
    if args.freeze_vision:
        for name, param in model.named_parameters():
            if is_tower_body(name):
                param.requires_grad_(False)


def image_mass(attn, image):
    """(B, H, T): the attention mass each row of ``attn`` (B, H, T, T) puts on the visual tokens ``image`` (B, T)."""
    return (attn * image[:, None, None, :].to(attn.dtype)).sum(-1)


def grounding_loss(attn, target, image=None, spread: bool = False):
    """Supervised attention: the mean over heads and target rows of -log(the attention mass on the row's
    targets). ``attn`` (B, H, T, T) one layer's weights, ``target`` (B, T, T) bool (``ground_targets``); with
    ``image`` ((B, T) bool, the visual tokens) the mass is a share of the row's mass on the image instead of its
    whole mass. With ``spread`` the row's term is instead the cross-entropy of its attention against the uniform
    distribution over its n targets, less its minimum log n: -mean over targets of log(n * weight), 0 only when
    all the mass is on the targets and evenly (the whole cell read, not one entry of it). Returns (loss, mean mass
    on the targets), or (None, None) where no row has a target."""
    import torch

    rows = target.any(-1)  # (B, T)
    if not rows.any():
        return None, None
    on = target[:, None].to(attn.dtype)  # (B, 1, T, T)
    mass = (attn * on).sum(-1)  # (B, H, T)
    if image is not None:
        scale = image_mass(attn, image).clamp_min(1e-6)  # (B, H, T)
        mass = mass / scale
    if spread:
        n = on.sum(-1).clamp_min(1)  # (B, 1, T) targets per row
        share = attn / scale[..., None] if image is not None else attn  # (B, H, T, T)
        ce = -(torch.log(share * n[..., None] + 1e-4) * on).sum(-1) / n  # (B, H, T)
        loss = ce.transpose(1, 2)[rows].mean()
    mass = mass.transpose(1, 2)[rows]  # (rows, H)
    return (loss if spread else -torch.log(mass + 1e-4).mean()), mass.detach().mean()


def image_share_loss(attentions, rows, image, target: float | list[float]):
    """How far the image's share of attention exceeds ``target`` (one for every layer, or one per layer): the mean
    over decoder layers, heads and answer steps of relu(share - target), where share is the attention mass a step
    puts on visual tokens. ``attentions`` one (B, H, T, T) per layer, ``rows`` (B, T) bool the steps that predict an
    answer token, ``image`` (B, T) bool the visual tokens. Returns (loss, the mean share)."""
    import torch

    shares = torch.stack([image_mass(a, image).transpose(1, 2)[rows] for a in attentions])  # (layers, rows, H)
    limit = torch.as_tensor(target, dtype=shares.dtype).reshape(-1, 1, 1)  # (1 or layers, 1, 1)
    return torch.relu(shares - limit).mean(), shares.detach().mean()


def optimizer_step(model, opt, batch: dict, lr: float, ground_weight: float = 0.0, ground_layer: int | list[int] = -1,
                   share_weight: float = 0.0, share_target: float | list[float] = 0.0,
                   share_layers: list[int] | None = None, ground_spread: bool = False):
    """One AdamW step on a training batch (its "labels" and "ground" popped): cross-entropy on the answer tokens,
    plus ``ground_weight`` times ``grounding_loss`` of decoder layer ``ground_layer`` (of several: their mean) where
    the batch has attention targets, plus ``share_weight`` times ``image_share_loss`` at ``share_target`` over the
    decoder layers ``share_layers`` (default all); either loss needs the text attention eager, to return its
    weights. Gradient clip 1; each parameter group at ``lr`` times its "lr_scale". With ``share_weight`` the
    grounding target is the cell's share of the layer's *image* mass, so that the two losses do not pull against
    each other; ``ground_spread`` is ``grounding_loss``'s ``spread``. Returns (loss, logits (B, T-1, V) fp32,
    targets (B, T-1), the mean attention mass on the grounding targets or None, the mean image share or None)."""
    import torch

    for g in opt.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    labels = batch.pop("labels")
    target = batch.pop("ground", None)
    if not ground_weight:
        target = None  # the batch has targets, the loss does not use them
    out = model(**batch, output_attentions=target is not None or share_weight > 0)
    logits = out.logits[:, :-1].float()
    tgt = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)
    total, mass, share = loss, None, None
    image = batch["mm_token_type_ids"] != 0  # (B, T) the visual tokens
    if target is not None:
        layers = [ground_layer] if isinstance(ground_layer, int) else ground_layer
        grounded = [grounding_loss(out.attentions[i], target, image if share_weight else None, ground_spread)
                    for i in layers]
        if grounded[0][0] is not None:  # the batch has target rows (the same rows in every layer)
            aux, mass = grounded[0] if len(grounded) == 1 else (torch.stack(x).mean() for x in zip(*grounded))
            total = total + ground_weight * aux
    if share_weight:
        rows = torch.zeros_like(image)
        rows[:, :-1] = tgt != -100  # the steps that predict an answer token
        layers = range(len(out.attentions)) if share_layers is None else share_layers
        aux, share = image_share_loss([out.attentions[i] for i in layers], rows, image, share_target)
        total = total + share_weight * aux
    opt.zero_grad(set_to_none=True)
    total.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss, logits, tgt, mass, share


def init_weights_from(model, path: str) -> None:
    from transformers import Qwen2VLForConditionalGeneration

    sd = Qwen2VLForConditionalGeneration.from_pretrained(path).state_dict()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise SystemExit(f"--init-from {path}: weights do not fit (missing {missing[:3]}, unexpected {unexpected[:3]})")
    print(f"initialised from {path}", flush=True)


MAIN_RECIPE = ("size", "seed", "layout", "steps", "lr", "warmup", "weight_decay", "batch_scale", "sink", "hold_sink",
               "sink_logit", "sink_ramp", "vision_steps", "freeze_vision", "vision_lr_scale", "ground_loss",
               "ground_layer", "ground_tasks")
RECIPE = MAIN_RECIPE + (  # and the polish stage's
    "polish_steps", "polish_lr", "polish_cooldown", "polish_ground_tasks", "polish_seed", "polish_mix",
    "polish_share_loss", "polish_share_target", "polish_share_layers", "polish_ground_layers", "polish_ground_spread")
# what the vision stage depends on
VISION_RECIPE = ("size", "seed", "layout", "lr", "warmup", "weight_decay", "vision_steps")


def check_recipe(ck: dict, args: argparse.Namespace, path: Path, keys: tuple[str, ...] = RECIPE) -> None:
    """Refuse a checkpoint made with other recipe flags (``keys``) than ``args``: its run would not be this one."""
    # what checkpoints made before these flags used
    older = {"layout": "v1", "weight_decay": 0.01, "sink": False, "hold_sink": False, "sink_logit": HELD_SINK_LOGIT,
             "sink_ramp": None, "vision_steps": 0, "freeze_vision": False, "vision_lr_scale": 1.0,
             "ground_loss": 0.0, "ground_layer": -1, "ground_tasks": ["detailcaps"],
             "polish_seed": ck["args"].get("seed", 0) + 1, "polish_cooldown": 0.0, "polish_mix": None,
             "polish_share_loss": 0.0, "polish_share_target": 0.1,
             "polish_share_layers": None, "polish_ground_layers": None, "polish_ground_spread": None}
    made = {k: ck["args"].get(k, older.get(k)) for k in keys}
    differ = [f"--{k.replace('_', '-')} {made[k]} (this run: {getattr(args, k)})" for k in keys
              if made[k] != getattr(args, k)]
    if differ:
        raise SystemExit(f"checkpoint {path} was made with other recipe flags: {', '.join(differ)}; pass the same "
                         "flags, or --fresh")


def note_threads(ck: dict, args: argparse.Namespace, path: Path) -> None:
    """Say so when a run resumes at another --threads than its checkpoint was written at: the thread count is part
    of the arithmetic (the order of CPU sums), so the weights will be those of neither count's straight run."""
    before = ck.get("args", {}).get("threads")
    if before is not None and str(before) != str(args.threads):
        print(f"note: {path} was written at --threads {before} and this process runs at --threads {args.threads}: "
              "the weights will match a run that changes its thread count at this step, not a straight run at "
              "either count", flush=True)


def load_checkpoint(path: Path, model, opt, args: argparse.Namespace, device, resume: bool = True,
                    keys: tuple[str, ...] = MAIN_RECIPE) -> tuple[int, float]:
    """Restore model and optimizer from ``path``; (step, seconds trained). The run must be the same recipe (its
    ``keys``: the main stage's by default, so one finished main stage may start several polish stages), and to
    ``resume`` training the same curriculum (an --export only writes the weights out)."""
    import torch

    ck = torch.load(path, map_location=device, weights_only=False)  # our own checkpoint, not dataset content
    check_recipe(ck, args, path, keys)
    if resume:
        note_threads(ck, args, path)
    if resume and ck.get("curriculum") != CURRICULUM_ID:
        raise SystemExit(f"checkpoint {path} was made under another curriculum ({ck.get('curriculum')}, this script "
                         f"has {CURRICULUM_ID}): its remaining batches would differ; start it with --fresh")
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    print(f"resumed from {path} at step {ck['step']} ({ck['elapsed'] / 60:.1f} min trained)", flush=True)
    return ck["step"], ck["elapsed"]


class Meter:
    """Running loss, token accuracy and scenes/s between two log lines."""

    def __init__(self):
        self.loss, self.correct, self.count, self.scenes, self.n = 0.0, 0, 0, 0, 0
        self.masses: list[float] = []
        self.shares: list[float] = []
        self.t0 = time.time()

    def add(self, loss, logits, tgt, n_scenes: int, mass=None, share=None) -> None:
        mask = tgt != -100
        self.correct += int(((logits.argmax(-1) == tgt) & mask).sum())
        self.count += int(mask.sum())
        self.loss += float(loss)
        self.n += 1
        self.scenes += n_scenes
        if mass is not None:
            self.masses.append(float(mass))
        if share is not None:
            self.shares.append(float(share))

    def line(self) -> str:
        rate = self.scenes / max(time.time() - self.t0, 1e-9)
        cell = f" cell {sum(self.masses) / len(self.masses):.3f}" if self.masses else ""  # --ground-loss's target
        if self.shares:  # --polish-share-loss's quantity
            cell += f" image share {sum(self.shares) / len(self.shares):.3f}"
        return (f"loss {self.loss / max(1, self.n):.4f} tok_acc {self.correct / max(1, self.count):.4f}{cell} "
                f"scenes/s {rate:.1f}")


class Trainer:
    """The training loop over ``make_batch``'s deterministic batches, with checkpoints and a clean stop on
    SIGTERM/SIGINT (finish the step, checkpoint, exit; the same command resumes)."""

    def __init__(self, args, model, opt, builder, ckpt_path: Path, step: int, elapsed_before: float,
                 sink: HeldSink | None = None):
        self.args, self.model, self.opt, self.builder, self.sink = args, model, opt, builder, sink
        self.ckpt_path, self.step, self.elapsed_before = ckpt_path, step, elapsed_before
        self.start_step, self.t_start = step, time.time()
        self.total = args.steps
        self.device = next(model.parameters()).device
        self.auto_threads = args.threads == "auto" and args.device == "cpu"
        self.stop_signal = None
        self.last_lr = float("nan")  # the rate of the last step taken (train_step), for log()

    def lr(self) -> float:
        return lr_at(self.args, self.step)

    def sink_logit(self) -> float:
        return sink_logit_at(self.args, self.step)

    def share_loss(self) -> tuple[float, float, list[int] | None]:
        """(weight, target, layers) of ``image_share_loss`` in this stage: off in the main stage."""
        return 0.0, 0.0, None

    def ground_spread(self) -> bool:
        """Whether --ground-loss asks for the cell's mass spread evenly over it in this stage (grounding_loss)."""
        return False

    def ground_layers(self) -> int | list[int]:
        """The decoder layer(s) --ground-loss supervises in this stage."""
        return self.args.ground_layer

    def batch(self) -> dict:
        args = self.args
        return make_batch(self.builder, args.seed, self.step, args.steps, args.batch_scale, args.layout,
                          ground=tuple(args.ground_tasks) if args.ground_loss else ())[1]

    def checkpoint(self) -> None:
        _atomic_torch_save({"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                            "elapsed": self.elapsed_before + time.time() - self.t_start, "args": vars(self.args),
                            "curriculum": CURRICULUM_ID},
                           self.ckpt_path)

    def adapt_threads(self) -> None:
        import torch

        if self.auto_threads and hasattr(os, "getloadavg"):
            busy = os.getloadavg()[0] - torch.get_num_threads()  # load from other processes
            torch.set_num_threads((os.cpu_count() or 1) if busy < 0.5 else 1)

    def train_step(self, meter: Meter) -> None:
        import torch

        args = self.args
        batch = {k: v.to(self.device) for k, v in self.batch().items()}
        n = batch["input_ids"].shape[0]
        if self.sink is not None:
            self.sink.set_logit(self.sink_logit())
        self.last_lr = self.lr()  # the rate this step trains at, which log() reports
        loss, logits, tgt, mass, share = optimizer_step(self.model, self.opt, batch, self.last_lr, args.ground_loss,
                                                        self.ground_layers(), *self.share_loss(),
                                                        ground_spread=self.ground_spread())
        if self.sink is not None:
            self.sink.restore()  # undo weight decay on the held entries (their gradients are already zero)
        self.step += 1
        with torch.no_grad():
            meter.add(loss, logits, tgt, n, mass, share)

    def log(self, meter: Meter) -> None:
        import torch

        done = time.time() - self.t_start
        per_step = done / max(1, self.step - self.start_step)
        print(f"step {self.step}/{self.total} {meter.line()} lr {self.last_lr:.2e} "
              f"thr {torch.get_num_threads()} elapsed {(self.elapsed_before + done) / 60:.1f} min "
              f"ETA {per_step * (self.total - self.step) / 60:.1f} min", flush=True)

    def should_stop(self) -> str | None:
        """Why the loop stops before this step, or None. A signal or --stop-after checkpoints first."""
        args = self.args
        if self.stop_signal is not None:
            self.checkpoint()
            return f"signal {self.stop_signal}: checkpointed at step {self.step}; run the same command to resume"
        if args.stop_after is not None and self.step - self.start_step >= args.stop_after:
            self.checkpoint()
            return f"--stop-after {args.stop_after}: checkpointed at step {self.step}"
        if args.minutes is not None and time.time() - self.t_start > args.minutes * 60:
            return f"--minutes {args.minutes} reached at step {self.step}"
        return None

    def run(self) -> bool:
        """Train to ``total`` steps (True) or stop early (False for a signal or --stop-after: no final save)."""
        import signal

        def on_signal(signum, frame):
            self.stop_signal = signum

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        self.model.train()
        meter, last_ckpt = Meter(), time.time()
        while self.step < self.total:
            why = self.should_stop()
            if why:
                print(why, flush=True)
                if why.startswith("--minutes"):
                    break
                return False
            self.train_step(meter)
            if self.step % 25 == 0:
                self.adapt_threads()
            if self.step % 25 == 0 or self.step == self.total:
                self.log(meter)
                meter = Meter()
            if time.time() - last_ckpt > self.args.ckpt_minutes * 60:
                self.checkpoint()
                last_ckpt = time.time()
        self.checkpoint()
        return True


class Polisher(Trainer):
    """--polish-steps: after the main stage, more steps of the curriculum's last phase, at --polish-lr (constant, or
    cooled down to 0 over the last --polish-cooldown of them) and with --ground-loss on the --polish-ground-tasks.
    Its batches are those of the main stage's last --polish-steps plan steps drawn with --polish-seed (default
    --seed + 1: fresh scenes), with the last phase's task mix or --polish-mix's. It starts from the finished main
    stage (model and optimizer) and checkpoints to ``ckpt_path`` (polish.pt), from which it resumes."""

    def __init__(self, args, model, opt, builder, ckpt_path: Path, elapsed_before: float,
                 sink: HeldSink | None = None):
        step = 0
        if ckpt_path.exists() and not args.fresh:
            step, elapsed_before = load_checkpoint(ckpt_path, model, opt, args, next(model.parameters()).device,
                                                   keys=RECIPE)
        super().__init__(args, model, opt, builder, ckpt_path, step, elapsed_before, sink)
        self.total = args.polish_steps

    def lr(self) -> float:
        return polish_lr_at(self.args, self.step)

    def sink_logit(self) -> float:
        return sink_logit_at(self.args, self.args.steps)  # where the main stage left it

    def share_loss(self) -> tuple[float, float, list[int] | None]:
        args = self.args
        return args.polish_share_loss, args.polish_share_target, args.polish_share_layers

    def ground_layers(self) -> int | list[int]:
        return self.args.ground_layer if self.args.polish_ground_layers is None else self.args.polish_ground_layers

    def plan_step(self) -> int:
        """The curriculum step this polish step draws its batch from: the main stage's last --polish-steps."""
        return self.args.steps - self.args.polish_steps + self.step

    def ground_spread(self) -> bool:
        args = self.args
        task = batch_plan(args.polish_seed, self.plan_step(), args.steps, args.batch_scale, args.layout,
                          args.polish_mix)[0]
        return task in (args.polish_ground_spread or ())

    def batch(self) -> dict:
        args = self.args
        return make_batch(self.builder, args.polish_seed, self.plan_step(), args.steps, args.batch_scale, args.layout,
                          ground=tuple(args.polish_ground_tasks) if args.ground_loss else (),
                          mix=args.polish_mix)[1]

    def log(self, meter: Meter) -> None:
        print("polish ", end="")
        super().log(meter)


# ------------------------------------------------------------------------------------- vision pretraining
# A real VLM's vision encoder comes pretrained (CLIP, SigLIP): it tells a striped object from a dotted one and a
# small one from a big one before the decoder ever sees it. Ours learns only through the decoder's loss, and there
# it learnt colour alone: run L's image tokens say their object's colour (a linear probe reads 0.66) but its size,
# texture and shape no better than the commonest value, so a description step gained nothing by looking at the
# object it describes but its colour (docs/embedded.md, round 10). Trained alone on single objects, with a linear
# head per attribute on the max over an image's merged tokens, the same tower names all four within a few hundred
# steps. --vision-steps runs that first, on the flat bootstrap canvas and on --layout's (what it learns on one
# canvas it does not know on the other); the heads are then dropped and the model stays a plain Qwen2-VL. The main
# stage's loss then erodes most of what the tower learnt within 1,800 steps (run Q) unless --freeze-vision keeps it,
# as LLaVA keeps its CLIP encoder frozen: only the merger (the projector into the decoder) trains. Frozen from the
# start, the tower was never read at all, not even its colours (run R). --vision-lr-scale trains it at a fraction of
# the learning rate, between the two. None of these flags is in the shipped recipe.
VISION_ATTRIBUTES = {"size": S.SIZES, "colour": tuple(S.COLOURS), "texture": S.TEXTURES, "shape": S.SHAPES}
VISION_BATCH = 16
VISION_INDEX_BASE = 10**9  # scene indices of the vision stage: apart from the main stage's step * 64 + i
_PHRASE = re.compile(r"\ba (\w+) (\w+) (\w+) (\w+)\b")  # "a <size> <colour> <texture> <shape>"


def vision_batch(seed: int, step: int, layout: str, n: int = VISION_BATCH):
    """``n`` scenes of one object, alternately on BOOTSTRAP_LAYOUT's flat canvas and on ``layout``'s (at full
    strength): (pixel_values, grid_thw (n, 3), labels (n, len(VISION_ATTRIBUTES)), each the attribute's index in its
    VISION_ATTRIBUTES values). A pure function of its arguments."""
    import torch

    pix, grids, labels = [], [], []
    for i in range(n):
        frames, text = S.render("detailcaps", seed, VISION_INDEX_BASE + step * 64 + i, n_objects=1,
                                layout=(BOOTSTRAP_LAYOUT, layout)[i % 2])
        words = _PHRASE.search(text).groups()
        labels.append([values.index(w) for values, w in zip(VISION_ATTRIBUTES.values(), words)])
        p, g = patchify(frames)
        pix.append(p)
        grids.append(g)
    return torch.from_numpy(np.concatenate(pix)), torch.tensor(grids), torch.tensor(labels)


class VisionPretrainer(Trainer):
    """--vision-steps: the vision tower alone, trained to name single objects' attributes through one linear head
    per attribute on the max over each image's merged tokens; the text model does not move. Checkpoints to
    ``ckpt_path`` (the tower, the heads, the optimizer) and resumes from it unless --fresh."""

    def __init__(self, args: argparse.Namespace, model, ckpt_path: Path, device):
        import torch

        self.visual = model.model.visual
        width = model.config.vision_config.hidden_size  # the merger's output: the decoder's width
        with torch.random.fork_rng(devices=[]):  # the heads' init follows --seed and leaves the global RNG alone
            torch.manual_seed(args.seed)
            self.heads = torch.nn.ModuleDict(
                {k: torch.nn.Linear(width, len(v)) for k, v in VISION_ATTRIBUTES.items()}).to(device)
        self.stage = torch.nn.ModuleDict({"visual": self.visual, "heads": self.heads})
        opt = make_optimizer(self.stage, args)
        step, elapsed = 0, 0.0
        if ckpt_path.exists() and not args.fresh:
            ck = torch.load(ckpt_path, map_location=device, weights_only=False)  # our own checkpoint
            check_recipe(ck, args, ckpt_path, VISION_RECIPE)  # one vision stage may start several main stages
            note_threads(ck, args, ckpt_path)
            self.stage.load_state_dict(ck["stage"])
            opt.load_state_dict(ck["opt"])
            step, elapsed = ck["step"], ck["elapsed"]
            print(f"resumed the vision stage from {ckpt_path} at step {step}", flush=True)
        super().__init__(args, model, opt, None, ckpt_path, step, elapsed)
        self.total = args.vision_steps
        self.held_out = vision_batch(S.HELDOUT_SEED, 0, args.layout, n=64)

    def logits(self, pixel_values, grid_thw):
        """(B, attributes, most values) per image; the padding of attributes with fewer values is -inf."""
        import torch

        merged = self.visual(pixel_values, grid_thw=grid_thw).pooler_output  # (sum of merged tokens, width)
        sizes = (grid_thw.prod(-1) // self.visual.spatial_merge_size ** 2).tolist()
        pooled = torch.stack([t.max(0).values for t in merged.split(sizes)])  # (B, width)
        most = max(len(v) for v in VISION_ATTRIBUTES.values())
        return torch.stack([torch.nn.functional.pad(h(pooled), (0, most - h.out_features), value=float("-inf"))
                            for h in self.heads.values()], 1)

    def lr(self) -> float:
        return cosine_lr(self.args.lr, min(self.args.warmup, self.total // 10), self.total, self.step)

    def train_step(self, meter: Meter) -> None:
        import torch

        batch = vision_batch(self.args.seed, self.step, self.args.layout)
        pixel_values, grid_thw, labels = (t.to(self.device) for t in batch)
        self.last_lr = self.lr()
        for g in self.opt.param_groups:
            g["lr"] = self.last_lr
        logits = self.logits(pixel_values, grid_thw)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.stage.parameters(), 1.0)
        self.opt.step()
        self.step += 1
        with torch.no_grad():
            meter.add(loss, logits, labels, labels.shape[0])

    def held_out_accuracy(self) -> dict[str, float]:
        """Each head's accuracy on 64 held-out single-object scenes (32 on each canvas)."""
        import torch

        pixel_values, grid_thw, labels = (t.to(self.device) for t in self.held_out)
        with torch.no_grad():
            hits = (self.logits(pixel_values, grid_thw).argmax(-1) == labels).float().mean(0)
        return dict(zip(VISION_ATTRIBUTES, hits.tolist()))

    def log(self, meter: Meter) -> None:
        print("vision ", end="")
        super().log(meter)
        if self.step % 100 == 0 or self.step == self.total:
            acc = self.held_out_accuracy()
            print("  held-out " + " ".join(f"{k} {v:.2f}" for k, v in acc.items()), flush=True)

    def checkpoint(self) -> None:
        _atomic_torch_save({"stage": self.stage.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                            "elapsed": self.elapsed_before + time.time() - self.t_start, "args": vars(self.args)},
                           self.ckpt_path)


def training_attention(model, args: argparse.Namespace, polish: bool = False) -> None:
    """The attention implementations a training stage (the polish stage with ``polish``) runs with (the saved model
    goes back to SDPA): the vision tower's attention over ~1,300 patches of 16-dim heads runs ~13% faster eager than
    SDPA on CPU, and --ground-loss and, in the polish stage, --polish-share-loss read the decoder's attention
    weights, which only eager attention returns."""
    reads = args.ground_loss or polish and args.polish_share_loss
    model.set_attn_implementation({"vision_config": "eager", **({"text_config": "eager"} if reads else {})})


def polish_mix(spec: list[str] | None, polish_steps: int) -> dict[str, float] | None:
    """--polish-mix's TASK=W words as {task: weight} in S.TASKS order (None: the last phase's mix)."""
    if spec is None:
        return None
    if not polish_steps:
        raise SystemExit(f"--polish-mix {' '.join(spec)} sets the polish stage's tasks: pass --polish-steps")
    mix = {}
    for word in spec:
        task, _, w = word.partition("=")
        try:
            weight = float(w)
        except ValueError:
            weight = -1.0
        if task not in S.TASKS or task in mix or not 0 <= weight < float("inf"):
            raise SystemExit(f"--polish-mix {word!r}: give each of {', '.join(S.TASKS)} at most once, as TASK=W "
                             "with a weight W >= 0")
        mix[task] = weight
    if not sum(mix.values()) > 0:
        raise SystemExit(f"--polish-mix {' '.join(spec)}: give some task a weight > 0")
    return {t: mix[t] for t in S.TASKS if t in mix}


def build_run_model(args: argparse.Namespace, tok, device):
    """The model a run of ``args`` starts from before any checkpoint (--size, --seed, --sink, --hold-sink,
    --init-from), and its ``HeldSink`` (None without --hold-sink)."""
    if args.sink and args.hold_sink:
        raise SystemExit("--sink plants a sink that training may remove, --hold-sink one it may not: pass one")
    if args.sink_logit != HELD_SINK_LOGIT and not args.hold_sink:
        raise SystemExit(f"--sink-logit {args.sink_logit} sets the held sink's logit: pass --hold-sink too")
    if args.sink_ramp is not None and not (args.hold_sink and 0.0 <= args.sink_ramp[0] < args.sink_ramp[1] <= 1.0):
        raise SystemExit(f"--sink-ramp {args.sink_ramp}: give fractions FROM < TO of --steps in [0, 1], with "
                         "--hold-sink")
    if args.freeze_vision and args.vision_lr_scale != 1.0:
        raise SystemExit(f"--vision-lr-scale {args.vision_lr_scale} slows the tower that --freeze-vision freezes: "
                         "pass one")
    if not args.vision_lr_scale > 0:
        raise SystemExit(f"--vision-lr-scale {args.vision_lr_scale}: give a fraction > 0 (--freeze-vision stops "
                         "the tower)")
    args.ground_tasks = sorted(set(args.ground_tasks))  # one spelling per set, for the recipe check
    args.polish_ground_tasks = sorted(set(args.polish_ground_tasks or args.ground_tasks))
    last_phase = CURRICULUM[-2][0]  # where the curriculum's last phase starts, as a fraction of --steps
    if not 0 <= args.polish_steps <= (1 - last_phase) * args.steps:
        raise SystemExit(f"--polish-steps {args.polish_steps}: give 0 to {int((1 - last_phase) * args.steps)} (its "
                         f"batches are the last phase's, the last {1 - last_phase:.0%} of --steps)")
    if not args.polish_lr > 0:
        raise SystemExit(f"--polish-lr {args.polish_lr}: give a learning rate > 0")
    if not 0 <= args.polish_cooldown <= 1:
        raise SystemExit(f"--polish-cooldown {args.polish_cooldown}: give the fraction of --polish-steps to cool "
                         "down over, 0 to 1")
    if args.polish_cooldown and not args.polish_steps:
        raise SystemExit(f"--polish-cooldown {args.polish_cooldown} acts in the polish stage: pass --polish-steps")
    if args.polish_seed is None:
        args.polish_seed = args.seed + 1
    args.polish_mix = polish_mix(args.polish_mix, args.polish_steps)
    for flag, seed in (("--seed", args.seed), ("--polish-seed", args.polish_seed)):
        if seed == S.HELDOUT_SEED:  # scene (seed, i) is the same scene in training and in evaluation
            raise SystemExit(f"{flag} {seed}: that is the seed held-out evaluation draws its scenes with "
                             "(synthetic.HELDOUT_SEED; --polish-seed defaults to --seed + 1); give another")
    if args.ground_loss < 0:
        raise SystemExit(f"--ground-loss {args.ground_loss}: give a weight >= 0")
    if args.polish_share_loss < 0:
        raise SystemExit(f"--polish-share-loss {args.polish_share_loss}: give a weight >= 0")
    if args.polish_share_loss and not args.polish_steps:
        raise SystemExit(f"--polish-share-loss {args.polish_share_loss} acts in the polish stage: pass --polish-steps")
    targets = args.polish_share_target if isinstance(args.polish_share_target, list) else [args.polish_share_target]
    if not all(0 <= t < 1 for t in targets):
        raise SystemExit(f"--polish-share-target {args.polish_share_target}: give shares in [0, 1)")
    if args.ground_loss and "detailcaps" in args.ground_tasks and not S.get_layout(args.layout).every_cell:
        raise SystemExit(f"--ground-loss needs a --layout whose descriptions walk every cell (v3 and later), "
                         f"not {args.layout}")
    n_layers = MODEL_SIZES[args.size]["layers"]
    if not -n_layers <= args.ground_layer < n_layers:
        raise SystemExit(f"--ground-layer {args.ground_layer}: --size {args.size} has {n_layers} decoder layers")
    if args.polish_ground_spread is not None:
        if not (args.polish_steps and args.ground_loss):
            raise SystemExit(f"--polish-ground-spread {' '.join(args.polish_ground_spread)} acts on --ground-loss in "
                             "the polish stage: pass --polish-steps and --ground-loss")
        args.polish_ground_spread = sorted(set(args.polish_ground_spread))  # one spelling, for the recipe
    if args.polish_ground_layers is not None:
        if not args.polish_steps or not args.ground_loss:
            raise SystemExit(f"--polish-ground-layers {args.polish_ground_layers} acts on --ground-loss in the polish "
                             "stage: pass --polish-steps and --ground-loss")
        if not all(-n_layers <= i < n_layers for i in args.polish_ground_layers):
            raise SystemExit(f"--polish-ground-layers {args.polish_ground_layers}: --size {args.size} has decoder "
                             f"layers 0 to {n_layers - 1}")
        args.polish_ground_layers = sorted({i % n_layers for i in args.polish_ground_layers})  # one spelling
    if args.polish_share_layers is not None:
        if not all(0 <= i < n_layers for i in args.polish_share_layers):
            raise SystemExit(f"--polish-share-layers {args.polish_share_layers}: --size {args.size} has decoder "
                             f"layers 0 to {n_layers - 1}")
        if len(targets) not in (1, len(args.polish_share_layers)):
            raise SystemExit(f"--polish-share-target {targets}: give one share, or one per --polish-share-layers "
                             f"{args.polish_share_layers}")
        order = sorted(set(args.polish_share_layers))  # one spelling per set, for the recipe
        if len(targets) > 1:
            per_layer = dict(zip(args.polish_share_layers, targets))
            targets = [per_layer[i] for i in order]
        args.polish_share_layers = order
    elif len(targets) > 1:
        raise SystemExit(f"--polish-share-target {targets}: one share per layer needs --polish-share-layers")
    args.polish_share_target = targets[0] if len(targets) == 1 else targets  # one share: a number, as recorded before
    model = build_model(tok, args.size, seed=args.seed).to(device)
    if args.sink:
        plant_attention_sink(model, tok.convert_tokens_to_ids(SPECIAL_TOKENS["im_start"]))
    sink = HeldSink(model, tok.convert_tokens_to_ids(SYSTEM_PROMPT_ROLE), logit=sink_logit_at(args, 0)) \
        if args.hold_sink else None
    if args.init_from:
        init_weights_from(model, args.init_from)
        if sink is not None:
            sink.restore()
    return model, sink


def main(argv=None):
    args = parse_args(argv)
    import torch

    if args.threads != "auto":
        torch.set_num_threads(int(args.threads))
    device = torch.device(args.device)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = run_dir / "ckpt.pt"
    reference = reference_weights(args)

    tok = build_tokenizer()
    processor = build_processor(tok)
    model, sink = build_run_model(args, tok, device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = main_optimizer(model, args)
    step, elapsed_before = 0, 0.0
    resumed = ckpt_path.exists() and not args.fresh
    if resumed:
        step, elapsed_before = load_checkpoint(ckpt_path, model, opt, args, device, resume=not args.export)
    if args.export:
        if not ckpt_path.exists():
            raise SystemExit(f"--export: no checkpoint at {ckpt_path} (check --run-dir)")
        polish = run_dir / "polish.pt"
        if args.polish_steps and polish.exists():  # a polish stage under way: its weights
            step = f"{step} + polish step {load_checkpoint(polish, model, opt, args, device, False, RECIPE)[0]}"
        model.eval()
        save_assets(model.to("cpu").float(), processor, Path(args.export))
        print(f"exported step {step} to {args.export}", flush=True)
        return
    print(f"model: {n_params / 1e6:.2f} M params ({n_params * 4 / 2**20:.1f} MB fp32), device {device}, "
          f"threads {torch.get_num_threads()}, steps {args.steps}", flush=True)

    training_attention(model, args)
    if args.vision_steps and not resumed:  # a run that has not started its main stage
        pre = VisionPretrainer(args, model, run_dir / "vision.pt", device)
        if not pre.run() or pre.step < pre.total:
            print(f"the vision stage stopped at step {pre.step} of {pre.total} (no model saved); run the same "
                  "command to resume", flush=True)
            return
        elapsed_before = pre.elapsed_before + time.time() - pre.t_start
        if args.stop_after is not None:  # --stop-after counts this process's steps of both stages
            args.stop_after -= pre.step - pre.start_step
    freeze_tower(model, args)
    trainer = Trainer(args, model, opt, BatchBuilder(processor), ckpt_path, step, elapsed_before, sink)
    if not trainer.run():
        return
    total, steps = elapsed_before + time.time() - trainer.t_start, f"{trainer.step} steps"
    if args.polish_steps and trainer.step >= args.steps:  # not after a main stage cut short by --minutes
        if args.stop_after is not None:
            args.stop_after -= trainer.step - trainer.start_step
        training_attention(model, args, polish=True)
        polish = Polisher(args, model, opt, trainer.builder, run_dir / "polish.pt", total, sink)
        if not polish.run():
            return
        total, steps = polish.elapsed_before + time.time() - polish.t_start, f"{steps} + {polish.step} polish steps"
    model.set_attn_implementation({"vision_config": "sdpa", "text_config": "sdpa"})
    model.eval()
    save_assets(model.to("cpu").float(), processor, Path(args.out))
    (run_dir / "train_summary.json").write_text(json.dumps(
        {"steps": trainer.step, "polish_steps": args.polish_steps, "train_minutes": total / 60, "params": n_params,
         "out": str(args.out), "args": vars(args)}, indent=2))
    print(f"saved {args.out} after {steps}, {total / 60:.1f} min of training", flush=True)
    if reference is not None:
        print(weights_verdict(Path(args.out), reference, args.same_as), flush=True)
    if trainer.auto_threads:
        print("(--threads auto: the thread count followed the machine's load, so a rerun matches these weights only "
              "in distribution; pass --threads N for weights a rerun at N threads reproduces bit for bit)", flush=True)


if __name__ == "__main__":
    main()
