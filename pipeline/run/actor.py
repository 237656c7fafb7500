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
import logging
import os
import sys
import time
import traceback
from typing import Any

import pyarrow as pa

from pipeline.data.images import BadInput, load_sample_images
from pipeline.quiet import quiet_model_loading
from pipeline.run.calibration import prepare_methods
from pipeline.run.config import JobConfig, default_max_new_tokens
from pipeline.run.select import METHODS_COLUMN  # optional input column: the methods still missing (resume)
from pipeline.schema import JobStamp, error_rows, output_row, output_table
from pipeline.tasks import TASKS

log = logging.getLogger(__name__)

BAD_TEXT_KEY = "_bad_text"  # set on a row (by table_rows) whose string field is not valid UTF-8: its name


def check_prompt(prompt: Any) -> str:
    if prompt is None or not str(prompt).strip():
        raise BadInput("prompt is empty")
    return str(prompt)


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


def ray_node_id() -> str | None:
    """The id of the Ray node this process runs on (an actor restarted elsewhere gets its new node's);
    None outside Ray, e.g. the evaluator called directly. Ray is only asked if this process imported it."""
    ray = sys.modules.get("ray")
    return ray.get_runtime_context().get_node_id() if ray is not None and ray.is_initialized() else None


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
        with quiet_model_loading():  # the driver's progress line says the actors are loading
            self.model, self.processor = rcr.models.load(cfg.model_path(), device=device, dtype=torch_dtype,
                                                         trust_remote_code=cfg.trust_remote_code)
        rcr.models.limit_image_tokens(self.processor, cfg.max_image_tokens)  # Qwen: --max-image-tokens
        self.rcr_config = rcr.RCRConfig(**cfg.rcr)
        self.labels = list(cfg.methods)
        self.methods: dict = {}  # label -> its method, built once (``method``): prepare() may calibrate it
        self.model_dir = cfg.model_path()
        self.limits = (cfg.max_frames, cfg.max_image_bytes, cfg.max_image_pixels)
        self.max_new_tokens = cfg.max_new_tokens
        self.model_name = cfg.model
        self.geometry = rcr.models.geometry(self.model)
        self.reselected: tuple[bool, ...] | None = None  # as last logged

    def prepare(self, payload: dict | None) -> None:
        """Each method's set-up for this model, once (``pipeline/run/calibration.py``): ``payload`` is what the
        driver resolved (the calibration records, and held-out rows for the methods that calibrate on them)."""
        prepare_methods([self.method(label) for label in self.labels], self.model, self.processor, self.model_dir,
                        payload, self.limits)

    def method(self, label: str):
        if label not in self.methods:
            self.methods[label] = self.rcr.parse_method(label, self.rcr_config)
        return self.methods[label]

    def run(self, prompts: list[str], images: list[list], methods: list[str], task: str):
        """One left-padded batch, one shared prefill, every method -> label -> GenerationResult."""
        inputs = self.rcr.models.build_inputs(self.processor, prompts, images, video=TASKS[task].video)
        self.check_context(int(inputs["input_ids"].shape[1]))
        self.log_reselected(int(inputs["input_ids"].shape[1]))
        inputs = inputs.to(self.device)
        chosen = [self.method(m) for m in methods]
        with self.torch.inference_mode():
            results = self.rcr.generate(self.model, inputs, method=chosen, max_new_tokens=self.max_new_tokens,
                                        config=self.rcr_config)
        return results

    def check_context(self, n_input: int) -> None:
        """A prompt plus image(s) that leaves no room for max_new_tokens is a bad input, not a model crash.
        With several samples the longest one sets ``n_input``; the batch is then retried sample by sample."""
        text_cfg = self.model.config.get_text_config()
        ctx = getattr(text_cfg, "max_position_embeddings", None)
        if ctx and n_input + self.max_new_tokens > ctx:
            raise BadInput(f"prompt + image(s) are {n_input} tokens; with max_new_tokens={self.max_new_tokens} "
                           f"that exceeds the model's context of {ctx} tokens")

    def log_reselected(self, n_input: int) -> None:
        """Once per model (and again only if a batch's context changes it): the layers a method re-selects. A
        sliding window that cannot exclude any entry of the context is global (rcr.models.window_over). Printed:
        Ray forwards an actor's stdout to the job's output, not its INFO log records."""
        flags = self.geometry.reselected(n_input + self.max_new_tokens - 1)
        if flags != self.reselected:
            self.reselected = flags
            print(f"[rcr-job] {self.model_name}: re-selected layers: {sum(flags)} of {len(flags)}", flush=True)

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

    def __init__(self, config: dict, config_hash: str | None = None, calibration: dict | None = None):
        """``calibration``: the methods' calibrations as the driver resolved them (``CalibrationPlan.payload``);
        the engine prepares its methods with them once, before the first batch."""
        self.cfg = JobConfig.from_dict(config, validate=False)  # the driver validated it (paths are its own)
        if self.cfg.max_new_tokens is None:  # a hand-written config: the task's default, as validate() fills in
            self.cfg.max_new_tokens = default_max_new_tokens(self.cfg.task)
        self.job = JobStamp(model=self.cfg.model, config_hash=config_hash or self.cfg.config_hash,
                            job_name=self.cfg.job_name, task=self.cfg.task, node_id=ray_node_id())
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
        self.dtype = dtype = self.cfg.dtype_on(self.device)
        t0 = time.perf_counter()
        self.engine = _import_engine(self.cfg.engine)(self.cfg, self.device, dtype)
        if calibration is not None:
            self.engine.prepare(calibration)
        self.load_s = time.perf_counter() - t0
        log.info("SampleEvaluator: %s on %s/%s loaded in %.1fs (pid %d)", self.cfg.model, self.device, dtype,
                 self.load_s, os.getpid())

    def __call__(self, batch: Any) -> pa.Table:
        out: list[dict] = []
        by_task: dict[str, list] = {}  # a model batch holds one task (image vs video inputs)
        for sample in batch_to_rows(batch):
            methods = sample.get(METHODS_COLUMN)
            methods = list(methods) if methods is not None and len(methods) else list(self.cfg.methods)
            try:
                sample, images = self._check(sample)
            except BadInput as e:
                out.extend(error_rows(self.job, sample, methods, f"bad input: {e}"))
                continue
            by_task.setdefault(sample["task"], []).append((sample, images, methods))
        for items in by_task.values():
            for i in range(0, len(items), self.cfg.batch_size):
                out.extend(self._evaluate(items[i:i + self.cfg.batch_size]))
        return output_table(out)

    def _check(self, sample: dict) -> tuple[dict, list]:
        """The sample with its task filled in and its prompt checked, and its decoded images; or BadInput."""
        if sample.get(BAD_TEXT_KEY):
            raise BadInput(f"{sample[BAD_TEXT_KEY]} is not valid UTF-8")
        task = sample.get("task") or self.cfg.task
        if task not in TASKS:
            raise BadInput(f"unknown task {sample.get('task')!r}; expected one of {', '.join(TASKS)}")
        prompt = check_prompt(sample.get("prompt"))
        cfg = self.cfg
        images = load_sample_images(sample.get("images"), task, cfg.max_frames, cfg.max_image_bytes,
                                    cfg.max_image_pixels)
        return dict(sample, prompt=prompt, task=task), images

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
                return error_rows(self.job, sample, methods, f"bad input: {e}")
            where = traceback.extract_tb(e.__traceback__)[-1]
            msg = f"model error: {type(e).__name__}: {e} (at {os.path.basename(where.filename)}:{where.lineno})"
            log.warning("sample %s: %s", sample.get("sample_id"), msg)
            return error_rows(self.job, sample, methods, msg)

    def _generate(self, chunk: list[tuple[dict, list, list[str]]]) -> list[dict]:
        """One left-padded batch, one shared prefill, ``full`` and the union of the samples' methods."""
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
                text = self.engine.decode(results[m].sample(b)["tokens"])
                rows.append(output_row(self.job, sample, m, results[m], b, text))
        return rows
