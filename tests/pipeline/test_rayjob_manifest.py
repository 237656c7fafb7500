"""infra/kuberay-rayjob.yaml against the RayJob CRD of the KubeRay release it names (vendored in infra/kuberay/)
and against the job's resource plan, with infra/rayjob_check.py; and broken copies of it, each refused with a
line that names what is wrong."""

from __future__ import annotations

import hashlib
import importlib.util
import re

import pytest
import yaml

from tests.pipeline_helpers import REPO

_spec = importlib.util.spec_from_file_location("rayjob_check", REPO / "infra" / "rayjob_check.py")
rayjob_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rayjob_check)

MANIFEST = rayjob_check.MANIFEST


def test_the_vendored_crd_is_the_published_file():
    readme = rayjob_check.CRD_README.read_text()
    sha = re.search(r"SHA-256: `([0-9a-f]{64})`", readme).group(1)
    assert hashlib.sha256(rayjob_check.CRD.read_bytes()).hexdigest() == sha
    release = rayjob_check.RELEASE.search(readme).group(1)
    assert f"ray-project/kuberay/{release}/ray-operator/config/crd/bases/ray.io_rayjobs.yaml" in readme


def test_the_manifest_is_a_valid_rayjob_whose_workers_hold_the_actors(capsys):
    assert rayjob_check.main([str(MANIFEST)]) == 0
    out = capsys.readouterr().out
    with capsys.disabled():
        print(out.strip())
    assert out.startswith("ok: ")


def _edit_worker(doc, **params):
    doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(params)


def _flags(doc, old, new):
    doc["spec"]["entrypoint"] = doc["spec"]["entrypoint"].replace(old, new)
    assert new in doc["spec"]["entrypoint"]


def _misspelt_start_params(doc):
    group = doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    group["rayStartParam"] = group.pop("rayStartParams")


def _container_typo(doc):
    container = doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    container["resource"] = container.pop("resources")


BROKEN = {
    "misspelt field": (_misspelt_start_params, "spec.rayClusterSpec.workerGroupSpecs.0: Additional properties are "
                                               "not allowed ('rayStartParam' was unexpected)"),
    "misspelt container field": (_container_typo, "spec.rayClusterSpec.headGroupSpec.template.spec.containers.0: "
                                                  "Additional properties are not allowed ('resource' was unexpected)"),
    "wrong type": (lambda d: _edit_worker(d, replicas="four"),
                   "spec.rayClusterSpec.workerGroupSpecs.0.replicas: 'four' is not of type 'integer'"),
    "more actors than GPUs": (lambda d: _flags(d, "--num-actors 4", "--num-actors 8"),
                              "field 'num_actors': the job cannot be placed: 8 actor(s) x {CPU: 1, GPU: 1} and a read "
                              "task {CPU: 0.25} do not fit on the cluster's 5 node(s): 4 x {CPU: 8, GPU: 1} + "
                              "1 x {CPU: 8, GPU: 0}"),
    "idle GPUs": (lambda d: _flags(d, "--num-actors 4", "--num-actors 2"),
                  "the worker groups hold 4 GPU(s) at their replicas, the entrypoint's 2 actor(s) x 1 GPU ask for 2"),
    "actor bigger than a node": (lambda d: _flags(d, "--num-actors 4", "--num-actors 4 --cpus-per-actor 16"),
                                 "field 'cpus_per_actor': the job cannot be placed: 4 actor(s) x {CPU: 16, GPU: 1}"),
    # two lines: Ray would also count 8 GPUs on the workers for 4 actors
    "GPUs Ray sees but the pod has not": (lambda d: _edit_worker(d, rayStartParams={"num-gpus": "2"}),
                                          "worker group gpu-workers tells Ray num-gpus=2 but its container's "
                                          "nvidia.com/gpu limit is 1", 2),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_manifest_is_refused_naming_what_is_wrong(case, tmp_path, capsys):
    edit, want, *n = BROKEN[case]
    text = MANIFEST.read_text()
    doc = yaml.safe_load(text)
    edit(doc)
    header = "".join(ln for ln in text.splitlines(keepends=True) if ln.startswith("#"))
    bad = tmp_path / "rayjob.yaml"
    bad.write_text(header + yaml.safe_dump(doc, sort_keys=False))
    assert rayjob_check.main([str(bad)]) == 1
    out = capsys.readouterr().out
    with capsys.disabled():
        print(f"[{case}] {out.strip()}")
    lines = out.strip().splitlines()
    assert len(lines) == (n[0] if n else 1) and want in lines[0], out


def test_a_manifest_for_another_kuberay_release_is_refused(tmp_path):
    vendored = rayjob_check.RELEASE.search(rayjob_check.CRD_README.read_text())[1]
    bad = tmp_path / "rayjob.yaml"
    bad.write_text(MANIFEST.read_text().replace(f"Written for KubeRay {vendored}", "Written for KubeRay v0.9.9", 1))
    assert rayjob_check.check(bad) == [
        f"release: the manifest names KubeRay v0.9.9, the vendored CRD is {vendored} ({rayjob_check.CRD_README})"]


def test_a_missing_manifest_is_one_line_not_a_traceback(tmp_path, capsys):
    assert rayjob_check.main([str(tmp_path / "rayjob.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"{tmp_path / 'rayjob.yaml'}: no such file (give a RayJob manifest, e.g. {MANIFEST})"
