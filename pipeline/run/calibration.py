"""Held-out samples for the methods that calibrate offline (docs/pipeline.md, "Calibration").

A method says, for the job's model, how many samples it calibrates on (``Method.calibration_samples``; InfiniGen
asks for 8 unless it was given a calibration or the checkpoint ships one) and what its calibration is
(``Method.calibration_record``). The pipeline knows nothing else of it:

* the driver (:func:`plan`) takes the first ok input rows after the evaluated ones (``--limit``), in shard order,
  and records each method's calibration in ``rcr.extra["<label>_calibration"]``, so in the config hash, the run
  record and MLflow's params; a method that needs samples the job cannot spare raises a ConfigError naming its
  field and the ways out;
* each actor (:func:`prepare_methods`) builds those rows into processor inputs once, at start-up, calls
  ``Method.prepare`` on every method and checks that each calibration is the one the driver recorded.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

RECORD_SUFFIX = "_calibration"  # rcr.extra["<label>_calibration"]: what a method label was calibrated on


@dataclass(frozen=True)
class Heldout:
    """The held-out input rows of a job: their ``source`` (a description) and content digest, and the rows
    (``sample_id``, ``task``, ``prompt``, ``images``)."""

    source: str
    sha256: str
    rows: list[dict] = field(default_factory=list)

    def info(self) -> dict[str, str]:
        return {"source": self.source, "sha256": self.sha256}


@dataclass(frozen=True)
class CalibrationPlan:
    records: dict[str, dict]  # label -> Method.calibration_record
    heldout: Heldout | None  # the rows, when some method calibrates on them

    def payload(self) -> dict | None:
        """What an actor needs (:func:`prepare_methods`); None when no method calibrates."""
        if not self.records:
            return None
        return {"records": self.records, "heldout": asdict(self.heldout) if self.heldout else None}


def _methods(cfg) -> list:
    import rcr
    from rcr.methods import parse_method

    config = rcr.RCRConfig.from_dict(cfg.rcr)
    return [parse_method(label, config) for label in cfg.methods]


def plan(cfg, paths: list[str], evaluated: list) -> CalibrationPlan:
    """Each method's calibration for ``cfg``'s job. ``paths``: the job's shard files; ``evaluated``: the rows it
    evaluates (``ShardRow``, from the shard scan)."""
    model_dir = cfg.model_path()
    methods = _methods(cfg)
    n = max((m.calibration_samples(model_dir) for m in methods), default=0)
    heldout = _heldout(cfg, paths, evaluated, n) if n else None
    records = {}
    for m in methods:
        wants = m.calibration_samples(model_dir) > 0
        record = m.calibration_record(model_dir, heldout.info() if wants and heldout else None)
        if record is not None:
            records[m.label] = record
    return CalibrationPlan(records, heldout)


def _heldout(cfg, paths: list[str], evaluated: list, n: int) -> Heldout | None:
    """The first ``n`` ok input rows after the evaluated ones, in shard order; None when the job evaluates them
    all (no ``--limit``) or none are left."""
    import pyarrow.parquet as pq

    from pipeline.run.inputs import scan_shards
    from pipeline.run.select import fingerprint_row

    if cfg.limit is None:
        return None
    ids = {r.sample_id for r in evaluated}
    after = scan_shards(paths, len(evaluated) + 4 * n)[0][len(evaluated):]
    spare = [r for r in after if r.error is None and r.sample_id not in ids][:n]
    if not spare:
        return None
    rows = []
    for r in spare:
        t = pq.read_table(r.file, columns=["sample_id", "task", "prompt", "images", "references", "source"])
        rows.append(t.slice(r.row, 1).to_pylist()[0])
    digest = hashlib.sha256(json.dumps([fingerprint_row(x) for x in rows]).encode()).hexdigest()[:16]
    ids_ = [x["sample_id"] for x in rows]
    source = f"heldout: {len(rows)} input rows after the {len(evaluated)} evaluated ({ids_[0]} .. {ids_[-1]})"
    return Heldout(source, digest, [{k: x[k] for k in ("sample_id", "task", "prompt", "images")} for x in rows])


def prepare_methods(methods: list, model, processor, model_dir: str, payload: dict | None,
                    limits: tuple[int, int, int]) -> None:
    """In an actor: ``Method.prepare`` for every method (the held-out rows of ``payload`` as processor inputs for
    those that calibrate on them), then check each calibration against the driver's record. ``limits``: max
    frames, image bytes and pixels of an input row."""
    from pipeline.data.images import load_sample_images
    from pipeline.tasks import TASKS
    from rcr.models import build_inputs

    payload = payload or {"records": {}, "heldout": None}
    held = Heldout(**payload["heldout"]) if payload["heldout"] else None
    samples = None
    for m in methods:
        if held is not None and m.calibration_samples(model_dir) > 0:
            if samples is None:
                samples = [build_inputs(processor, [r["prompt"]], [load_sample_images(r["images"], r["task"], *limits)],
                                        video=TASKS[r["task"]].video) for r in held.rows]
            m.prepare(model, samples, held.source)
        else:
            m.prepare(model)
        want = payload["records"].get(m.label)
        got = m.calibration_record(model_dir, held.info() if held and m.calibration_samples(model_dir) else None)
        if want is not None and (got or {}).get("sha256") != want["sha256"]:
            raise RuntimeError(f"{m.label}: this worker's calibration ({got}) is not the one the driver recorded "
                               f"({want})")
