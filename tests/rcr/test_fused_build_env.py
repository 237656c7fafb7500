"""rcr.fused builds its C++-only kernels without the CUDA probe's warning that importing
torch.utils.cpp_extension prints on a CUDA build of torch where no GPU is usable (a Ray CPU actor, a CPU machine
with a CUDA toolkit): `No CUDA runtime is found, using CUDA_HOME=...`."""

import os
import subprocess
import sys

import pytest
import torch

WARNING = "No CUDA runtime is found"


def _run(code: str, tmp_path) -> str:
    """stderr of ``code`` in a fresh interpreter that sees a CUDA toolkit (an ``nvcc`` on PATH) and no GPU."""
    bin_dir = tmp_path / "cuda" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "nvcc").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "nvcc").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stderr


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU build of torch has no CUDA probe")
def test_kernel_build_environment_prints_no_cuda_probe_warning(tmp_path):
    # the probe warns when torch.utils.cpp_extension is imported as is: the condition this guards against
    assert WARNING in _run("import torch.utils.cpp_extension", tmp_path)
    err = _run("import rcr.fused as F; ext = F._cpp_extension(); assert callable(ext.load)", tmp_path)
    assert WARNING not in err, err
