"""Converters from the real datasets to the project's input schema (``pipeline/schema.py``, ``INPUT_SCHEMA``).

* **DetailCaps-4870** -- Hugging Face dataset ``foundation-multimodal-models/DetailCaps-4870``, split
  ``test``, one file ``DetailCaps-4870.parquet`` at the repository root. Image bytes are in ``binary``;
  references in ``GT_Caption_GPT4O``, ``GT_Caption_GPT4V``, ``GT_Caption_Gemini15Pro``.
* **TextCaps** -- ``lmms-lab/TextCaps`` (later renamed ``lmms-lab-encoder/TextCaps``), split ``val``,
  files ``data/val-0000K-of-00002.parquet``, pinned at revision ``TEXTCAPS.revision``. The image is a
  ``datasets`` Image struct (``{bytes, path}``) in ``image``; references in ``caption_str``. Rows that
  share an ``image_id`` are merged into one sample with all their captions.
* **Local videos** -- a folder whose entries are either folders of frame images (sorted by name) or
  video files (animated GIF/WebP via Pillow; mp4/avi/mov/mkv/webm via PyAV when it is installed).
  References come from an optional ``<name>.txt`` next to the entry (one reference per line) or a
  ``references.json`` mapping ``name -> [str, ...]``.

Where the data comes from, in order: ``local_path`` (a Parquet file, a directory of Parquet files such as
a ``huggingface-cli download --local-dir`` snapshot, or a ``datasets.save_to_disk`` directory of Arrow
files); otherwise the Hugging Face Hub via ``huggingface_hub.hf_hub_download`` at the pinned revision,
which also finds files already in the local hub cache (``HF_HUB_CACHE`` / ``cache_dir``) when offline.
With no network and nothing cached, ``OfflineError`` says so in one line and names ``--local-path``.

``limit`` + ``seed`` pick a fixed random subset (the same rows for the same seed), kept in source order.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.images import decode_image, encode_image, to_rgb
from pipeline.data.shards import DataError
from rcr.models import PROMPTS  # the one copy of the task prompts


class OfflineError(RuntimeError):
    """The dataset cannot be fetched (no network, nothing cached) and no local copy was given."""


@dataclass(frozen=True)
class HubSource:
    name: str
    repo_id: str
    revision: str
    split: str
    files: tuple[str, ...]  # paths inside the dataset repo
    image_column: str
    reference_columns: tuple[str, ...]
    id_column: str | None
    task: str
    prompt: str


DETAILCAPS = HubSource(
    name="detailcaps",
    repo_id="foundation-multimodal-models/DetailCaps-4870",
    revision="3882c5a37b8971c86d0093838c967083c5f90f9d",
    split="test",
    files=("DetailCaps-4870.parquet",),
    image_column="binary",
    reference_columns=("GT_Caption_GPT4O", "GT_Caption_GPT4V", "GT_Caption_Gemini15Pro"),
    id_column=None,  # rows have no unique id column; the row index in the pinned file is stable
    task="detailcaps",
    prompt=PROMPTS["detailcaps"],
)

TEXTCAPS = HubSource(
    name="textcaps",
    repo_id="lmms-lab/TextCaps",
    revision="09a9d5e2f0829b732faf722b8c4a9c2e9ef9e575",
    split="val",
    files=("data/val-00000-of-00002.parquet", "data/val-00001-of-00002.parquet"),
    image_column="image",
    reference_columns=("caption_str",),
    id_column="image_id",
    task="textcaps",
    prompt=PROMPTS["textcaps"],
)

SOURCES = {"detailcaps": DETAILCAPS, "textcaps": TEXTCAPS}


# ------------------------------------------------------------------------------------------- locate
def _local_files(local_path: Path, src: HubSource) -> list[Path]:
    if not local_path.exists():
        raise DataError(f"--local-path {local_path}: no such file or directory")
    if local_path.is_file():
        return [local_path]
    # a save_to_disk directory (possibly a DatasetDict with one folder per split)
    for d in (local_path / src.split, local_path):
        arrows = sorted(d.glob("data-*.arrow"))
        if arrows and (d / "state.json").exists():
            return arrows
    parquet = sorted(p for p in local_path.rglob("*.parquet") if not any(s.startswith(".") for s in p.parts))
    if not parquet:
        raise DataError(f"--local-path {local_path}: no .parquet files and no datasets.save_to_disk layout "
                        f"(state.json + data-*.arrow) found for {src.repo_id} split {src.split!r}")
    # prefer the files of the requested split when the snapshot holds several splits
    names = {Path(f).name for f in src.files}
    exact = [p for p in parquet if p.name in names]
    if exact:
        return exact
    split = [p for p in parquet if p.name.startswith(f"{src.split}-") or p.parent.name == src.split]
    return split or parquet


def locate(src: HubSource, local_path: str | os.PathLike | None = None, cache_dir: str | None = None,
           revision: str | None = None) -> list[Path]:
    """Files to read for ``src``: from ``local_path`` or from the Hub (or its local cache)."""
    if local_path is not None:
        return _local_files(Path(local_path), src)
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as e:  # pragma: no cover - transformers depends on huggingface_hub
        raise OfflineError(f"huggingface_hub is not installed; pass --local-path with a local copy of "
                           f"{src.repo_id}") from e
    out = []
    for f in src.files:
        try:
            out.append(Path(hf_hub_download(src.repo_id, f, repo_type="dataset", revision=revision or src.revision,
                                            cache_dir=cache_dir)))
        except Exception as e:  # noqa: BLE001 - network errors come in many types; all mean the same here
            raise OfflineError(
                f"cannot download {src.repo_id}@{(revision or src.revision)[:10]} file {f} (no network? "
                f"{type(e).__name__}); download it where there is a network and pass --local-path <file or dir>"
            ) from None
    return out


# ------------------------------------------------------------------------------------------- read
def _open_table(path: Path, columns: list[str] | None = None) -> pa.Table:
    try:
        if path.suffix == ".arrow":
            with pa.memory_map(str(path)) as f:
                try:
                    t = pa.ipc.open_stream(f).read_all()
                except pa.ArrowInvalid:
                    f.seek(0)
                    t = pa.ipc.open_file(f).read_all()
            return t.select(columns) if columns else t
        return pq.read_table(path, columns=columns)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: cannot read ({e})") from e
    except KeyError as e:
        raise DataError(f"{path}: missing column {e}") from e


def _columns(path: Path) -> list[str]:
    if path.suffix == ".arrow":
        return _open_table(path).column_names
    try:
        return pq.ParquetFile(path).schema_arrow.names
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: cannot read ({e})") from e


def _image_bytes(value, where: str) -> bytes:
    """Encoded image bytes from a binary cell, a datasets Image struct or a base64 string."""
    if isinstance(value, dict):
        if value.get("bytes"):
            return value["bytes"]
        if value.get("path") and Path(value["path"]).exists():
            return Path(value["path"]).read_bytes()
        raise DataError(f"{where}: image struct has neither bytes nor a readable path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except ValueError as e:
            raise DataError(f"{where}: image is a string but not base64 ({e})") from e
    raise DataError(f"{where}: expected image bytes, got {type(value).__name__}")


def _refs(values, where: str) -> list[str]:
    out: list[str] = []
    for v in values:
        if v is None:
            continue
        if isinstance(v, str):
            if v.strip():
                out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, str) and x.strip())
        else:
            raise DataError(f"{where}: reference is {type(v).__name__}, expected a string or a list of strings")
    return out


def pick_subset(n: int, limit: int | None, seed: int) -> list[int]:
    """A fixed random subset of ``range(n)`` (all rows when ``limit`` is None), in ascending order."""
    if limit is None or limit >= n:
        return list(range(n))
    if limit < 0:
        raise ValueError(f"--limit must be >= 0, got {limit}")
    return sorted(np.random.default_rng(seed).choice(n, size=limit, replace=False).tolist())


def convert_hub(src: HubSource, local_path=None, limit: int | None = None, seed: int = 0, cache_dir=None,
                revision: str | None = None, check_images: bool = True) -> Iterator[dict]:
    """Yield input-schema records for a Hub dataset (DetailCaps or TextCaps)."""
    files = locate(src, local_path, cache_dir, revision)
    need = [src.image_column, *src.reference_columns] + ([src.id_column] if src.id_column else [])
    for f in files:
        cols = _columns(f)
        for c in need:
            if c not in cols:
                raise DataError(f"{f}: missing column '{c}' expected in {src.repo_id} (have: {', '.join(cols)})")
    # pass 1: ids and references of every row (cheap columns), to group and subsample
    meta = []  # (file index, row in file, id, refs)
    for fi, f in enumerate(files):
        t = _open_table(f, [*src.reference_columns] + ([src.id_column] if src.id_column else []))
        ref_cols = [t.column(c).to_pylist() for c in src.reference_columns]
        ids = t.column(src.id_column).to_pylist() if src.id_column else None
        for r in range(t.num_rows):
            where = f"{f} row {r}"
            refs = _refs([col[r] for col in ref_cols], where)
            meta.append((fi, r, ids[r] if ids else None, refs))
    # group rows by id (TextCaps: several caption rows per image); order of first appearance
    groups: dict = {}
    for k, (fi, r, sid, refs) in enumerate(meta):
        key = sid if sid is not None else k
        if key in groups:
            groups[key][1].extend(x for x in refs if x not in groups[key][1])
        else:
            groups[key] = ((fi, r), list(refs))
    keys = list(groups)
    chosen = [keys[i] for i in pick_subset(len(keys), limit, seed)]
    # pass 2: images of the chosen rows only, file by file
    by_file: dict[int, list] = {}
    for key in chosen:
        (fi, r), _ = groups[key]
        by_file.setdefault(fi, []).append((r, key))
    records = {}
    for fi, rows in by_file.items():
        f = files[fi]
        col = _open_table(f, [src.image_column]).column(src.image_column)
        for r, key in rows:
            where = f"{f} row {r} column '{src.image_column}'"
            data = _image_bytes(col[r].as_py(), where)
            if check_images:
                decode_image(data, where)
            sid = f"{src.name}-{key}" if src.id_column else f"{src.name}-{key:05d}"
            records[key] = {
                "sample_id": sid, "task": src.task, "prompt": src.prompt, "images": [data],
                "references": groups[key][1], "source": f"{src.repo_id}@{(revision or src.revision)[:10]}:{src.split}",
            }
    for key in chosen:
        yield records[key]


def convert_detailcaps(local_path=None, limit=None, seed=0, cache_dir=None, revision=None) -> Iterator[dict]:
    return convert_hub(DETAILCAPS, local_path, limit, seed, cache_dir, revision)


def convert_textcaps(local_path=None, limit=None, seed=0, cache_dir=None, revision=None) -> Iterator[dict]:
    return convert_hub(TEXTCAPS, local_path, limit, seed, cache_dir, revision)


# ------------------------------------------------------------------------------------------- videos
IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff"}
ANIMATED_EXTS = {".gif", ".webp", ".apng"}
VIDEO_EXTS = {".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v"}


def _uniform(n_total: int, k: int) -> list[int]:
    if n_total <= k:
        return list(range(n_total))
    return [int(round(i * (n_total - 1) / (k - 1))) for i in range(k)] if k > 1 else [0]


def _frames_from_dir(d: Path, k: int) -> list[bytes]:
    files = sorted(p for p in d.iterdir() if p.suffix.lower() in IMAGE_EXTS)
    if not files:
        raise DataError(f"{d}: frame folder holds no image files ({', '.join(sorted(IMAGE_EXTS))})")
    out = []
    for i in _uniform(len(files), k):
        data = files[i].read_bytes()
        decode_image(data, str(files[i]))
        out.append(data)
    return out


def _frames_from_file(f: Path, k: int) -> list[bytes]:
    ext = f.suffix.lower()
    if ext in ANIMATED_EXTS:
        from PIL import Image, ImageSequence

        try:
            with Image.open(f) as im:
                frames = [to_rgb(fr) for fr in ImageSequence.Iterator(im)]
        except OSError as e:
            raise DataError(f"{f}: cannot decode video ({e})") from e
        return [encode_image(frames[i]) for i in _uniform(len(frames), k)]
    if ext in VIDEO_EXTS:
        try:
            import av  # type: ignore
        except ImportError:
            raise DataError(f"{f}: reading {ext} videos needs PyAV (`pip install av`); "
                            f"or pass a folder of frame images instead") from None
        try:
            with av.open(str(f)) as c:
                frames = [fr.to_image() for fr in c.decode(video=0)]
        except Exception as e:  # noqa: BLE001
            raise DataError(f"{f}: cannot decode video ({e})") from e
        if not frames:
            raise DataError(f"{f}: video has no frames")
        return [encode_image(frames[i]) for i in _uniform(len(frames), k)]
    raise DataError(f"{f}: unsupported video file type {ext!r}")


def convert_videos(folder: str | os.PathLike, frames: int = 8, limit: int | None = None, seed: int = 0,
                   prompt: str = PROMPTS["video"]) -> Iterator[dict]:
    """Yield video records from a folder of videos and/or frame folders."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder}: not a directory of videos or frame folders")
    if frames < 2:
        raise DataError(f"--frames must be >= 2, got {frames}")
    refs_json = folder / "references.json"
    ref_map = {}
    if refs_json.exists():
        try:
            ref_map = json.loads(refs_json.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{refs_json}: invalid JSON ({e})") from e
        if not isinstance(ref_map, dict):
            raise DataError(f"{refs_json}: expected an object mapping video name -> list of references")
    entries = sorted(
        p for p in folder.iterdir()
        if not p.name.startswith(".") and (p.is_dir() or p.suffix.lower() in ANIMATED_EXTS | VIDEO_EXTS)
    )
    if not entries:
        raise DataError(f"{folder}: no videos or frame folders found")
    for i in pick_subset(len(entries), limit, seed):
        e = entries[i]
        name = e.name if e.is_dir() else e.stem
        imgs = _frames_from_dir(e, frames) if e.is_dir() else _frames_from_file(e, frames)
        refs = ref_map.get(name, ref_map.get(e.name, []))
        if isinstance(refs, str):
            refs = [refs]
        txt = e.with_suffix(".txt") if not e.is_dir() else folder / f"{name}.txt"
        if not refs and txt.exists():
            refs = [ln.strip() for ln in txt.read_text().splitlines() if ln.strip()]
        yield {"sample_id": f"video-{name}", "task": "video", "prompt": prompt, "images": imgs,
               "references": _refs(refs, f"{folder} references for {name!r}"), "source": str(folder)}
