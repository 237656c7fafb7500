"""The driver's pre-flight (pipeline/run/preflight.py) on local fixtures, offline (HF_HUB_OFFLINE=1): a saved
checkpoint of every family passes and loads; each failure is one line naming the flag. The job's exit code 2
before Ray starts: tests/integration/test_preflight_job.py."""

from __future__ import annotations

import json
import shutil

import huggingface_hub
import pytest
import torch

import rcr
from pipeline.run import preflight
from pipeline.run.cli import job_config
from pipeline.run.preflight import PreflightError
from rcr.models import SUPPORTED, build_inputs, load
from tests import tiny_models

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> a directory holding its tiny model and processor, saved like a real checkpoint."""
    root = tmp_path_factory.mktemp("ckpt")
    dirs = {}

    def get(family: str):
        if family not in dirs:
            model, proc = tiny_models.FAMILIES[family]()
            d = root / family
            model.save_pretrained(d)
            proc.save_pretrained(d)
            dirs[family] = d
        return dirs[family]

    return get


def hub_cache(root, repo_id: str, files_from) -> str:
    """A Hugging Face cache (huggingface_hub's layout: refs/main -> snapshots/<commit>) holding ``repo_id``."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(files_from, repo / "snapshots" / COMMIT)
    return str(root)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1 for this module (huggingface_hub reads the variable once, at import)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert huggingface_hub.is_offline_mode()


def test_every_family_saved_as_a_checkpoint_passes_and_loads(family, saved):
    """The family's processor survives save/load, the loader accepts it, and rcr decodes from the reloaded
    model exactly as transformers does."""
    name, _, _ = family
    d = saved(name)
    path = preflight.resolve_model(str(d))
    assert preflight.check_model_type(str(d), path) == name
    preflight.check_processor(str(d), path, "detailcaps")
    model, proc = load(path)
    inputs = build_inputs(proc, [tiny_models.random_prompt(0, 5), tiny_models.random_prompt(1, 9)],
                          [[tiny_models.random_image(0, 112)], [tiny_models.random_image(1, 112)]])
    res = rcr.generate(model, inputs, method=["full", "rcr@candidates=4096"], max_new_tokens=4, ignore_eos=True,
                       config=rcr.RCRConfig(selected=4096, window=8))
    ref = model.generate(**inputs, max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert torch.equal(res["full"].sequences, ref[:, inputs["input_ids"].shape[1]:])
    assert torch.equal(res["rcr@candidates=4096"].sequences, res["full"].sequences)


def test_a_hub_id_in_the_local_cache_resolves_to_its_snapshot(saved, tmp_path):
    cache = hub_cache(tmp_path / "hub", "acme/tiny-vlm", saved("qwen2_5_vl"))
    path = preflight.resolve_model("acme/tiny-vlm", cache_dir=cache)
    assert path.endswith(f"snapshots/{COMMIT}")
    assert preflight.check_model_type("acme/tiny-vlm", path) == "qwen2_5_vl"
    preflight.check_processor("acme/tiny-vlm", path, "video")  # Qwen2.5-VL takes video


def test_a_hub_id_not_in_the_cache_while_offline_is_one_line(tmp_path):
    (tmp_path / "hub").mkdir()
    with pytest.raises(PreflightError) as e:
        preflight.resolve_model("acme/absent-vlm", cache_dir=str(tmp_path / "hub"))
    assert str(e.value) == ("--model acme/absent-vlm: not in the local cache and the Hub is unreachable: download "
                            "it first with `hf download acme/absent-vlm`, or pass a local directory "
                            "(HF_HUB_OFFLINE is set)")
    assert e.value.field == "model"


def test_a_hub_id_while_the_hub_is_unreachable_is_one_line_without_retries(tmp_path, monkeypatch, caplog):
    """Online, but nothing answers at the Hub's address (here: a closed port on 127.0.0.1): one request, then the
    one line; not huggingface_hub's download, which retries an unreachable Hub five times, a log line each."""
    from tests.ray_head import free_port

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        endpoint + "/{repo_id}/resolve/{revision}/{filename}")

    def download(*a, **k):
        raise AssertionError("hf_hub_download (and its retries) reached")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    (tmp_path / "hub").mkdir()
    with caplog.at_level("INFO"), pytest.raises(PreflightError) as e:
        preflight.resolve_model("acme/absent-vlm", cache_dir=str(tmp_path / "hub"))
    assert str(e.value) == ("--model acme/absent-vlm: not in the local cache and the Hub is unreachable: download "
                            "it first with `hf download acme/absent-vlm`, or pass a local directory")
    assert not [r for r in caplog.records if "Retry" in r.getMessage()]


def test_an_unsupported_model_type_names_the_supported_ones(tmp_path):
    d = tmp_path / "bert"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "bert"}))
    cache = hub_cache(tmp_path / "hub", "acme/text-only", d)
    path = preflight.resolve_model("acme/text-only", cache_dir=cache)
    with pytest.raises(PreflightError) as e:
        preflight.check_model_type("acme/text-only", path)
    assert str(e.value) == ("--model acme/text-only: model_type bert is not supported; "
                            f"supported: {', '.join(SUPPORTED)}")
    for t in ("qwen2_5_vl", "qwen3_vl_moe", "llava_onevision", "internvl", "gemma3", "llava"):
        assert t in SUPPORTED


def test_a_processor_that_does_not_load_and_a_video_task_without_video(tmp_path, saved):
    d = tmp_path / "weights-only"
    d.mkdir()
    shutil.copy(saved("qwen2_vl") / "config.json", d / "config.json")
    with pytest.raises(PreflightError) as e:
        preflight.check_processor(str(d), str(d), "detailcaps")
    line = str(e.value)
    assert line.startswith(f"--model {d}: its processor does not load (") and "\n" not in line
    for family in ("gemma3", "llava"):  # image-only processors
        with pytest.raises(PreflightError, match=r"takes no video"):
            preflight.check_processor(family, str(saved(family)), "video")
        preflight.check_processor(family, str(saved(family)), "detailcaps")


def test_device_cuda_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = job_config(["--device", "cuda", "--engine", "tests.pipeline_helpers:FakeEngine"], task="detailcaps")
    with pytest.raises(PreflightError) as e:
        preflight.check(cfg)
    assert str(e.value).startswith("--device cuda but no GPU is visible") and e.value.field == "device"
    with pytest.raises(PreflightError, match="the Ray cluster has no GPU"):
        preflight.check_cluster(cfg, {"CPU": 8.0})
    preflight.check_cluster(cfg, {"CPU": 8.0, "GPU": 1.0})
