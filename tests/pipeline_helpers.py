"""Helpers for the pipeline tests: shards, bad inputs, a fake engine, a tiny saved checkpoint. The local Ray head
and the port pickers are in tests/ray_head.py.

The fake engine stands in for the core library where a test is about the pipeline's mechanics (resume,
faults, error rows), not about the methods: it is deterministic, needs no model, and can be made slow so
that a test can kill an actor or a job mid-run.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


# ---------------------------------------------------------------------- a job's output

# Lines that are not the project's own in a job's output (issue: a first-hour user's quickstart printed each kind).
NOISE = {
    "ANSI colour code": re.compile(r"\x1b\["),
    "Ray log record (INFO/SUCC/DEBUG/WARNING)": re.compile(r"^\S+ \S+\t(INFO|SUCC|DEBUG|WARNING) "),
    "Ray CLI banner": re.compile(r"Next steps|submitted successfully|Tailing logs until"),
    "actor-restart notice": re.compile(r"max_restarts > 0"),
    "Ray's actor prefix": re.compile(r"^\((MapWorker|\w+)[^)]* pid=\d+"),
    "Ray Data memory warning": re.compile(r"memory per worker|logical memory was"),
    "CUDA_HOME probe": re.compile(r"No CUDA runtime is found"),
    "glog-style info/warning line": re.compile(r"^[IW]\d{4} \d\d:\d\d:\d\d"),
    "Python warning": re.compile(r"Warning|Deprecat"),
}


def noise_lines(text: str) -> dict[str, list[str]]:
    """{kind: lines} of every line of ``text`` that matches a kind of noise (empty: only the project's lines)."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        for kind, pattern in NOISE.items():
            if pattern.search(line):
                found.setdefault(kind, []).append(line)
    return found


# ---------------------------------------------------------------------- shards


def synthetic_records(task: str, n: int, seed: int = 0) -> list[dict]:
    from pipeline.data.synthetic import make_record

    return [make_record(task, seed, i) for i in range(n)]


def write_shard(path: Path, records: list[dict]) -> Path:
    from pipeline.schema import INPUT_SCHEMA

    path.parent.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([pa.field(f.name, f.type) for f in INPUT_SCHEMA])  # nullable: bad rows allowed
    prompts = [r.get("prompt") for r in records]
    table = pa.Table.from_pylist([dict(r, prompt=None) if isinstance(r.get("prompt"), bytes) else r
                                  for r in records], schema=schema)
    if any(isinstance(p, bytes) for p in prompts):  # a bytes prompt is written as is: Parquet does not check UTF-8
        raw = pa.array([p if isinstance(p, bytes) or p is None else p.encode() for p in prompts], pa.binary())
        table = table.set_column(schema.get_field_index("prompt"), "prompt",
                                 raw.view(schema.field("prompt").type))
    pq.write_table(table, path)
    return path


def _img_bytes(img, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def bad_input_records(base: dict) -> tuple[list[dict], dict[str, str | None]]:
    """One record per kind of bad input, plus the awkward-but-valid image modes.

    Returns (records, expectation) where expectation maps each output sample_id to the substring its
    error must contain, or None if it must have an output.
    """
    from PIL import Image

    rgb = Image.open(io.BytesIO(base["images"][0])).convert("RGB")
    png = base["images"][0]

    def rec(sid, **kw):
        r = dict(base, sample_id=sid)
        r.update(kw)
        return r

    huge = _img_bytes(Image.new("1", (12000, 12000)), "PNG")  # 144 MP, a few KB on disk
    records = [
        rec("good-a"),
        rec("corrupt", images=[png[: len(png) // 3]]),  # truncated PNG
        rec("garbage", images=[b"this is not an image at all" * 10]),
        rec("empty-image", images=[b""]),
        rec("huge", images=[huge]),
        rec("cmyk", images=[_img_bytes(rgb.convert("CMYK"), "JPEG")]),
        rec("rgba", images=[_img_bytes(rgb.convert("RGBA"), "PNG")]),
        rec("grey", images=[_img_bytes(rgb.convert("L"), "PNG")]),
        rec("video-0-frames", task="video", images=[], prompt="Describe what happens in this video."),
        rec("empty-prompt", prompt="   "),
        rec("good-b", images=[_img_bytes(rgb.transpose(Image.FLIP_LEFT_RIGHT), "PNG")]),
        rec("truncated-png", images=[png[: len(png) - len(png) // 4]]),  # header whole, pixel data cut
        rec("prompt-bad-utf8", prompt=b"Describe \xff\xfe this image."),
        rec("prompt-null", prompt=None),
        rec("too-long", prompt="Describe every detail " * 1400),  # > 4096 tokens with the image
        rec("video-over-cap", task="video", images=[png] * 65, prompt="Describe what happens in this video."),
        rec("good-a", prompt=base["prompt"] + " Again."),  # last: duplicate sample_id -> good-a#dup2
    ]
    expect = {
        "good-a": None, "good-b": None, "cmyk": None, "rgba": None, "grey": None,
        "corrupt": "corrupt", "garbage": "corrupt or not an image", "empty-image": "empty (0 bytes)",
        "huge": "huge", "video-0-frames": "0 frames", "empty-prompt": "prompt is empty",
        "good-a#dup2": "duplicate sample_id 'good-a'",
        "truncated-png": "bad input: image 0 is corrupt", "prompt-bad-utf8": "bad input: prompt is not valid UTF-8",
        "prompt-null": "bad input: prompt is empty", "too-long": "exceeds the model's context of",
        "video-over-cap": "video has 65 frames, more than max_frames=64",
    }
    return records, expect


# ---------------------------------------------------------------------- fake engine


class FakeResult:
    """What the pipeline reads of an ``rcr.GenerationResult``: ``sample(b)``'s trimmed arrays, ``lengths``,
    ``prefix_len`` and the timings."""

    def __init__(self, seqs: list[list[int]], n_layers: int, seed: int, prefill_s: float, decode_s: float):
        self.seqs, self.n_layers, self.seed = seqs, n_layers, seed
        self.lengths = np.array([len(s) for s in seqs])
        self.prefix_len = np.full(len(seqs), 64)
        self.prefill_s, self.decode_s = prefill_s, decode_s

    def sample(self, b: int) -> dict:
        t = len(self.seqs[b])
        rng = np.random.default_rng(self.seed + b)
        drift = rng.random((self.n_layers, t)).astype(np.float32) * 0.1
        per_step = {k: np.full((self.n_layers, t), v) for k, v in
                    (("keys_read", 160.0), ("values_read", 32.0), ("detector_dots", 10.0))}
        return {"tokens": np.array(self.seqs[b]), "drift": drift, "drift_exact": None, "trigger": drift > 0.05,
                "tau": np.full((self.n_layers, t), 0.05, np.float32), "top_prefix_pos": None, **per_step}


class FakeEngine:
    """Deterministic stand-in for the core: output tokens are a function of (prompt, image bytes, method)."""

    def __init__(self, cfg, device, dtype):
        self.cfg = cfg
        self.n_layers = 2
        self.calls = 0

    def run(self, prompts, images, methods, task=None):
        self.calls += 1
        if any("CRASH" in p for p in prompts):
            raise RuntimeError("fake engine crash on request")
        if any("OOM" in p for p in prompts):  # what torch raises when a batch does not fit the device
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        out = {}
        for m in methods:
            seqs = []
            for p, ims in zip(prompts, images):
                h = zlib.crc32((p + m + "".join(f"{im.size}{im.mode}" for im in ims)).encode())
                n = 3 + h % 5 if m != "full" else 6
                seqs.append([(h >> k) % 90 + 4 for k in range(min(n, self.cfg.max_new_tokens))])
            out[m] = FakeResult(seqs, self.n_layers, zlib.crc32(m.encode()), 0.01, 0.02)
        return out

    def decode(self, ids) -> str:
        return " ".join(f"w{int(i)}" for i in ids)

    def recover(self) -> None:
        pass


class GatedFakeEngine(FakeEngine):
    """A FakeEngine that stops at a known point, so a test can interrupt a job there without timing.

    With ``RCR_TEST_GATE`` set to a path, the first ``RCR_TEST_GATE_AFTER`` calls (default 0) of each engine
    run at once; the next call touches ``<path>.waiting`` and ``<path>.waiting.<pid>`` (one per actor) and
    waits until ``<path>`` exists (the test's signal to go on; a test that stops the job never creates it)."""

    def run(self, prompts, images, methods, task=None):
        gate = os.environ.get("RCR_TEST_GATE")
        if gate and self.calls >= int(os.environ.get("RCR_TEST_GATE_AFTER", "0")) and not Path(gate).exists():
            Path(f"{gate}.waiting.{os.getpid()}").touch()
            Path(f"{gate}.waiting").touch()
            while not Path(gate).exists():
                time.sleep(0.05)
        return super().run(prompts, images, methods, task)


# ---------------------------------------------------------------------- models


def fake_model_dir(root: Path) -> Path:
    """A directory that passes the model check (config.json with a supported model_type); no weights."""
    d = root / "fake-model"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    return d


def tiny_qwen2_vl_dir(root: Path) -> Path:
    """A tiny random Qwen2-VL saved like a real checkpoint (model + processor), built from a config."""
    d = root / "tiny-qwen2-vl"
    if (d / "config.json").is_file():
        return d
    from tests import tiny_models

    model, proc = tiny_models.qwen2_vl()
    model.save_pretrained(d)
    proc.save_pretrained(d)
    return d

