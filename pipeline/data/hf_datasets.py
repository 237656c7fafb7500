"""Open a source dataset with Hugging Face ``datasets``: a Hub dataset by name at a pinned revision, a
``save_to_disk`` directory, or a Parquet file/folder (such as a ``huggingface-cli download`` snapshot).

``pipeline.data.convert`` maps the rows to the input schema; images go through ``datasets.Image`` (the column is
cast to ``Image(decode=False)`` so the original encoded bytes are kept, and each one is decoded by
``datasets.Image().decode_example`` to reject a broken file with its row and column).

Offline (``HF_HUB_OFFLINE=1`` / ``HF_DATASETS_OFFLINE=1``) a Hub dataset still loads from the ``datasets``
cache or from files in the hub cache; with neither, :class:`OfflineError` says so in one line and names
``--local-path``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.data.shards import DataError

if TYPE_CHECKING:
    from datasets import Dataset, IterableDataset


class OfflineError(RuntimeError):
    """The dataset cannot be fetched (no network, nothing cached) and no local copy was given."""


def is_save_to_disk(path: Path) -> bool:
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def parquet_files(path: Path, split: str, names: tuple[str, ...] = ()) -> list[Path]:
    """A Parquet file, or the Parquet files of ``split`` in a folder laid out like the Hub repository
    (``names``: the pinned files' paths in the repository; else ``<split>-*.parquet`` or ``<split>/``)."""
    if path.is_file():
        return [path]
    found = sorted(p for p in path.rglob("*.parquet") if not any(s.startswith(".") for s in p.relative_to(path).parts))
    if not found:
        raise DataError(f"--local-path {path}: no .parquet files and no datasets.save_to_disk directory "
                        f"(state.json or dataset_dict.json) found for split {split!r}")
    exact = [p for p in found if p.name in {Path(n).name for n in names}]
    if exact:
        return exact
    in_split = [p for p in found if p.name.startswith(f"{split}-") or p.parent.name == split]
    return in_split or found


def open_local(path: str | os.PathLike, split: str, names: tuple[str, ...] = (),
               streaming: bool = False) -> Dataset | IterableDataset:
    """A ``save_to_disk`` directory (a Dataset, or the ``split`` of a DatasetDict) or Parquet file(s)."""
    import datasets

    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"--local-path {p}: no such file or directory")
    if is_save_to_disk(p):
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds and len(ds) != 1:
                raise DataError(f"--local-path {p}: no split {split!r} (have: {', '.join(ds)})")
            ds = ds[split] if split in ds else next(iter(ds.values()))
        return ds.to_iterable_dataset() if streaming else ds
    files = [str(f) for f in parquet_files(p, split, names)]
    try:
        return datasets.load_dataset("parquet", data_files={split: files}, split=split, streaming=streaming)
    except Exception as e:  # noqa: BLE001 - pyarrow/datasets raise many types for an unreadable file
        raise DataError(f"--local-path {p}: cannot read as Parquet ({type(e).__name__}: {e})") from None


def open_hub(repo_id: str, revision: str, split: str, files: tuple[str, ...] = (), cache_dir: str | None = None,
             streaming: bool = False) -> Dataset | IterableDataset:
    """``datasets.load_dataset(repo_id, revision=...)`` (the pinned ``files`` as the split's data files when
    given, so that the split does not depend on the dataset card). Offline it falls back to the pinned
    files in the hub cache; with nothing cached it raises :class:`OfflineError`."""
    import datasets

    kw: dict[str, Any] = {"revision": revision, "split": split, "streaming": streaming}
    if files:
        kw["data_files"] = {split: list(files)}
    try:
        return datasets.load_dataset(repo_id, **kw)
    except Exception as first:  # noqa: BLE001 - offline/network errors come in many types
        cached = _hub_cache_files(repo_id, revision, files, cache_dir)
        if cached:
            return datasets.load_dataset("parquet", data_files={split: [str(f) for f in cached]}, split=split,
                                         streaming=streaming)
        raise OfflineError(
            f"cannot load {repo_id}@{revision[:10]} split {split!r} with datasets.load_dataset (no network and "
            f"nothing cached? {type(first).__name__}); download it where there is a network and pass "
            "--local-path <file or dir>") from None


def _hub_cache_files(repo_id: str, revision: str, files: tuple[str, ...], cache_dir: str | None) -> list[Path]:
    """The pinned files when all of them are already in the hub cache (e.g. from ``huggingface-cli download``)."""
    if not files:
        return []
    from huggingface_hub import try_to_load_from_cache

    out = []
    for f in files:
        hit = try_to_load_from_cache(repo_id, f, cache_dir=cache_dir, revision=revision, repo_type="dataset")
        if not isinstance(hit, str):
            return []
        out.append(Path(hit))
    return out


def image_bytes(value: Any, where: str) -> bytes:
    """The encoded bytes of an ``Image(decode=False)`` cell, after ``datasets`` decoded them once."""
    from datasets import Image

    if not isinstance(value, dict) or not (value.get("bytes") or value.get("path")):
        raise DataError(f"{where}: no image (neither bytes nor a path)")
    try:
        Image().decode_example(value)
    except Exception as e:  # noqa: BLE001 - PIL raises several types for a broken file
        raise DataError(f"{where}: cannot decode image ({type(e).__name__}: {e})") from None
    return value["bytes"] if value.get("bytes") else Path(value["path"]).read_bytes()


def with_image_column(ds: Dataset | IterableDataset, column: str, where: str) -> Dataset | IterableDataset:
    """Cast ``column`` (binary, base64 string, or an Image struct) to ``datasets.Image(decode=False)``."""
    from datasets import Image

    try:
        return ds.cast_column(column, Image(decode=False))
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{where}: column '{column}' is not an image column ({type(e).__name__}: {e})") from None
