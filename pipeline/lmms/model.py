"""The lmms-eval model ``rcr``: any supported VLM decoded by one of ``rcr``'s methods (docs/lmms_eval.md).

    python -m lmms_eval --model rcr --model_args pretrained=embedded,method=rcr --tasks ...

``generate_until`` maps each request onto ``rcr.generate``: the task's prompt and visuals through the family's
chat template (``rcr.models.build_inputs``, left padded), ``max_new_tokens`` from the request, greedy decoding,
and the text cut at the first of the request's ``until`` strings. Requests are batched ``batch_size`` at a time
among those with the same generation arguments and kind of media (images, one video, none); a left-padded
batch decodes every sample with its own threshold and selection, as batch 1 does. What the library cannot
honour is refused before any model work, with one line naming the argument.

Per sample, the method's telemetry (refresh fraction, reads per step, drift; ``pipeline.schema.
telemetry_summary``, the job's own row summaries) and, with ``fidelity=true``, the ROUGE-L fidelity against
``full`` decoded from the same prefill, go into lmms-eval's logged samples under ``token_counts[0]["rcr"]``.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
from lmms_eval.api.instance import GenerationResult, TokenCounts
from lmms_eval.api.model import lmms
from loguru import logger
from PIL import Image
from tqdm import tqdm

import rcr
import rcr.models
from pipeline.analysis.text_metrics import rouge_l_f1
from pipeline.schema import telemetry_summary
from rcr.config import MAX_IMAGE_TOKENS, ConfigError, RCRConfig
from rcr.embedded import NAME as EMBEDDED
from rcr.embedded import resolve as resolve_embedded
from rcr.methods import METHODS, Method
from rcr.methods.knobs import knob_fields, split_label, with_knobs

MODEL_ARGS = ("pretrained", "method", "device", "dtype", "batch_size", "max_batch_size", "fidelity", "max_frames",
              "max_image_tokens", "trust_remote_code")
CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(RCRConfig) if f.name != "extra")
VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_MAX_NEW_TOKENS = 512  # rcr.generate's default, for a task that sets none
# Generation arguments with no effect on a greedy decode once sampling and beams are ruled out: sampling's own
# knobs, and a LLaVA-specific preprocessing hint some task YAMLs carry (the processor sets the resolution here).
GREEDY_NEUTRAL = ("top_p", "top_k", "seed", "use_cache", "image_aspect_ratio")


@dataclass
class RCRTokenCounts(TokenCounts):
    """lmms-eval writes each request's ``TokenCounts.to_dict()`` into its logged sample (``token_counts``), the
    one per-request field a model returns besides its text; the method's telemetry rides along as ``"rcr"``."""

    rcr: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {**super().to_dict(), "rcr": self.rcr}


def decode_plan(gen: dict | None) -> tuple[int, tuple[str, ...]]:
    """(max_new_tokens, stop strings) of one request's generation arguments. What a greedy ``rcr`` decode
    cannot honour raises ConfigError naming the argument."""
    gen = dict(gen or {})
    until = gen.pop("until", None)
    until = [until] if isinstance(until, str) else list(until or [])
    if not all(isinstance(s, str) for s in until):
        raise ConfigError("generation argument until", f"expected a string or a list of strings, got {until!r}")
    max_new = gen.pop("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
        raise ConfigError("generation argument max_new_tokens", f"must be an integer >= 1, got {max_new!r}")
    do_sample, temperature = gen.pop("do_sample", None), gen.pop("temperature", 0) or 0
    # lmms-eval's own HF models sample when temperature > 0 unless do_sample says otherwise
    if do_sample or (do_sample is None and temperature > 0):
        raise ConfigError("generation argument do_sample", f"{do_sample!r} (temperature={temperature!r}): sampling is "
                          "not supported; the rcr model decodes greedily (do_sample=false, temperature=0)")
    beams = gen.pop("num_beams", 1)
    if beams not in (None, 1):
        raise ConfigError("generation argument num_beams", f"{beams!r}: beam search is not supported; the rcr model "
                          "decodes greedily (num_beams=1)")
    for name, neutral in (("repetition_penalty", 1.0), ("num_return_sequences", 1)):
        value = gen.pop(name, neutral)
        if value not in (None, neutral):
            raise ConfigError(f"generation argument {name}", f"{value!r}: not supported; the rcr model decodes "
                              f"greedily ({name}={neutral})")
    for name in GREEDY_NEUTRAL:
        gen.pop(name, None)
    if gen:
        name, value = next(iter(gen.items()))
        raise ConfigError(f"generation argument {name}", f"{value!r}: not supported by the rcr model (it honours "
                          "max_new_tokens and until, and decodes greedily)")
    return max_new, tuple(until)


def _field_value(name: str, value, default):
    """A model arg for a field whose default is ``default``, checked against the default's type (lmms-eval parses
    ``k=v`` into bool, int, float or str)."""
    if isinstance(value, str) and value.lower() == "none" and default is None:
        return None
    ok = {bool: lambda v: isinstance(v, bool), int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str)}.get(type(default), lambda v: isinstance(v, str))
    if not ok(value):
        want = "a string or none" if default is None else type(default).__name__
        raise ConfigError(f"model arg {name}", f"must be {want}, got {value!r}")
    return float(value) if isinstance(default, float) else value


def build_method(method: str, pretrained: str, fields: dict) -> Method:
    """The method of the model args: ``method`` (a label) with the args that are its own knobs (``method=rcr,rho=0.3``:
    lmms-eval splits model args on commas, so a knob can be its own arg) and a config of the shared RCRConfig
    fields. A method that calibrates offline must find its calibration without held-out samples: shipped with the
    checkpoint (the embedded model's), or given (``calibration=DIR``, or ``calibration=per_sample``)."""
    name = split_label(method)[0]
    knobs = {f.name: f.default for f in knob_fields(METHODS[name]).values()} if name in METHODS else {}
    unknown = sorted(set(fields) - set(CONFIG_FIELDS) - set(knobs))
    if unknown:
        raise ConfigError(f"model arg {unknown[0]}", f"unknown (got {fields[unknown[0]]!r}); the rcr model takes "
                          f"{', '.join(MODEL_ARGS)}, the RCRConfig fields ({', '.join(CONFIG_FIELDS)}) and the "
                          f"method's own ({', '.join(knobs) or 'none'})")
    defaults = {f.name: f.default for f in dataclasses.fields(RCRConfig)}
    config = RCRConfig(**{k: _field_value(k, v, defaults[k]) for k, v in fields.items() if k in CONFIG_FIELDS})
    label = with_knobs(method, {k: _field_value(k, v, knobs[k]) for k, v in fields.items() if k in knobs})
    m = rcr.parse_method(label, config)
    model_dir = resolve_embedded(pretrained)
    if m.calibration_samples(model_dir if os.path.isdir(model_dir) else None) > 0:
        raise ConfigError(f"model arg {name}.calibration", f"method={method} is calibrated offline, on samples it is "
                          "not evaluated on, and lmms-eval hands it none: give calibration=DIR (python -m "
                          "rcr.calibrate_infinigen --model M --out DIR) or calibration=per_sample (the ablation)")
    return m


def _device(device: str) -> str:
    if device != "auto":
        return device
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc.type if acc is not None else "cpu"


def _is_video(v) -> bool:
    return isinstance(v, str) and v.lower().endswith(VIDEO_SUFFIXES)


def _flat(visuals) -> list:
    if visuals is None:
        return []
    if isinstance(visuals, (list, tuple)):
        return [v for item in visuals for v in _flat(item)]
    return [visuals]


class RCRModel(lmms):
    """lmms-eval's ``lmms`` interface over ``rcr.generate``; model args: ``MODEL_ARGS`` and any RCRConfig field."""

    is_simple = True

    def __init__(self, pretrained: str = EMBEDDED, method: str = "rcr", device: str = "auto", dtype: str = "auto",
                 batch_size: int | str = 1, max_batch_size: int | None = None, fidelity: bool = False,
                 max_frames: int = 32, max_image_tokens: int = MAX_IMAGE_TOKENS, trust_remote_code: bool = False,
                 **fields):
        super().__init__()
        self.method_ = build_method(method, pretrained, fields)  # every check before the model loads
        self.config, self.method = self.method_.config, self.method_.label
        if not (isinstance(batch_size, int) or str(batch_size).isdigit()) or int(batch_size) < 1:
            raise ConfigError("model arg batch_size", f"{batch_size!r}: must be an integer >= 1 (the rcr model has "
                              "no automatic batch sizing)")
        self.batch_size_per_gpu = int(batch_size)
        for name, value in (("fidelity", fidelity), ("trust_remote_code", trust_remote_code)):
            if not isinstance(value, bool):
                raise ConfigError(f"model arg {name}", f"must be true or false, got {value!r}")
        for name, value in (("max_frames", max_frames), ("max_image_tokens", max_image_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model arg {name}", f"must be an integer >= 1, got {value!r}")
        self.fidelity, self.max_frames = fidelity, max_frames
        if dtype not in DTYPES:
            raise ConfigError("model arg dtype", f"must be one of {', '.join(DTYPES)}, got {dtype!r}")
        try:
            self._device = torch.device(_device(device))
        except (RuntimeError, TypeError) as e:
            raise ConfigError("model arg device", f"not a torch device ({e}), got {device!r}") from None
        self.model, self.processor = rcr.models.load(pretrained, device=self._device, dtype=dtype,
                                                     trust_remote_code=trust_remote_code)
        rcr.models.limit_image_tokens(self.processor, max_image_tokens)  # the pipeline's cap (--max-image-tokens)
        self.method_.prepare(self.model)  # the calibration shipped with the checkpoint, where one does
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.takes_video = getattr(self.processor, "video_processor", None) is not None

    @property
    def batch_size(self) -> int:
        return self.batch_size_per_gpu

    @property
    def device(self) -> torch.device:
        return self._device

    # ------------------------------------------------------------------------------------------ refused
    def loglikelihood(self, requests):
        raise NotImplementedError(
            "loglikelihood (multiple-choice tasks) is not supported by the rcr model: a method re-selects its "
            "cache at each decode step of its own greedy output, and rcr.generate does not teacher-force a given "
            "continuation through those steps; use the task's generate_until variant")

    def generate_until_multi_round(self, requests):
        raise NotImplementedError(
            "generate_until_multi_round is not supported by the rcr model: each round re-prompts with the earlier "
            "rounds' answers, and rcr.generate decodes one prompt per prefill")

    # ------------------------------------------------------------------------------------------ generate
    def _media(self, visuals, task: str) -> tuple[str, list]:
        """("image" | "video" | "text", the PIL images or video frames) of one request's visuals."""
        items = _flat(visuals)
        videos = [v for v in items if _is_video(v)]
        images = [v for v in items if isinstance(v, Image.Image)]
        if len(videos) + len(images) != len(items):
            other = next(v for v in items if not (_is_video(v) or isinstance(v, Image.Image)))
            raise ConfigError(f"task {task}", f"doc_to_visual gave a {type(other).__name__}; the rcr model takes PIL "
                              "images or one video file")
        if not videos:
            return ("image" if images else "text"), [im.convert("RGB") for im in images]
        if images or len(videos) > 1:
            raise ConfigError(f"task {task}", f"doc_to_visual gave {len(videos)} video(s) and {len(images)} image(s); "
                              "the rcr model takes images or one video")
        if not self.takes_video:
            raise ConfigError(f"task {task}", f"it gives a video: model_type {self.model.config.model_type} takes none "
                              "(docs/models.md)")
        from transformers.video_utils import load_video

        def uniform(metadata, **_):  # up to max_frames frames, evenly spaced (every frame of a shorter video)
            total = metadata.total_num_frames
            return np.linspace(0, total - 1, min(self.max_frames, total)).round().astype(int)

        frames, _ = load_video(videos[0], sample_indices_fn=uniform)  # (T, H, W, 3) uint8
        return "video", [Image.fromarray(f) for f in frames]

    def _text(self, tokens: np.ndarray, until: tuple[str, ...]) -> tuple[str, int]:
        """(text cut at the first stop string, tokens it takes): the decode runs to EOS or max_new_tokens, and
        greedy decoding is causal, so the cut text is what stopping at the string would have given; the token
        count trims the telemetry to the steps that produced it."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in until if s) if i >= 0), default=-1)
        if cut < 0:
            return text.strip(), len(tokens)
        stops = [s for s in until if s]
        n = next(n for n in range(1, len(tokens) + 1)
                 if any(s in self.tokenizer.decode(tokens[:n], skip_special_tokens=True) for s in stops))
        return text[:cut].strip(), n

    def _decode(self, prompts: list[str], media: list[list], kind: str, max_new: int, until: tuple[str, ...]):
        """One left-padded batch -> per sample (text, input tokens, telemetry)."""
        inputs = rcr.models.build_inputs(self.processor, prompts, media, video=kind == "video")
        labels = [self.method_] + (["full"] if self.fidelity and self.method != "full" else [])
        with torch.inference_mode():
            out = rcr.generate(self.model, inputs.to(self._device), method=labels, max_new_tokens=max_new,
                               config=self.config)
        res, rows = out[self.method], []
        for b in range(len(prompts)):
            s = res.sample(b)
            text, n = self._text(s["tokens"], until)
            kept = {k: (v[:n] if k == "tokens" else None if v is None else v[:, : max(n - 1, 0)])
                    for k, v in s.items()}  # tokens (n,), telemetry (L, n - 1)
            tel = {"method": self.method, "output_tokens": n, "prefix_len": int(res.prefix_len[b]),
                   **telemetry_summary(kept)}
            if self.fidelity:
                ref = text if self.method == "full" else self._text(out["full"].sample(b)["tokens"], until)[0]
                tel["fidelity"] = rouge_l_f1(ref, text)
            rows.append((text, int(inputs["attention_mask"][b].sum()), tel))
        return rows

    def generate_until(self, requests) -> list[GenerationResult]:
        plans = [decode_plan(r.args[1]) for r in requests]  # every refusal before any model work
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, plan in enumerate(plans):
            groups[plan].append(i)
        results: list[GenerationResult | None] = [None] * len(requests)
        by_task: dict[str, list[dict]] = defaultdict(list)
        pbar = tqdm(total=len(requests), disable=self.rank != 0, desc="rcr responding")
        for (max_new, until), idx in groups.items():
            for start in range(0, len(idx), self.batch_size):
                chunk, kinds = idx[start : start + self.batch_size], defaultdict(list)
                for i in chunk:
                    context, _, doc_to_visual, doc_id, task, split = requests[i].args
                    visuals = doc_to_visual(self.task_dict[task][split][doc_id]) if doc_to_visual else None
                    kind, media = self._media(visuals, task)
                    kinds[kind].append((i, context.replace("<image>", "").strip(), media))
                for kind, items in kinds.items():
                    rows = self._decode([c for _, c, _ in items], [m for _, _, m in items], kind, max_new, until)
                    for (i, context, _), (text, n_in, tel) in zip(items, rows):
                        counts = RCRTokenCounts(input_tokens=n_in, output_tokens=tel["output_tokens"], rcr=tel)
                        results[i] = GenerationResult(text=text, token_counts=counts)
                        by_task[requests[i].args[4]].append(tel)
                        self.cache_hook.add_partial("generate_until", (context, requests[i].args[1]), text)
                pbar.update(len(chunk))
        pbar.close()
        for task, tels in by_task.items():
            logger.info(f"rcr {task}, method {self.method}: {summary_line(tels)}")
        return results


def summary_line(tels: list[dict]) -> str:
    """Means over a task's samples of the logged telemetry (None entries, e.g. full's drift, skipped)."""
    parts = [f"{len(tels)} samples"]
    for key in ("refresh_fraction", "keys_read_per_step", "values_read_per_step", "mean_drift", "fidelity"):
        vals = [t[key] for t in tels if t.get(key) is not None]
        if vals:
            parts.append(f"{key} {float(np.mean(vals)):.4g}")
    return ", ".join(parts)
