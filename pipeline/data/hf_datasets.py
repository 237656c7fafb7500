"""Find and open one split of a source dataset with Hugging Face ``datasets`` and ``huggingface_hub``: on the Hub
by name, in the hub cache (offline), or in a local copy (a ``save_to_disk`` directory, a Parquet file, or a
folder laid out like the Hub repository, e.g. ``hf download --local-dir``).

:func:`locate_local` and :func:`locate_hub` decide which files hold the split, without reading rows, and what
the rows' ``source`` records (a :class:`Located`); :func:`open_located` opens them.

* The files of a split come from the dataset card's ``configs`` (``README.md``, read as ``datasets`` reads it:
  the default config's ``data_files``), else from the Hub's ``data/<split>-NNNNN-of-NNNNN.*`` file names (the
  layout ``datasets`` infers first), else, for a copy with neither, from the pinned split's files at their
  paths in the repository; only that split's patterns are resolved (``datasets.data_files``), so a copy of one
  split is enough. A split that none of these names is refused with the splits there are; a folder's other
  Parquet files are never read as the split asked for. A lone Parquet file is the split its Hub name says
  (``val-00000-of-00002.parquet``), otherwise the pinned split. On the Hub, ``datasets.load_dataset_builder``
  resolves the files at the commit read.
* Offline (``HF_HUB_OFFLINE=1``, or the Hub unreachable) the hub cache is searched with
  ``huggingface_hub.scan_cache_dir``: the snapshot of the revision asked for is preferred; a snapshot of
  another revision (``refs/main`` first, then the newest) that holds the split is read, and
  :attr:`Located.note` names it. With no snapshot, :class:`OfflineError` says so in one line.
* ``source`` provenance: ``<repo id>@<commit[:10]>`` for the Hub, the hub cache, or a local folder that is a
  hub-cache snapshot; ``<path>@sha256:<first 12 hex>`` for another local copy, the SHA-256 of the split's files'
  bytes in the order read (for one file, ``sha256sum`` of that file; for several, of their concatenation).

Images go through ``datasets.Image``: the column is cast to ``Image(decode=False)`` so the original encoded
bytes are kept, and each one is decoded by ``datasets.Image().decode_example`` to reject a broken file with
its row and column.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.data.shards import DataError

if TYPE_CHECKING:
    from datasets import Dataset, IterableDataset

HUB_NAMING = "the Hub's data/<split>-NNNNN-of-NNNNN file names"


class OfflineError(RuntimeError):
    """The dataset cannot be fetched (no network, nothing cached) and no local copy was given."""


@dataclass(frozen=True)
class Located:
    """Where one split's rows are read from, and what their ``source`` records."""

    split: str
    files: tuple[str, ...]  # Parquet files (local paths or hf:// URLs); for save_to_disk, the directory
    data_files: tuple[str, ...]  # the local files the rows come from (save_to_disk: its Arrow files)
    from_disk: bool  # a datasets.save_to_disk directory
    where: str  # the copy, for error messages: a local path, or "<repo id>@<commit[:10]>"
    revision: str | None = None  # the commit read, for a copy of the Hub repository
    note: str | None = None  # one line for the user: a revision other than the one asked for is read

    @property
    def origin(self) -> str:
        """``source`` before ``:<split>``: ``<repo id>@<commit[:10]>``, or ``<path>@sha256:<12 hex>`` (reads the
        files: call it once per conversion)."""
        if self.revision is not None:
            return self.where
        return f"{self.where}@sha256:{_sha256_prefix(self.data_files)}"


def is_save_to_disk(path: Path) -> bool:
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def _sha256_prefix(files) -> str:
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:12]


def _line(e: Exception) -> str:
    """An exception as one line: its type and the first line of its message."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def _no_split(where, split: str, have, how: str) -> DataError:
    return DataError(f"{where}: no split {split!r} (have: {', '.join(map(str, have)) or 'none'}; from {how})")


# ------------------------------------------------------------------------------------------- a split's files
def _split_of_file(name: str, pinned_split: str) -> tuple[str, str]:
    """A lone file's split, and why: its Hub name (``<split>-NNNNN-of-NNNNN.*``), else the pinned split."""
    from datasets.data_files import SPLIT_PATTERN_SHARDED
    from datasets.utils.py_utils import string_to_dict

    parts = string_to_dict(name, os.path.basename(SPLIT_PATTERN_SHARDED))
    if parts:
        return parts["split"], "its file name"
    return pinned_split, "a single file, read as the pinned split"


def _split_patterns(d: Path) -> tuple[dict[str, list[str]], Path, str] | None:
    """``{split: file patterns}`` of a folder, the folder they are relative to, and where they come from: the
    dataset card's default config (``datasets``' own reading of ``configs``), else the Hub's file names; None
    for neither (``datasets`` would then read every file as ``train``). Only the split asked for is resolved
    later, so a copy of one split (``hf download --include``) is enough."""
    from datasets.data_files import SPLIT_PATTERN_SHARDED, get_data_patterns, sanitize_patterns
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    readme = d / "README.md"
    try:
        configs = MetadataConfigs.from_dataset_card_data(DatasetCard.load(readme).data) if readme.is_file() else {}
        name = configs.get_default_config_name() if configs else None
    except Exception as e:  # noqa: BLE001 - a malformed card raises several types
        raise DataError(f"{readme}: cannot read the dataset card's configs ({_line(e)})") from None
    if configs and name is None:
        raise DataError(f"{readme}: the dataset card has several configs and none is the default "
                        f"(have: {', '.join(configs)})")
    params = configs.get(name, {}) if configs else {}
    base = d / params["data_dir"] if params.get("data_dir") else d
    if params.get("data_files"):
        return sanitize_patterns(params["data_files"]), base, f"the dataset card's configs ({readme.name})"
    try:
        patterns = get_data_patterns(str(base))
    except FileNotFoundError:  # no data files at all
        return None
    if configs:  # a card config without data_files: datasets infers them in its folder
        return patterns, base, f"the files in {base.name}/ of the dataset card's config {name!r}"
    if any(v != [SPLIT_PATTERN_SHARDED.format(split=k)] for k, v in patterns.items()):
        return None
    return patterns, base, HUB_NAMING


def split_files(path: Path, split: str, pinned_split: str, pinned_files: tuple[str, ...]) -> list[str]:
    """The Parquet files of ``split`` in a local file or folder (see the module docstring for the rule)."""
    from datasets.data_files import DataFilesList

    if path.is_file():
        has, how = _split_of_file(path.name, pinned_split)
        if has != split:
            raise _no_split(path, split, [has], how)
        return [str(path)]
    found = _split_patterns(path)
    if found is None:
        pinned = [path / f for f in pinned_files]
        if not pinned or not all(p.is_file() for p in pinned):
            raise DataError(f"{path}: cannot tell which files hold split {split!r}: no dataset card (README.md) "
                            f"with configs, no data/<split>-NNNNN-of-NNNNN.parquet files, and not the pinned "
                            f"{pinned_split!r} file(s) {', '.join(pinned_files)}")
        found = {pinned_split: list(pinned_files)}, path, f"the pinned file(s) {', '.join(pinned_files)}"
    patterns, base, how = found
    if split not in patterns:
        raise _no_split(path, split, patterns, how)
    try:
        files = [str(f) for f in DataFilesList.from_patterns(patterns[split], base_path=str(base))]
    except FileNotFoundError:  # a pattern without wildcards names a missing file
        files = []
    if not files:
        raise DataError(f"{path}: split {split!r} has no files in this copy (looked for "
                        f"{', '.join(map(str, patterns[split]))}, from {how})")
    return files


def _hub_snapshot_commit(path: Path, repo_id: str) -> str | None:
    """The commit when ``path`` is a snapshot folder of ``repo_id`` in a hub cache
    (``datasets--<org>--<name>/snapshots/<commit>``)."""
    from huggingface_hub.file_download import repo_folder_name

    p = path.absolute() if path.is_dir() else path.absolute().parent  # not resolved: files link into blobs/
    parent = p.parent
    if parent.name == "snapshots" and parent.parent.name == repo_folder_name(repo_id=repo_id, repo_type="dataset"):
        return p.name
    return None


# ------------------------------------------------------------------------------------------- locate
def locate_local(path: str | os.PathLike, split: str, repo_id: str, pinned_split: str,
                 pinned_files: tuple[str, ...]) -> Located:
    """``split`` of a local copy: a ``save_to_disk`` directory, a Parquet file, or a folder like the Hub's."""
    import datasets

    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"--local-path {p}: no such file or directory")
    if is_save_to_disk(p):
        ds = datasets.load_from_disk(str(p))  # memory-mapped: no rows are read here
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise _no_split(p, split, list(ds), "its datasets.save_to_disk splits")
            ds = ds[split]
        elif str(ds.split or pinned_split) != split:
            raise _no_split(p, split, [ds.split or pinned_split], "its datasets.save_to_disk split")
        return Located(split, (str(p),), tuple(f["filename"] for f in ds.cache_files), True, str(p))
    files = tuple(split_files(p, split, pinned_split, pinned_files))
    commit = _hub_snapshot_commit(p, repo_id)
    if commit is not None:  # a hub-cache snapshot passed by its path: the folder names the revision
        return Located(split, files, files, False, f"{repo_id}@{commit[:10]}", commit)
    return Located(split, files, files, False, str(p))


def _offline() -> bool:
    import datasets.config
    import huggingface_hub.constants

    return bool(huggingface_hub.constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE)


def locate_hub(repo_id: str, revision: str, split: str, pinned_split: str, pinned_files: tuple[str, ...],
               cache_dir: str | None = None) -> Located:
    """``split`` of ``repo_id`` at ``revision`` (a commit or a branch): on the Hub, its files as ``datasets``
    resolves them from the dataset card at the resolved commit; offline, from the hub cache."""
    if not _offline():
        import datasets
        from huggingface_hub import HfApi
        from huggingface_hub.utils import OfflineModeIsEnabled, httpx  # httpx: the client huggingface_hub uses

        try:
            commit = HfApi().dataset_info(repo_id, revision=revision).sha
        except (OfflineModeIsEnabled, httpx.ConnectError, httpx.TimeoutException):
            commit = None  # unreachable: as offline
        except Exception as e:  # noqa: BLE001 - no such repository or revision, gated, ...
            raise DataError(f"{repo_id}@{revision}: {_line(e)}") from None
        if commit is not None:
            where = f"{repo_id}@{commit[:10]}"
            try:
                by_split = datasets.load_dataset_builder(repo_id, revision=commit).config.data_files or {}
            except Exception as e:  # noqa: BLE001
                raise DataError(f"{where}: {_line(e)}") from None
            if split not in by_split:
                raise _no_split(where, split, by_split, "its dataset card's configs or file names")
            return Located(split, tuple(str(f) for f in by_split[split]), (), False, where, commit)
    return _locate_in_cache(repo_id, revision, split, pinned_split, pinned_files, cache_dir)


def _locate_in_cache(repo_id: str, revision: str, split: str, pinned_split: str, pinned_files: tuple[str, ...],
                     cache_dir: str | None) -> Located:
    """The split in a snapshot of the hub cache: of ``revision`` when it is there and holds the split, else of
    another revision (``refs/main`` first, then the newest), with a note naming it."""
    import huggingface_hub.constants
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    root = cache_dir or huggingface_hub.constants.HF_HUB_CACHE
    try:
        repos = scan_cache_dir(root).repos
    except CacheNotFound:
        repos = frozenset()
    revisions = [r for repo in repos if repo.repo_type == "dataset" and repo.repo_id == repo_id
                 for r in repo.revisions]

    def wanted(r) -> bool:
        return r.commit_hash.startswith(revision) or revision in r.refs

    revisions.sort(key=lambda r: (not wanted(r), "main" not in r.refs, -r.last_modified))
    first_error = None
    for r in revisions:
        try:
            files = split_files(Path(r.snapshot_path), split, pinned_split, pinned_files)
        except DataError as e:
            first_error = first_error or e
            continue
        note = None
        if not wanted(r):
            why = (f"holds no files of split {split!r}" if wanted(revisions[0]) else "is not there")
            refs = f" ({', '.join(sorted(r.refs))})" if r.refs else ""
            note = (f"{repo_id}: reading revision {r.commit_hash[:10]}{refs} from the hub cache {root}; the "
                    f"revision asked for, {revision[:10]}, {why}")
        return Located(split, tuple(files), tuple(files), False, f"{repo_id}@{r.commit_hash[:10]}", r.commit_hash,
                       note)
    if first_error is not None:
        raise first_error
    raise OfflineError(
        f"cannot load {repo_id} split {split!r}: no network, and no snapshot of it in the hub cache {root}; "
        f"download it where there is a network (hf download {repo_id} --repo-type dataset --revision {revision}) "
        "or pass --local-path <file or dir>")


# ------------------------------------------------------------------------------------------- open
def open_located(loc: Located, streaming: bool = False) -> Dataset | IterableDataset:
    """The split's rows: ``load_from_disk`` for a ``save_to_disk`` directory, else the ``parquet`` builder on
    the split's files only (the other splits are never read)."""
    import datasets

    if loc.from_disk:
        ds = datasets.load_from_disk(loc.files[0])
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[loc.split]
        return ds.to_iterable_dataset() if streaming else ds
    try:
        return datasets.load_dataset("parquet", data_files={loc.split: list(loc.files)}, split=loc.split,
                                     streaming=streaming)
    except Exception as e:  # noqa: BLE001 - pyarrow/datasets raise many types for an unreadable file
        raise DataError(f"{loc.where}: cannot read as Parquet ({type(e).__name__}: {e})") from None


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
