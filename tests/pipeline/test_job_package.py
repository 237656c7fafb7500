"""What a submitted job carries (.rayignore): Ray packages the working directory, and the package holds the project's
packages whatever else the checkout holds. The lmms-eval tasks a user wrote into the checkout (392 MB of scenes)
once made every `ray job submit --working-dir .` fail with HTTP 413 (Ray's 100 MiB limit on a package).

Packaged with Ray's own function (``ray._private.runtime_env.packaging.create_package``, what ``ray job submit`` and
``JobSubmissionClient`` call), on a copy of the checkout's top level made of links plus the files a user's commands
leave there."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest

from tests.pipeline_helpers import REPO

PACKAGES = ("rcr", "pipeline", "jobs", "embedded")  # what the job entry points import
BUILD = ("__pycache__",)


def project_files() -> set[str]:
    """Every file under the project's packages in the checkout, bytecode left out."""
    out = set()
    for pkg in PACKAGES:
        for root, dirs, files in os.walk(REPO / pkg):
            dirs[:] = [d for d in dirs if d not in BUILD and not d.endswith(".egg-info")]
            out.update(str((Path(root) / f).relative_to(REPO)) for f in files if not f.endswith(".pyc"))
    return out


@pytest.mark.parametrize("default_excludes", [False, True], ids=["quickstart", "ray-job-submit-cli"])
def test_the_job_package_holds_the_projects_packages_whatever_else_the_checkout_holds(tmp_path, default_excludes):
    from ray._private import ray_constants
    from ray._private.runtime_env.packaging import create_package

    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for entry in REPO.iterdir():  # the checkout as it is (.git, .venv, docs, tests, ... included)
        if entry.name != "pipeline":
            (checkout / entry.name).symlink_to(entry)
    pipeline = checkout / "pipeline"  # one package with a user's new module and its bytecode beside the real files
    pipeline.mkdir()
    for entry in (REPO / "pipeline").iterdir():
        if entry.name not in BUILD:
            (pipeline / entry.name).symlink_to(entry)
    (pipeline / "my_task.py").write_text("X = 1\n")
    (pipeline / "__pycache__").mkdir()
    (pipeline / "__pycache__" / "my_task.cpython-311.pyc").write_bytes(b"\0" * 64)
    # what a user's commands leave at the top level: lmms-eval tasks and results, data, notes, a venv, a module
    junk = ["tasks/rcr_detailcaps.yaml", "tasks/utils.py", "tasks/shards/detailcaps/detailcaps-00000.parquet",
            "results/embedded/20260101_results.json", "data.parquet", "notes.md", "scratch.py", "rcr_old/x.py",
            "venv2/lib/big.bin", ".cache/x"]
    for name in junk:
        if not (checkout / name).exists():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            (checkout / name).write_bytes(os.urandom(1024))

    excludes = ray_constants.RAY_RUNTIME_ENV_DEFAULT_EXCLUDES.split(",") if default_excludes else []
    pkg = tmp_path / "package.zip"
    create_package(str(checkout), pkg, include_gitignore=True, excludes=excludes)
    names = {n for n in zipfile.ZipFile(pkg).namelist() if not n.endswith("/")}

    assert {n.split("/")[0] for n in names} == set(PACKAGES), sorted({n.split("/")[0] for n in names})
    want = project_files() | {"pipeline/my_task.py"}
    assert names == want, sorted(names ^ want)
    assert "rcr/embedded_model/config.json" in names  # the embedded model travels with the library
    assert pkg.stat().st_size < 100 * 2**20  # Ray's limit on a package
