"""Check a KubeRay RayJob manifest before applying it: against the RayJob CRD of the KubeRay release it names
(vendored in infra/kuberay/), and against what the job's driver will ask the cluster for.

    python infra/rayjob_check.py [infra/kuberay-rayjob.yaml]    # "ok: ..." or one line per problem, exit 1

1. Release: the KubeRay release the manifest's header names is the vendored CRD's (infra/kuberay/README.md).
2. Schema: the manifest validates (jsonschema) against the CRD's ``openAPIV3Schema`` for its apiVersion, with
   unknown fields refused, as ``kubectl apply`` does by default (``--validate=strict``): an object schema
   that lists its properties is closed. The CRD's few CEL rules (``x-kubernetes-validations``, on deletion
   policies and ``managedBy``) are the API server's and are not evaluated here.
3. Resources: the entrypoint is read by the job's own config (``pipeline.run.cli.job_config``). The nodes are the head
   and ``replicas`` of each worker group, each with the CPUs and GPUs that KubeRay hands to ``ray start``
   (``rayStartParams`` num-cpus / num-gpus, else the container's limits). The driver's resource plan
   (``pipeline/run/placement.py``) must place the actors on them, a group's ``num-gpus`` must equal its
   containers' ``nvidia.com/gpu`` limit, and the workers' GPUs must be num_actors x gpus_per_actor (none
   idle, none missing).
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from functools import cache
from pathlib import Path

import yaml

from pipeline.run.cli import job_config
from pipeline.run.config import ConfigError, JobConfig
from pipeline.run.placement import Node, plan_actors

REPO = Path(__file__).resolve().parent.parent

CRD = REPO / "infra" / "kuberay" / "ray.io_rayjobs.yaml"
CRD_README = REPO / "infra" / "kuberay" / "README.md"
MANIFEST = REPO / "infra" / "kuberay-rayjob.yaml"
RELEASE = re.compile(r"KubeRay (v\d+\.\d+\.\d+)")
JOBS = ("detailcaps", "textcaps", "video")


def _closed(schema):
    """A copy of an OpenAPI schema in which every object that lists properties refuses others."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@cache
def crd_schema(api_version: str) -> dict:
    """The vendored CRD's schema for ``api_version`` (e.g. ``ray.io/v1``), closed as above."""
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    group, _, version = api_version.partition("/")
    if group != crd["spec"]["group"]:
        raise ValueError(f"apiVersion {api_version!r}: the CRD's group is {crd['spec']['group']!r}")
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return _closed(v["schema"]["openAPIV3Schema"])
    raise ValueError(f"apiVersion {api_version!r}: the CRD has versions {[v['name'] for v in crd['spec']['versions']]}")


def release_errors(manifest_text: str) -> list[str]:
    named = RELEASE.search(manifest_text)
    vendored = RELEASE.search(CRD_README.read_text())
    if named is None:
        return ["release: the manifest's header names no KubeRay release (e.g. 'KubeRay v1.7.0')"]
    if vendored is None or named.group(1) != vendored.group(1):
        return [f"release: the manifest names KubeRay {named.group(1)}, the vendored CRD is "
                f"{vendored.group(1) if vendored else 'unnamed'} ({CRD_README})"]
    return []


def schema_errors(doc: dict) -> list[str]:
    """One line per violation, ``spec.rayClusterSpec...: message``, in document order."""
    import jsonschema

    try:
        schema = crd_schema(str(doc.get("apiVersion")))
    except ValueError as e:
        return [f"apiVersion: {e}"]
    if doc.get("kind") != "RayJob":
        return [f"kind: {doc.get('kind')!r} is not 'RayJob'"]
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: [str(p) for p in e.path])
    return [f"{'.'.join(map(str, e.path)) or '<root>'}: {e.message[:300]}" for e in errors]


def _quantity(value) -> float:
    """A Kubernetes quantity of CPUs or devices: ``8``, ``"8"``, ``"500m"``."""
    s = str(value).strip()
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


def _group_node(group: dict, name: str) -> tuple[Node, list[str]]:
    """The node a head or worker group gives Ray, and the mismatches between its params and its containers."""
    params = group.get("rayStartParams") or {}
    limits = [(c.get("resources") or {}).get("limits") or {} for c in group["template"]["spec"]["containers"]]
    requests = [(c.get("resources") or {}).get("requests") or {} for c in group["template"]["spec"]["containers"]]
    ray_container = limits[0]  # KubeRay runs `ray start` in the first container
    cpu = ray_container.get("cpu", requests[0].get("cpu", 0))
    gpus_limit = _quantity(ray_container.get("nvidia.com/gpu", 0))
    cpus = _quantity(params.get("num-cpus", cpu))
    gpus = _quantity(params.get("num-gpus", gpus_limit))
    errors = []
    if gpus > gpus_limit:
        errors.append(f"resources: {name} tells Ray num-gpus={gpus:g} but its container's nvidia.com/gpu limit is "
                      f"{gpus_limit:g}")
    return Node(name, name, cpus, gpus), errors


def entrypoint_config(entrypoint: str) -> JobConfig:
    """The job config of a RayJob entrypoint ``python jobs/<task>.py FLAGS``, validated by the job itself."""
    argv = shlex.split(entrypoint)
    task = Path(argv[1]).stem if len(argv) > 1 else ""
    if argv[0] != "python" or task not in JOBS or not (REPO / argv[1]).is_file():
        raise ConfigError("entrypoint", f"expected 'python jobs/<{'|'.join(JOBS)}>.py ...', got {entrypoint!r}")
    return job_config(argv[2:], task=task)


def resource_errors(doc: dict) -> list[str]:
    spec = doc["spec"]
    try:
        cfg = entrypoint_config(spec["entrypoint"])
    except ConfigError as e:
        return [f"spec.entrypoint: {e}"]
    cluster = spec["rayClusterSpec"]
    head, errors = _group_node(cluster["headGroupSpec"], "head")
    nodes = [head]
    worker_gpus = 0.0
    for g in cluster.get("workerGroupSpecs") or []:
        node, errs = _group_node(g, f"worker group {g.get('groupName')}")
        errors += errs
        nodes += [node] * int(g.get("replicas", 0))
        worker_gpus += node.gpus * int(g.get("replicas", 0))
    try:
        plan = plan_actors(cfg, nodes)
    except ConfigError as e:
        return [*errors, f"resources: the entrypoint's {e}"]
    wanted = cfg.num_actors * plan.num_gpus
    if worker_gpus != wanted:
        errors.append(f"resources: the worker groups hold {worker_gpus:g} GPU(s) at their replicas, the entrypoint's "
                      f"{cfg.num_actors} actor(s) x {plan.num_gpus:g} GPU ask for {wanted:g}: match --num-actors "
                      "and --gpus-per-actor to the replicas")
    return errors


def check(path: Path) -> list[str]:
    text = Path(path).read_text()
    doc = yaml.safe_load(text)
    problems = release_errors(text) + schema_errors(doc)
    if not problems:  # the resource check reads the fields the schema guarantees
        problems += resource_errors(doc)
    return problems


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="Check a KubeRay RayJob manifest against the vendored RayJob CRD and "
                                 "against what the job's driver asks the cluster for.")
    ap.add_argument("manifest", nargs="?", type=Path, default=MANIFEST, help="default: %(default)s")
    path = ap.parse_args(argv).manifest
    if not path.is_file():
        print(f"{path}: no such file (give a RayJob manifest, e.g. {MANIFEST})", file=sys.stderr)
        return 2
    problems = check(path)
    for p in problems:
        print(f"{path}: {p}")
    if not problems:
        release = RELEASE.search(CRD_README.read_text())[1]
        print(f"ok: {path} is a valid RayJob for the vendored KubeRay CRD ({release}), and its workers hold what "
              "the entrypoint's actors ask for")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
