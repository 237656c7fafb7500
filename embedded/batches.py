"""Training batches of the embedded model: synthetic samples turned into exactly what the processor produces,
with the attention targets of the grounding loss, and the single-object batches of the vision stage.

The batches are built with a numpy re-implementation of the processor's patchification (``patchify``), which
tests check against the saved processor's output.
"""

from __future__ import annotations

import re

import numpy as np

from pipeline.data import synthetic as S

from .assets import SPECIAL_TOKENS, processor_inputs

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


# The vision stage's scenes: one object each, labelled with its attributes.
VISION_ATTRIBUTES = {"size": S.SIZES, "colour": tuple(S.COLOURS), "texture": S.TEXTURES, "shape": S.SHAPES}
VISION_BATCH = 16
VISION_INDEX_BASE = 10**9  # scene indices of the vision stage: apart from the main stage's step * 64 + i
_PHRASE = re.compile(r"\ba (\w+) (\w+) (\w+) (\w+)\b")  # "a <size> <colour> <texture> <shape>"


def vision_batch(seed: int, step: int, layout: str, bootstrap_layout: str, n: int = VISION_BATCH):
    """``n`` scenes of one object, alternately on ``bootstrap_layout``'s flat canvas and on ``layout``'s (at full
    strength): (pixel_values, grid_thw (n, 3), labels (n, len(VISION_ATTRIBUTES)), each the attribute's index in its
    VISION_ATTRIBUTES values). A pure function of its arguments."""
    import torch

    pix, grids, labels = [], [], []
    for i in range(n):
        frames, text = S.render("detailcaps", seed, VISION_INDEX_BASE + step * 64 + i, n_objects=1,
                                layout=(bootstrap_layout, layout)[i % 2])
        words = _PHRASE.search(text).groups()
        labels.append([values.index(w) for values, w in zip(VISION_ATTRIBUTES.values(), words)])
        p, g = patchify(frames)
        pix.append(p)
        grids.append(g)
    return torch.from_numpy(np.concatenate(pix)), torch.tensor(grids), torch.tensor(labels)
