"""The wheel ships the embedded model as package data: `rcr.models.load("embedded")` works from any directory
after a non-editable install (here: a temporary venv on top of this interpreter's site-packages, so torch and
transformers come from there, while `rcr` comes from the wheel)."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from rcr.embedded import model_dir

REPO = Path(__file__).resolve().parents[2]
MODEL_FILES = ("config.json", "model.safetensors", "processor_config.json", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # --no-build-isolation: setuptools comes from this interpreter, nothing is downloaded
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(REPO)], check=True, cwd=out, capture_output=True, text=True)
    (whl,) = out.glob("rcr-*.whl")
    return whl


def test_wheel_holds_the_embedded_model(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in MODEL_FILES:
        assert f"rcr/embedded_model/{f}" in names, f"rcr/embedded_model/{f} is not in {wheel.name}"
    assert "rcr/embedded.py" in names and "pipeline/run/config.py" in names
    for f in ("infinigen.safetensors", "calibration.json"):  # its InfiniGen calibration (pipeline/run/calibration.py)
        assert f"rcr/embedded_model/infinigen_calibration/{f}" in names, f
    shipped = (model_dir() / "model.safetensors").stat().st_size
    assert zipfile.ZipFile(wheel).getinfo("rcr/embedded_model/model.safetensors").file_size == shipped


def test_installed_wheel_loads_embedded_from_elsewhere(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    # This interpreter may itself be a venv (its packages are not the base Python's "system" ones): put its
    # site-packages on the new venv's path, after the venv's own, as plain paths. Their .pth files (the
    # editable install of the repository among them) are not processed, so only the wheel provides `rcr`.
    site_dir = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                   check=True, capture_output=True, text=True).stdout.strip())
    (site_dir / "outer_site.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
    # the venv has no pip of its own; this interpreter's pip installs into it (`pip --python`);
    # --ignore-installed: the editable install visible through the system site-packages must not count
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
                    "--ignore-installed", "-q", str(wheel)], check=True, capture_output=True, text=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = (
        "import rcr, rcr.models, torch\n"
        "m, p = rcr.models.load('embedded')\n"
        "print(rcr.__file__)\n"
        "print(type(m).__name__, sum(x.numel() for x in m.parameters()), p.tokenizer.padding_side)\n"
    )
    # -I: isolated mode (no PYTHONPATH, no user site, cwd not on sys.path), so the editable install's
    # repository copy cannot shadow the wheel's
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    r = subprocess.run([str(py), "-I", "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True,
                       check=False, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rcr_file, summary = r.stdout.strip().splitlines()[-2:]
    assert rcr_file.startswith(str(env_dir)), f"imported {rcr_file}, not the wheel's copy under {env_dir}"
    cls, n_params, side = summary.split()
    assert cls == "Qwen2VLForConditionalGeneration" and int(n_params) > 0 and side == "left"
