"""RCR's decode-time work as fused CPU ops (``rcr/csrc/``), registered as torch ops:

- ``torch.ops.rcr.detector_pass`` (``detector_pass.cpp``): the pass over the detector logits in one kernel. A
  compiled decode step (``RCRConfig.compile``) and offload mode call it; a compiled step without a graph break.
- ``torch.ops.rcr.decide`` (``decide.cpp``): an eager layer-step of ``rcr``, ``fixed`` or ``rcr_layer`` with the
  resident reader (``DriftRefresh._decide_op``): the decision, the threshold update, the telemetry record and the
  merge, in plain loops and without the ~100 torch calls. The candidates are scored only for the rows whose trigger
  fired; a row that did not fire keeps its selection, which is what the torch path's masked merge leaves it.
- ``torch.ops.rcr.merge_rows`` (``decide.cpp``): the masked merge of a re-selection (``ResidentLayer.refresh``) as
  row copies where the trigger fired.

The composed torch versions are their references and the path on every other device; the ops make the same
decisions (tests/rcr/test_rcr_reference.py, tests/rcr/test_fused.py, tests/rcr/test_rcr_decision.py). They are
built once per machine, on first use, with the C++ compiler that torch.compile also uses, into torch's extension
cache (``TORCH_EXTENSIONS_DIR``), for the CPU's vector width (``BUILDS``: ATen's AVX-512, AVX2 or generic vectors,
by ``torch.backends.cpu.get_cpu_capability()``); a build that does not compile falls back to a narrower one, and
where none does, RCR decodes with the torch path and a warning says so.

detector_pass:
    qr (B, Hkv, G, r) fp32, the rank-r query projections; projected_t (B, Hkv, r, Np) fp32; selection (B, Hkv, S)
    int64, the resident prefix entries; valid (B, Np) bool or None (no padding); kept (B, Hkv, G, S) fp32 or None,
    the kept entries' exact logits, which replace their approximate ones in the scores; lse_res (B, Hkv, G) fp32 or
    None, the exact log-sum-exp over the resident slots: mean_prob's normaliser becomes the context's; scaling;
    mean_prob
    -> lse_ev (B, Hkv, G), the log-sum-exp of the approximate logits over the evicted valid entries (-inf when
       there are none), and scores (B, Hkv, Np), the candidate scores (-inf on padding)
       (rcr.detector.Detector.evicted_lse_and_scores states both; it is the composed torch version)
"""

from __future__ import annotations

import functools
import hashlib
import logging
import sys
import warnings
from pathlib import Path

import torch

from .fileio import atomic_write_bytes

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("detector_pass.cpp", "decide.cpp")  # compiled; the headers are included by both
HEADERS = ("detector_pass.h", "kernels.h")
# ATen's vector width for each CPU capability (torch.backends.cpu.get_cpu_capability()): the build that matches the
# CPU comes first, then the narrower ones, and the generic build (ATen's plain-array vectors) last, so that a compiler
# without one of the flags still gives a working library
BUILDS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX512",
               "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "DEFAULT": ["-DCPU_CAPABILITY=DEFAULT"],
}


def builds_for(capability: str) -> list[str]:
    """The builds to try, in order, on a CPU of ``capability``: its own where there is one, the narrower ones, the
    generic."""
    order = list(BUILDS)
    return order[order.index(capability):] if capability in BUILDS else ["DEFAULT"]


def _fake(qr, projected_t, selection, valid, kept, lse_res, scaling, mean_prob):
    B, H, G, _ = qr.shape
    return qr.new_empty(B, H, G), qr.new_empty(B, H, projected_t.shape[-1])


def _cpp_extension():
    """``torch.utils.cpp_extension``, imported without its CUDA probe's warning.

    On a CUDA build of torch, importing the module resolves ``CUDA_HOME`` (the ``CUDA_HOME``/``CUDA_PATH``
    variables, else ``nvcc`` on ``PATH``, else ``/usr/local/cuda``) and, on a machine or Ray worker without a
    usable GPU, warns ``No CUDA runtime is found, using CUDA_HOME=...``. No environment avoids the probe where a
    CUDA toolkit is installed. These kernels are C++ only (``load(..., with_cuda=False)``), so what it finds is
    never used: its warning is dropped during the import, every other record of that logger is kept."""
    if "torch.utils.cpp_extension" not in sys.modules:
        log = logging.getLogger("torch.utils.cpp_extension")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            import torch.utils.cpp_extension  # noqa: F401
        finally:
            log.setLevel(level)
    return sys.modules["torch.utils.cpp_extension"]


def _load(ext, flags: list[str]) -> None:
    """Build (or find in the cache) and load the library with ``flags``, which registers the torch.ops.rcr ops.

    The library is named after a hash of its sources and flags, and built from a copy of the sources kept in its
    own build directory: two checkouts of the same source share one build instead of rebuilding each other's
    (ninja rebuilds when a source path changes), and an edited source gets a build of its own."""
    files = {f: (CSRC / f).read_bytes() for f in (*SOURCES, *HEADERS)}
    digest = hashlib.sha256(b"".join(f.encode() + code for f, code in files.items()) + repr(flags).encode())
    name = f"rcr_ops_{digest.hexdigest()[:12]}"
    build = Path(ext._get_build_directory(name, False))
    build.mkdir(parents=True, exist_ok=True)
    for f, code in files.items():
        if not (build / f).exists() or (build / f).read_bytes() != code:
            atomic_write_bytes(code, build / f)
    if not (build / f"{name}.so").exists():
        print(f"rcr: building the fused CPU kernels (once per machine; about a minute) in {build}",
              file=sys.stderr, flush=True)
    ext.load(name=name, sources=[str(build / f) for f in SOURCES], extra_cflags=["-O3", *flags],
             is_python_module=False, with_cuda=False, verbose=False)


def load_first(ext, builds: list[str]) -> str:
    """Load the first of ``builds`` (keys of BUILDS) that compiles; -> its name. Raises with every build's error
    where none does."""
    errors = []
    for cap in builds:
        try:
            _load(ext, BUILDS[cap])
        except Exception as exc:  # noqa: BLE001 -- a compiler without this build's flags: the next one
            errors.append(f"{cap}: {exc!s:.200}")
            continue
        return cap
    raise RuntimeError("; ".join(errors))


@functools.cache
def _extension() -> str:
    """Load the library built for this CPU (``builds_for``); -> the build's name."""
    cap = load_first(_cpp_extension(), builds_for(torch.backends.cpu.get_cpu_capability()))
    torch.library.register_fake("rcr::detector_pass")(_fake)
    return cap


def build() -> str | None:
    """The build of the loaded kernels (``AVX512``, ``AVX2`` or ``DEFAULT``), None where they could not be built."""
    return _extension() if available() else None


@functools.cache
def available() -> bool:
    """Whether the torch.ops.rcr ops are there (building them on first use: about a minute). False, with a
    warning, where the build fails (no C++ compiler, no writable cache)."""
    try:
        _extension()
    except Exception as exc:  # noqa: BLE001 -- any build failure means the torch path
        warnings.warn(f"rcr: the fused CPU kernels could not be built ({exc!s:.300}); RCR decodes on CPU "
                      "with the composed torch ops instead (slower, same decisions)", RuntimeWarning, stacklevel=2)
        return False
    return True
