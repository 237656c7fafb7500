"""Pre-flight: the checks a job makes on its model and device before Ray starts.

Without them a model that cannot be loaded fails inside every actor, once per retry, with a traceback each.
Here each failure is one line that names the flag and says what to do, and the job exits with code 2::

    --model Qwen/Qwen2.5-VL-7B-Instruct: not in the local cache and the Hub is unreachable: download it first
    with `hf download Qwen/Qwen2.5-VL-7B-Instruct`, or pass a local directory

Checks, in order (``check``):

1. ``--model`` resolves: ``embedded``, a local directory with a ``config.json``, or a Hub id whose snapshot is
   in the local cache (huggingface_hub's own lookup, ``snapshot_download(local_files_only=True)``) or, when
   online, whose ``config.json`` the Hub serves.
2. Its ``model_type`` is one that ``rcr`` supports (``rcr.models.SUPPORTED``).
3. Its processor loads (``AutoProcessor``), and takes video when the task is ``video``.
4. ``--device cuda``: a GPU is visible to the driver, for a job that starts its own local cluster; on an
   existing cluster the driver may run on a GPU-less head node, so ``check_cluster`` asks the cluster instead.

Checks 2-3 concern the core library's loader: another engine (``--engine module:Class``) loads its own model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipeline.run.config import ConfigError, JobConfig
from rcr.embedded import is_embedded
from rcr.embedded import model_dir as embedded_model_dir


class PreflightError(ConfigError):
    """A model or device that cannot be used. Printed as one line: ``--<flag> <value>: <what to do>``."""

    def __init__(self, flag: str, value: str, message: str, sep: str = ": "):
        super().__init__(flag, message)
        self.line = f"--{flag} {value}{sep}{message}"

    def __str__(self) -> str:
        return self.line


def check(cfg: JobConfig) -> None:
    """Every pre-flight check for ``cfg``; raises :class:`PreflightError` on the first failure."""
    if cfg.device == "cuda" and not _on_existing_cluster(cfg):
        check_local_gpu()
    if cfg.engine != "rcr":
        return
    path = resolve_model(cfg.model)
    check_model_type(cfg.model, path)
    check_processor(cfg.model, path, cfg.task, cfg.trust_remote_code)


def _on_existing_cluster(cfg: JobConfig) -> bool:
    return bool(cfg.ray_address or os.environ.get("RAY_ADDRESS"))


# ---------------------------------------------------------------------- 1. the model resolves


def resolve_model(model: str, cache_dir: str | None = None) -> str:
    """The directory holding ``model``'s files (or, for a Hub id that is reachable but not cached, the id:
    the actors download it). ``cache_dir``: the Hub cache (default: huggingface_hub's, ``HF_HUB_CACHE``)."""
    if is_embedded(model):
        where = embedded_model_dir(model)
        if not (where / "config.json").is_file():
            raise PreflightError("model", model, f"the embedded model is missing at {where} (it ships with the "
                                                 "repository; train it with jobs/train_embedded.py)")
        return str(where)
    p = Path(model).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise PreflightError("model", model, "this path has no config.json: pass a checkpoint directory "
                                                 "(config.json, weights, processor files) or a Hub id")
        return str(p.resolve())
    return _resolve_hub_id(model, cache_dir)


def _resolve_hub_id(repo_id: str, cache_dir: str | None) -> str:
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url, is_offline_mode, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
    )

    unreachable = (f"not in the local cache and the Hub is unreachable: download it first with "
                   f"`hf download {repo_id}`, or pass a local directory")
    try:  # a complete snapshot of the default revision in the local cache
        return snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True)
    except HFValidationError:
        raise PreflightError("model", repo_id, "neither a local directory nor a valid Hub id (owner/name)") from None
    except LocalEntryNotFoundError:
        pass
    if is_offline_mode():
        raise PreflightError("model", repo_id, unreachable + " (HF_HUB_OFFLINE is set)")
    try:  # online: the Hub must know the id and serve its config; the actors download the rest
        # one request first, without retries: hf_hub_download retries a Hub it cannot reach for half a minute,
        # logging a line per try, before it gives up
        try:
            get_hf_file_metadata(hf_hub_url(repo_id, "config.json"), timeout=10)
        except (GatedRepoError, RepositoryNotFoundError, RemoteEntryNotFoundError):
            raise
        except Exception:  # noqa: BLE001 - a connection error of whichever HTTP client huggingface_hub uses
            raise PreflightError("model", repo_id, unreachable) from None
        return str(Path(hf_hub_download(repo_id, "config.json", cache_dir=cache_dir)).parent)
    except GatedRepoError:
        raise PreflightError("model", repo_id, "the repository is gated: accept its terms on huggingface.co and "
                                               "log in with `hf auth login`") from None
    except RepositoryNotFoundError:
        raise PreflightError("model", repo_id, "no such model on the Hub (check the id; a private one needs "
                                               "`hf auth login`)") from None
    except RemoteEntryNotFoundError:
        raise PreflightError("model", repo_id, "the repository has no config.json: not a transformers "
                                               "checkpoint") from None
    except (LocalEntryNotFoundError, OSError):  # connection errors, timeouts, Hub down
        raise PreflightError("model", repo_id, unreachable) from None


# ---------------------------------------------------------------------- 2. a supported family


def check_model_type(model: str, path: str) -> str:
    """The checkpoint's ``model_type``; raises unless ``rcr`` supports it. ``path``: from :func:`resolve_model`."""
    from rcr.models import SUPPORTED

    try:
        model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, json.JSONDecodeError) as e:
        raise PreflightError("model", model, f"its config.json does not read ({type(e).__name__}: {e})") from None
    if model_type not in SUPPORTED:
        raise PreflightError("model", model, f"model_type {model_type} is not supported; supported: "
                                             f"{', '.join(SUPPORTED)}")
    return model_type


# ---------------------------------------------------------------------- 3. the processor loads


def check_processor(model: str, path: str, task: str, trust_remote_code: bool = False) -> None:
    from transformers import AutoProcessor
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # this check's output is its one line
    try:
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any reason the loader would fail in every actor
        reason = str(e).strip().split("\n")[0].split(". ")[0].rstrip(".")  # the first sentence: one line
        raise PreflightError("model", model, f"its processor does not load ({type(e).__name__}: {reason[:160]}); "
                                             "the directory needs the processor and tokenizer files "
                                             "(save them with processor.save_pretrained)") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if task == "video" and getattr(processor, "video_processor", None) is None:
        raise PreflightError("model", model, f"its processor ({type(processor).__name__}) takes no video: the video "
                                             "task needs a video-capable family (see README, Supported models)")


# ---------------------------------------------------------------------- 4. the device exists


def check_local_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        raise PreflightError("device", "cuda", "no GPU is visible (CUDA_VISIBLE_DEVICES="
                                               f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): pass --device cpu, "
                                               "or --device auto to use a GPU where there is one", sep=" but ")


def check_cluster(cfg: JobConfig, resources: dict[str, float]) -> None:
    """``--device cuda`` on an existing cluster: the cluster must have a GPU (``ray.cluster_resources()``)."""
    if cfg.device == "cuda" and resources.get("GPU", 0.0) < 1:
        raise PreflightError("device", "cuda", "the Ray cluster has no GPU: pass --device cpu, or --device auto",
                             sep=" but ")
