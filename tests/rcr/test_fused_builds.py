"""rcr.fused builds its kernels for the CPU it runs on (torch.backends.cpu.get_cpu_capability(): AVX-512, AVX2, or
ATen's generic vectors), falls back to a narrower build where one does not compile, and every build makes the
reference decisions. A build for a narrower CPU is forced with torch's ATEN_CPU_CAPABILITY, which lowers the
capability torch reports, in a fresh interpreter (the capability is read once per process)."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import rcr.fused as F

ROOT = Path(__file__).resolve().parents[2]
ORDER = ["AVX512", "AVX2", "DEFAULT"]


def test_builds_for_a_capability_are_its_own_then_the_narrower_ones():
    assert F.builds_for("AVX512") == ORDER
    assert F.builds_for("AVX2") == ["AVX2", "DEFAULT"]
    assert F.builds_for("DEFAULT") == ["DEFAULT"]
    assert F.builds_for("SVE256") == F.builds_for("NO AVX") == ["DEFAULT"]  # no vector build of ours: the generic one


def test_a_build_that_does_not_compile_falls_back_to_the_next(tmp_path):
    tried = []

    def load(name, sources, extra_cflags, **kwargs):
        tried.append(extra_cflags)
        if "-mavx512f" in extra_cflags:
            raise RuntimeError("cc1plus: error: unrecognized command-line option '-mavx512f'")

    ext = SimpleNamespace(_get_build_directory=lambda name, verbose: str(tmp_path / name), load=load)
    assert F.load_first(ext, ORDER) == "AVX2"
    assert [flags[1:] for flags in tried] == [F.BUILDS["AVX512"], F.BUILDS["AVX2"]]
    for f in (*F.SOURCES, *F.HEADERS):  # each build compiles its own copy of the sources
        assert len(list(tmp_path.glob(f"rcr_ops_*/{f}"))) == 2

    def never(name, sources, extra_cflags, **kwargs):
        raise RuntimeError("no compiler")

    with pytest.raises(RuntimeError, match="AVX512: no compiler; AVX2: no compiler; DEFAULT: no compiler"):
        F.load_first(SimpleNamespace(_get_build_directory=ext._get_build_directory, load=never), ORDER)


def supported(cap: str) -> bool:
    return cap in F.builds_for(torch.backends.cpu.get_cpu_capability())


@pytest.mark.skipif(not F.available(), reason="the fused kernels could not be built here")
@pytest.mark.parametrize("cap", ["DEFAULT", "AVX2"])
def test_a_narrower_build_makes_the_reference_decisions(cap):
    """The build a CPU without AVX-512 (AVX2) or without AVX2 (DEFAULT) gets: every path of the reference test."""
    if not supported(cap):
        pytest.skip(f"this CPU cannot run the {cap} build")
    code = ("import sys, pytest, rcr.fused as F\n"
            f"assert F.build() == {cap!r}, F.build()\n"
            "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/rcr/test_rcr_reference.py', "
            "'tests/rcr/test_fused.py::test_kernel_equals_the_torch_ops_and_the_definition']))\n")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": cap.lower(), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
                       check=False)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]
