"""The callable class that Ray Data runs in each actor: load the model once, evaluate batches of samples.

``SampleEvaluator(config)`` loads the model in ``__init__`` (on the actor's GPU when it has one) and
``__call__(batch)`` maps a batch of input rows to output rows, one per (sample, method), as a
``pyarrow.Table`` in ``OUTPUT_SCHEMA``. It works on a plain dict of columns, so it is testable without Ray::

    ev = SampleEvaluator(cfg.to_dict())
    table = ev({"sample_id": [...], "task": [...], "prompt": [...], "images": [[png_bytes]], ...})

Per sample, the model work is one call into the core, ``rcr.generate`` (one shared prefill, then ``full``
and every requested method decoded from it). A sample whose input is bad, or whose model call raises,
becomes one error row per requested method; the batch goes on.
"""

from __future__ import annotations

import importlib
import io
import logging
import os
import time
import traceback
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.config import TASKS, JobConfig

log = logging.getLogger(__name__)

METHODS_COLUMN = "_methods"  # optional input column: the methods still missing for this sample (resume)
BAD_TEXT_KEY = "_bad_text"  # set on a row (by table_rows) whose string field is not valid UTF-8: its name


class BadInput(ValueError):
    """A sample's input cannot be evaluated; the message says why."""


# ---------------------------------------------------------------------- input checks


def load_images(images: Any, task: str, cfg: JobConfig) -> list:
    """Decode and check a sample's images; return RGB PIL images or raise :class:`BadInput`.

    Greyscale, palette, RGBA (composited on white), CMYK and 16-bit images are converted to RGB: real
    datasets hold them, and the processors expect 3 channels.
    """
    from PIL import Image

    frames = list(images) if images is not None else []
    if not frames:
        raise BadInput("video has 0 frames" if task == "video" else "sample has no image")
    if task != "video" and len(frames) != 1:
        raise BadInput(f"expected 1 image for task '{task}', got {len(frames)}")
    if len(frames) > cfg.max_frames:
        raise BadInput(f"video has {len(frames)} frames, more than max_frames={cfg.max_frames}")
    what = "frame" if task == "video" else "image"
    out = []
    for i, data in enumerate(frames):
        if data is None or len(data) == 0:
            raise BadInput(f"{what} {i} is empty (0 bytes)")
        if len(data) > cfg.max_image_bytes:
            raise BadInput(f"{what} {i} is {len(data) / 2**20:.1f} MiB, more than max_image_bytes="
                           f"{cfg.max_image_bytes}")
        try:
            img = Image.open(io.BytesIO(bytes(data)))
            w, h = img.size  # read from the header, before any pixel is decoded
        except Exception as e:  # noqa: BLE001
            raise BadInput(f"{what} {i} is corrupt or not an image ({type(e).__name__}: {e})") from None
        if w * h > cfg.max_image_pixels:
            raise BadInput(f"{what} {i} is huge: {w}x{h} = {w * h / 1e6:.1f} MP, more than max_image_pixels="
                           f"{cfg.max_image_pixels / 1e6:.1f} MP")
        if w < 1 or h < 1:
            raise BadInput(f"{what} {i} has size {w}x{h}")
        try:
            img.load()
        except Exception as e:  # noqa: BLE001 - truncated or otherwise undecodable pixel data
            raise BadInput(f"{what} {i} is corrupt ({type(e).__name__}: {e})") from None
        out.append(to_rgb(img))
    if task == "video" and len({im.size for im in out}) > 1:
        raise BadInput(f"video frames differ in size: {sorted({im.size for im in out})}")
    return out


def to_rgb(img):
    from PIL import Image

    if img.mode == "RGB":
        return img
    if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        a = np.asarray(img, dtype=np.float64)
        lo, hi = float(a.min()), float(a.max())
        a = (a - lo) / (hi - lo) * 255.0 if hi > lo else np.zeros_like(a)
        return Image.fromarray(a.astype(np.uint8), "L").convert("RGB")
    if img.mode == "P":
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "RGBa", "La", "PA"):
        rgba = img.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(bg, rgba).convert("RGB")
    return img.convert("RGB")  # L, 1, CMYK, YCbCr, LAB, HSV


def check_prompt(prompt: Any) -> str:
    if prompt is None or not str(prompt).strip():
        raise BadInput("prompt is empty")
    return str(prompt)


# ---------------------------------------------------------------------- rows


def base_row(sample: dict, method: str, cfg: JobConfig, config_hash: str, key: str | None = None) -> dict:
    refs = sample.get("references")
    return {
        "sample_id": key if key is not None else str(sample.get("sample_id")),
        "method": method,
        "task": sample.get("task") or cfg.task,
        "source": sample.get("source"),
        "model": cfg.model,
        "config_hash": config_hash,
        "job_name": cfg.job_name,
        "prompt": sample.get("prompt"),
        "references": [str(r) for r in refs] if refs is not None else [],
    }


def error_rows(sample: dict, methods: list[str], message: str, cfg: JobConfig, config_hash: str,
               key: str | None = None) -> list[dict]:
    rows = []
    for m in methods:
        r = base_row(sample, m, cfg, config_hash, key)
        r.update(error=message, n_steps=0)
        rows.append(r)
    return rows


def _ll(a, dtype) -> list | None:
    if a is None:
        return None
    arr = np.asarray(a)
    if arr.ndim != 2:
        arr = arr.reshape(arr.shape[0], -1) if arr.ndim > 2 else np.atleast_2d(arr)
    return arr.astype(dtype).tolist()


def _f(x) -> float | None:
    if x is None:
        return None
    x = float(x)
    return None if np.isnan(x) else x


def result_row(sample: dict, method: str, s: dict, text: str, cfg: JobConfig, config_hash: str,
               timing: dict) -> dict:
    """An ok row from ``GenerationResult.sample(b)``."""
    r = base_row(sample, method, cfg, config_hash)
    tokens = np.asarray(s.get("tokens", []), dtype=np.int64)
    drift = s.get("drift")
    n_layers = s.get("n_layers")
    if n_layers is None and drift is not None:
        n_layers = int(np.asarray(drift).shape[0])
    r.update(
        output_text=text,
        output_ids=tokens.astype(np.int32).tolist(),
        n_steps=int(s.get("n_steps", len(tokens))),
        n_layers=None if n_layers is None else int(n_layers),
        prefix_len=None if s.get("prefix_len") is None else int(s["prefix_len"]),
        refresh_fraction=_f(s.get("refresh_fraction")),
        mean_drift=_f(s.get("mean_drift")),
        mean_drift_exact=_f(s.get("mean_drift_exact")),
        keys_read_per_step=_f(s.get("keys_read_per_step")),
        values_read_per_step=_f(s.get("values_read_per_step")),
        detector_dots_per_step=_f(s.get("detector_dots_per_step")),
        bytes_moved_per_step=_f(s.get("bytes_moved_per_step")),
        drift=_ll(drift, np.float32),
        drift_exact=_ll(s.get("drift_exact"), np.float32),
        trigger=_ll(s.get("trigger"), bool),
        tau=_ll(s.get("tau"), np.float32),
        top_prefix_pos=_ll(s.get("top_prefix_pos"), np.int32),
        prefill_s=timing.get("prefill_s"),
        decode_s=timing.get("decode_s"),
        tokens_per_s=timing.get("tokens_per_s"),
        error=None,
    )
    return r


def batch_to_rows(batch: Any) -> list[dict]:
    """A Ray/pyarrow/pandas/dict-of-columns batch -> list of row dicts."""
    if isinstance(batch, pa.Table):
        return table_rows(batch)
    try:
        import pandas as pd

        if isinstance(batch, pd.DataFrame):
            return batch.to_dict("records")
    except ImportError:
        pass
    if isinstance(batch, dict):
        cols = {k: list(v) for k, v in batch.items()}
        n = len(next(iter(cols.values()))) if cols else 0
        return [{k: v[i] for k, v in cols.items()} for i in range(n)]
    if isinstance(batch, list):
        return list(batch)
    raise TypeError(f"unsupported batch type {type(batch).__name__}")


def table_rows(table: pa.Table) -> list[dict]:
    """``table.to_pylist()``, except that a row whose string cell is not valid UTF-8 (Parquet does not check
    it) gets that text decoded with U+FFFD replacements and ``BAD_TEXT_KEY`` set to the column name, so it
    becomes that sample's error rows instead of failing the whole batch."""
    try:
        return table.to_pylist()
    except UnicodeDecodeError:
        pass
    rows = []
    for i in range(table.num_rows):
        one = table.slice(i, 1)
        try:
            rows.append(one.to_pylist()[0])
            continue
        except UnicodeDecodeError:
            pass
        row, bad = {}, None
        for name in one.column_names:
            col = one.column(name)
            try:
                row[name] = col.to_pylist()[0]
            except UnicodeDecodeError:
                raw = col.cast(pa.large_binary()).to_pylist()[0]
                row[name] = raw.decode("utf-8", errors="replace")
                bad = bad or name
        row[BAD_TEXT_KEY] = bad
        rows.append(row)
    return rows


# ---------------------------------------------------------------------- engine


class RcrEngine:
    """The model work: the core library's loader, input builder and ``rcr.generate``."""

    def __init__(self, cfg: JobConfig, device: str, dtype: str):
        import torch

        import rcr
        import rcr.models

        self.torch = torch
        self.rcr = rcr
        self.device = device
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        self.model, self.processor = rcr.models.load(cfg.model_path(), device=device, dtype=torch_dtype,
                                                     trust_remote_code=cfg.trust_remote_code)
        self.rcr_config = rcr.RCRConfig(**cfg.rcr)
        self.max_new_tokens = cfg.max_new_tokens

    def run(self, prompts: list[str], images: list[list], methods: list[str], task: str):
        """One left-padded batch, one shared prefill, every method -> label -> GenerationResult."""
        inputs = self.rcr.models.build_inputs(self.processor, prompts, images, video=(task == "video"))
        self.check_context(int(inputs["input_ids"].shape[1]))
        inputs = inputs.to(self.device)
        with self.torch.inference_mode():
            results = self.rcr.generate(self.model, inputs, method=list(methods),
                                        max_new_tokens=self.max_new_tokens, config=self.rcr_config)
        return results

    def check_context(self, n_input: int) -> None:
        """A prompt plus image(s) that leaves no room for max_new_tokens is a bad input, not a model crash.
        With several samples the longest one sets ``n_input``; the batch is then retried sample by sample."""
        text_cfg = self.model.config.get_text_config()
        ctx = getattr(text_cfg, "max_position_embeddings", None)
        if ctx and n_input + self.max_new_tokens > ctx:
            raise BadInput(f"prompt + image(s) are {n_input} tokens; with max_new_tokens={self.max_new_tokens} "
                           f"that exceeds the model's context of {ctx} tokens")

    def decode(self, ids) -> str:
        tok = getattr(self.processor, "tokenizer", self.processor)
        return tok.decode(list(map(int, ids)), skip_special_tokens=True)

    def recover(self) -> None:
        if self.device.startswith("cuda"):
            self.torch.cuda.empty_cache()


def _import_engine(spec: str):
    if spec == "rcr":
        return RcrEngine
    mod, _, attr = spec.partition(":")
    return getattr(importlib.import_module(mod), attr)


# ---------------------------------------------------------------------- the callable class


class SampleEvaluator:
    """Ray Data callable class: the model is loaded once per actor, in ``__init__``."""

    def __init__(self, config: dict, config_hash: str | None = None):
        self.cfg = JobConfig.from_dict(config, validate=False)
        self.config_hash = config_hash or self.cfg.config_hash
        import torch
        from PIL import Image

        Image.MAX_IMAGE_PIXELS = None  # our own limit (max_image_pixels) is checked from the header
        if self.cfg.torch_threads:
            torch.set_num_threads(self.cfg.torch_threads)
        want = self.cfg.device
        if want == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device=cuda but this worker sees no CUDA device "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        self.device = "cuda" if (want in ("auto", "cuda") and torch.cuda.is_available()) else "cpu"
        dtype = self.cfg.dtype
        if dtype == "auto":
            dtype = "bfloat16" if self.device == "cuda" else "float32"
        self.dtype = dtype
        t0 = time.perf_counter()
        self.engine = _import_engine(self.cfg.engine)(self.cfg, self.device, dtype)
        self.load_s = time.perf_counter() - t0
        log.info("SampleEvaluator: %s on %s/%s loaded in %.1fs (pid %d)", self.cfg.model, self.device, dtype,
                 self.load_s, os.getpid())

    def __call__(self, batch: Any) -> pa.Table:
        from pipeline.schema import output_table

        rows_in = batch_to_rows(batch)
        out: list[dict] = []
        good: list[tuple[dict, list, list[str]]] = []
        for sample in rows_in:
            methods = sample.get(METHODS_COLUMN)
            methods = list(methods) if methods is not None and len(methods) else list(self.cfg.methods)
            try:
                if sample.get(BAD_TEXT_KEY):
                    raise BadInput(f"{sample[BAD_TEXT_KEY]} is not valid UTF-8")
                if (sample.get("task") or self.cfg.task) not in TASKS:
                    raise BadInput(f"unknown task {sample.get('task')!r}; expected one of {', '.join(TASKS)}")
                prompt = check_prompt(sample.get("prompt"))
                images = load_images(sample.get("images"), sample.get("task") or self.cfg.task, self.cfg)
            except BadInput as e:
                out.extend(error_rows(sample, methods, f"bad input: {e}", self.cfg, self.config_hash))
                continue
            sample = dict(sample, prompt=prompt, task=sample.get("task") or self.cfg.task)
            good.append((sample, images, methods))
        by_task: dict[str, list] = {}
        for item in good:  # a model batch holds one task (image vs video inputs)
            by_task.setdefault(item[0]["task"], []).append(item)
        for items in by_task.values():
            for i in range(0, len(items), self.cfg.batch_size):
                out.extend(self._evaluate(items[i:i + self.cfg.batch_size]))
        return output_table(out)

    def _evaluate(self, chunk: list[tuple[dict, list, list[str]]]) -> list[dict]:
        """Run one model batch; on failure, retry sample by sample so only the failing one errors."""
        try:
            return self._generate(chunk)
        except Exception as e:  # noqa: BLE001 - a failing sample must not stop the job
            self.engine.recover()
            if len(chunk) > 1:
                log.warning("batch of %d failed (%s: %s); retrying one by one", len(chunk), type(e).__name__, e)
                rows: list[dict] = []
                for item in chunk:
                    rows.extend(self._evaluate([item]))
                return rows
            sample, _, methods = chunk[0]
            if isinstance(e, BadInput):  # found by the engine (e.g. longer than the model's context)
                return error_rows(sample, methods, f"bad input: {e}", self.cfg, self.config_hash)
            where = traceback.extract_tb(e.__traceback__)[-1]
            msg = f"model error: {type(e).__name__}: {e} (at {os.path.basename(where.filename)}:{where.lineno})"
            log.warning("sample %s: %s", sample.get("sample_id"), msg)
            return error_rows(sample, methods, msg, self.cfg, self.config_hash)

    def _generate(self, chunk: list[tuple[dict, list, list[str]]]) -> list[dict]:
        union: list[str] = []
        for _, _, methods in chunk:
            union.extend(m for m in methods if m not in union)
        if "full" not in union:
            union.insert(0, "full")
        results = self.engine.run([c[0]["prompt"] for c in chunk], [c[1] for c in chunk], union,
                                  task=chunk[0][0]["task"])
        rows: list[dict] = []
        for b, (sample, _, methods) in enumerate(chunk):
            for m in methods:
                res = results[m]
                s = res.sample(b)
                decode_s = _f(getattr(res, "decode_s", None))
                n_tok = int(np.asarray(res.lengths).sum()) if hasattr(res, "lengths") else None
                timing = {
                    "prefill_s": _f(getattr(res, "prefill_s", None)),
                    "decode_s": decode_s,
                    "tokens_per_s": (n_tok / decode_s) if (decode_s and n_tok is not None) else None,
                }
                rows.append(result_row(sample, m, s, self.engine.decode(s.get("tokens", [])), self.cfg,
                                       self.config_hash, timing))
        return rows
