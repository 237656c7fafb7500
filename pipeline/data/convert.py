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

Where the data comes from, always read with Hugging Face ``datasets`` (``pipeline/data/hf_datasets.py``):
``local_path`` (a Parquet file, a folder laid out like the Hub repository such as an ``hf download
--local-dir`` snapshot, or a ``datasets.save_to_disk`` directory); otherwise the Hub at the pinned revision
(``streaming=True`` on request), or offline a snapshot in the hub cache (the pinned revision preferred; another
one is named in one line). A split is matched to its files by the dataset card's ``configs`` or the Hub's
``data/<split>-*`` file names, and a split the copy does not have fails in one line naming those it has. With
no network and nothing cached, ``OfflineError`` says so in one line and names ``--local-path``. Each record's
``source`` is the Hub id with the commit read, or the local path with the SHA-256 prefix of its files.

``limit`` + ``seed`` pick a fixed random subset (the same rows for the same seed), kept in source order.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.data import hf_datasets as hf
from pipeline.data.hf_datasets import OfflineError  # noqa: F401 - part of this module's interface
from pipeline.data.images import decode_image, encode_image, to_rgb
from pipeline.data.shards import DataError
from pipeline.tasks import DETAILCAPS, TASKS, TEXTCAPS, VIDEO, Task


# ------------------------------------------------------------------------------------------- --dataset
@dataclass(frozen=True)
class NamedDataset:
    """A job's ``--dataset NAME[:split]``: the task (whose ``source`` it reads), the split, and, for a local copy,
    its path."""

    task: Task
    local_path: str | None
    split: str

    def locate(self) -> hf.Located:
        """The split's files and provenance (offline: a revision in the hub cache); reads no rows."""
        return locate(self.task, self.local_path, split=self.split)

    def cache_name(self, loc: hf.Located | None = None) -> str:
        """A directory name that changes when the data can: for the Hub, the revision read (``loc``; default
        the pinned one); for a local copy, a hash of the paths, sizes and modification times of the files the
        split is read from (``loc``, located when not given)."""
        name, src = self.task.name, self.task.source
        if self.local_path is None:
            rev = loc.revision if loc is not None and loc.revision else src.revision
            return f"{name}-{self.split}-{rev[:10]}"
        loc = loc or self.locate()
        h = hashlib.sha256(f"{self.local_path}\0{self.split}".encode())
        for f in loc.data_files:
            st = os.stat(f)
            h.update(f"\0{f}\0{st.st_size}\0{st.st_mtime_ns}".encode())
        return f"{name}-{self.split}-local-{h.hexdigest()[:12]}"

    def records(self, loc: hf.Located | None = None) -> Iterator[dict]:
        """Every sample of the split in the input schema, in source order."""
        return convert_located(self.task, loc or self.locate())


def parse_dataset(spec: str, task: str) -> NamedDataset:
    """``NAME[:split]`` -> :class:`NamedDataset`. NAME is the task's Hugging Face dataset (its repo id, or the
    task name) read at the pinned revision, or a local copy of it (a ``save_to_disk`` directory, or a Parquet
    file or folder laid out like the Hub's). The split defaults to the pinned one; the files of a split come
    from the copy's dataset card or the Hub's file names (``pipeline/data/hf_datasets.py``). Rows map to the
    input schema with the task's converter, so only the datasets this module converts are accepted."""
    t = TASKS.get(task)
    if t is None or t.source is None:
        have = ", ".join(n for n, x in TASKS.items() if x.source is not None)
        raise DataError(f"task '{task}' has no Hugging Face source (have: {have}); convert the "
                        "data with jobs/prepare_data.py and pass --shards")
    src = t.source
    name, split = spec, None
    head, sep, tail = spec.rpartition(":")
    if sep and head and tail and "/" not in tail:
        name, split = head, tail
    local = None
    if name not in (src.repo_id, t.name):
        path = Path(name).expanduser()
        if not path.exists():
            raise DataError(f"'{name}' is neither {src.repo_id} (or '{t.name}') nor a local file or directory; "
                            f"task {task} reads {src.repo_id} or a local copy of it")
        local = os.path.abspath(path)  # not resolved: a hub-cache snapshot's files are links into its blobs
    return NamedDataset(t, local, split or src.split)


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


def locate(task: Task, local_path=None, cache_dir=None, revision: str | None = None,
           split: str | None = None) -> hf.Located:
    """Where ``split`` (default: the pinned one) of the task's source is read from: ``local_path``, else the Hub
    at ``revision`` (default: the pinned one), or offline the hub cache (``cache_dir``, default HF_HUB_CACHE)."""
    src = task.source
    split = split or src.split
    if local_path is not None:
        return hf.locate_local(local_path, split, src.repo_id, src.split, src.files)
    return hf.locate_hub(src.repo_id, revision or src.revision, split, src.split, src.files, cache_dir)


def convert_hub(task: Task, local_path=None, limit: int | None = None, seed: int = 0, cache_dir=None,
                revision: str | None = None, streaming: bool = False, split: str | None = None) -> Iterator[dict]:
    """Yield input-schema records for a Hub dataset (DetailCaps or TextCaps), read with ``datasets``
    (``pipeline/data/hf_datasets.py``); a revision other than the one asked for is named on stderr.
    ``streaming``: the first ``limit`` samples of the stream, no subset."""
    loc = locate(task, local_path, cache_dir, revision, split)
    if loc.note:
        print(f"note: {loc.note}", file=sys.stderr, flush=True)
    yield from convert_located(task, loc, limit, seed, streaming)


def convert_located(task: Task, loc: hf.Located, limit: int | None = None, seed: int = 0,
                    streaming: bool = False) -> Iterator[dict]:
    """Input-schema records of the split ``loc`` found (see :func:`convert_hub`)."""
    src = task.source
    ds, where = hf.open_located(loc, streaming), loc.where
    source = f"{loc.origin}:{loc.split}"  # a local copy: hashes its files, once
    need = [src.image_column, *src.reference_columns] + ([src.id_column] if src.id_column else [])
    cols = list(ds.column_names or ds.features or [])
    for c in need:
        if c not in cols:
            raise DataError(f"{where}: missing column '{c}' expected in {src.repo_id} (have: {', '.join(cols)})")
    ds = hf.with_image_column(ds.select_columns(need), src.image_column, where)

    def record(key, image, refs) -> dict:
        sid = f"{task.name}-{key}" if src.id_column else f"{task.name}-{key:05d}"
        return {"sample_id": sid, "task": task.name, "prompt": task.prompt, "images": [image], "references": refs,
                "source": source}

    def key_of(r: int, row: dict):
        return row[src.id_column] if src.id_column else r

    if streaming:  # one pass; rows of one id (TextCaps) are merged while they are adjacent in the stream
        pending = None
        n = 0
        for r, row in enumerate(ds):
            key, refs = key_of(r, row), _refs([row[c] for c in src.reference_columns], f"{where} row {r}")
            if pending is not None and pending[0] == key:
                pending[2].extend(x for x in refs if x not in pending[2])
                continue
            if pending is not None:
                yield record(*pending)
                n += 1
            if limit is not None and n >= limit:
                return
            img = hf.image_bytes(row[src.image_column], f"{where} row {r} column '{src.image_column}'")
            pending = (key, img, list(refs))
        if pending is not None:
            yield record(*pending)
        return
    # pass 1: ids and references of every row (no image decoding), to group and subsample
    meta = ds.select_columns([c for c in need if c != src.image_column]).to_list()
    groups: dict = {}  # key -> (first row, references); TextCaps: several caption rows per image
    for r, row in enumerate(meta):
        key, refs = key_of(r, row), _refs([row[c] for c in src.reference_columns], f"{where} row {r}")
        if key in groups:
            groups[key][1].extend(x for x in refs if x not in groups[key][1])
        else:
            groups[key] = (r, list(refs))
    keys = list(groups)
    chosen = [keys[i] for i in pick_subset(len(keys), limit, seed)]
    # pass 2: images of the chosen rows only, decoded by datasets.Image
    rows = [groups[k][0] for k in chosen]
    images = ds.select(rows)[src.image_column] if rows else []
    for key, r, image in zip(chosen, rows, images):
        yield record(key, hf.image_bytes(image, f"{where} row {r} column '{src.image_column}'"), groups[key][1])


def convert_detailcaps(local_path=None, limit=None, seed=0, cache_dir=None, revision=None,
                       streaming=False) -> Iterator[dict]:
    return convert_hub(DETAILCAPS, local_path, limit, seed, cache_dir, revision, streaming)


def convert_textcaps(local_path=None, limit=None, seed=0, cache_dir=None, revision=None,
                     streaming=False) -> Iterator[dict]:
    return convert_hub(TEXTCAPS, local_path, limit, seed, cache_dir, revision, streaming)


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
                   prompt: str = VIDEO.prompt) -> Iterator[dict]:
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
