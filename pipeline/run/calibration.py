"""InfiniGen's calibration for a job: once, offline, on samples the job does not evaluate (docs/pipeline.md,
"InfiniGen calibration"; docs/algorithms.md, "infinigen").

InfiniGen's authors calibrate their skew matrices and partial columns once, on a calibration text, never on
the prompt being evaluated. A job with ``infinigen`` among its methods therefore resolves
``rcr.infinigen_calibration`` in the driver (:func:`resolve`), before the config hash is taken:

* a directory (``--rcr infinigen_calibration=DIR``, from ``python -m rcr.calibrate_infinigen``): used as given;
* ``per_sample``: each sample calibrated on its own prefill, the ablation;
* unset, embedded model: the calibration shipped with it, ``rcr/embedded_model/infinigen_calibration/``,
  made by ``python -m pipeline.run.calibration`` on synthetic scenes of a seed that neither training nor the
  evaluation shards use;
* unset, any other model: the first ``N_HELDOUT`` input rows after the evaluated ones (``--limit``), in shard
  order; each actor calibrates on them once, at start-up (:func:`materialize`). A job that evaluates every
  row has none to spare: the driver then names the field and the three ways out.

The resolved source and its digest go into ``rcr.extra.infinigen_calibration`` (so into the config hash, the
run record and MLflow's params); every ``infinigen`` row records the calibration it used (``calibration``,
``calibration_sha256``).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rcr.skewing import CALIBRATION_META, PER_SAMPLE, calibration_digest

CALIBRATION_DIR = "infinigen_calibration"  # the embedded model's shipped calibration, inside its directory
CALIBRATION_SEED = 20_000  # synthetic scenes of the shipped calibration: not the recipe's seeds, not evaluation's
N_HELDOUT = 8  # calibration samples (the shipped file and held-out input rows): ~3k prompt tokens on the embedded
# model, the scale of InfiniGen's 2048-token PG-19 calibration text


class CalibrationError(ValueError):
    """No calibration can be resolved; the message says why and what to pass instead."""


@dataclass(frozen=True)
class CalibrationSpec:
    """What a job's ``infinigen`` rows are calibrated on. ``kind``: "dir" (a given directory), "shipped"
    (the embedded model's), "heldout" (input rows the job does not evaluate) or "per_sample"."""

    kind: str
    source: str  # human-readable; recorded in the config (hash), the run record and MLflow
    sha256: str  # of the tensor file ("dir", "shipped"), of the held-out rows' contents ("heldout"), or ""
    rows: list[dict] = field(default_factory=list)  # "heldout": sample_id, task, prompt, images

    def record(self) -> dict[str, str]:
        """The part that goes into ``rcr.extra`` (no image bytes)."""
        return {"kind": self.kind, "source": self.source, "sha256": self.sha256}

    def actor_payload(self) -> dict[str, Any] | None:
        """What an actor needs to materialise it; None when the config's directory (or per-sample) suffices."""
        return asdict(self) if self.kind in ("shipped", "heldout") else None


def shipped_dir() -> Path:
    from rcr.embedded import model_dir

    return model_dir() / CALIBRATION_DIR


def _meta(path: str | os.PathLike) -> dict:
    f = Path(path) / CALIBRATION_META
    return json.loads(f.read_text()) if f.is_file() else {}


def embedded_weights_sha256() -> str:
    """sha256 (16 hex digits) of the embedded model's weights: the shipped calibration records the model it
    was made for, and a job refuses it for another (a retrained model needs a new calibration)."""
    from rcr.embedded import model_dir

    return hashlib.sha256((model_dir() / "model.safetensors").read_bytes()).hexdigest()[:16]


def runs_infinigen(methods: list[str]) -> bool:
    from rcr.methods import parse_method

    return any(parse_method(m).name == "infinigen" for m in methods)


def resolve(cfg, paths: list[str], evaluated: list) -> CalibrationSpec | None:
    """The calibration of ``cfg``'s ``infinigen`` rows (None when it runs no infinigen). ``paths``: the job's
    shard files; ``evaluated``: the rows it evaluates (``ShardRow``, from ``scan_shards``)."""
    if not runs_infinigen(cfg.methods):
        return None
    value = cfg.rcr.get("infinigen_calibration")
    if value == PER_SAMPLE:
        return CalibrationSpec("per_sample", "per_sample: each sample's own prefill (ablation)", "")
    if value is not None:
        return CalibrationSpec("dir", _meta(value).get("description") or str(value), calibration_digest(value))
    if cfg.model == "embedded":
        d = shipped_dir()
        meta = _meta(d)
        if not (d / "infinigen.safetensors").is_file():
            raise CalibrationError(f"the embedded model's InfiniGen calibration {d} is missing; write it with "
                                   "`python -m pipeline.run.calibration`")
        if meta.get("model_sha256") != embedded_weights_sha256():
            raise CalibrationError(f"the embedded model's InfiniGen calibration {d} was made for other weights "
                                   f"(model sha256 {meta.get('model_sha256')}, these are {embedded_weights_sha256()}); "
                                   "rewrite it with `python -m pipeline.run.calibration`")
        return CalibrationSpec("shipped", meta.get("description") or "embedded model's shipped calibration",
                               calibration_digest(d))
    return _heldout(cfg, paths, evaluated)


def _heldout(cfg, paths: list[str], evaluated: list) -> CalibrationSpec:
    """The first ``N_HELDOUT`` ok input rows after the evaluated ones, in shard order."""
    import pyarrow.parquet as pq

    from pipeline.run.store import fingerprint_row, scan_shards

    spare = []
    if cfg.limit is not None:
        ids = {r.sample_id for r in evaluated}
        after = scan_shards(paths, len(evaluated) + 4 * N_HELDOUT)[0][len(evaluated):]
        spare = [r for r in after if r.error is None and r.sample_id not in ids][:N_HELDOUT]
    if not spare:
        raise CalibrationError(
            "InfiniGen is calibrated offline, on input rows the job does not evaluate, and this job evaluates "
            "every row: pass --limit below the input size (the rows after it are the calibration set), a "
            "calibration directory (`python -m rcr.calibrate_infinigen --model M --out DIR [--images DIR]`, then "
            "--rcr infinigen_calibration=DIR), or --rcr infinigen_calibration=per_sample (the ablation)")
    rows = []
    for r in spare:
        t = pq.read_table(r.file, columns=["sample_id", "task", "prompt", "images", "references", "source"])
        rows.append(t.slice(r.row, 1).to_pylist()[0])
    h = hashlib.sha256(json.dumps([fingerprint_row(x) for x in rows]).encode()).hexdigest()[:16]
    ids = [x["sample_id"] for x in rows]
    source = f"heldout: {len(rows)} input rows after the {len(evaluated)} evaluated ({ids[0]} .. {ids[-1]})"
    return CalibrationSpec("heldout", source, h, [{k: x[k] for k in ("sample_id", "task", "prompt", "images")}
                                                  for x in rows])


def calibrate_rows(model, processor, rows: list[dict], ratio: float, out_dir: str | os.PathLike,
                   description: str, limits: tuple[int, int, int] = (64, 64 * 2**20, 50_000_000),
                   extra: dict | None = None, window: int = 32) -> dict:
    """Calibrate on input rows (``sample_id``, ``task``, ``prompt``, ``images`` bytes) and write the directory
    (``rcr.skewing.save_calibration``) with ``calibration.json`` = how (plus ``extra``). ``limits``: max
    frames, image bytes and pixels; ``window``: the queries of each prompt's last ``window`` tokens calibrate the
    skew, the keys before them the columns (``rcr.calibrate_infinigen.calibrate``). Returns that meta."""
    import torch
    import transformers

    from pipeline.data.images import load_sample_images
    from rcr.calibrate_infinigen import calibrate
    from rcr.models import build_inputs
    from rcr.skewing import save_calibration

    inputs = [build_inputs(processor, [r["prompt"]], [load_sample_images(r["images"], r["task"], *limits)],
                           video=r["task"] == "video") for r in rows]
    skews, cols, stats = calibrate(model, inputs, ratio, window)
    meta = {"description": description, "sample_ids": [r["sample_id"] for r in rows], "partial_ratio": ratio,
            "dtype": str(next(model.parameters()).dtype), "torch": torch.__version__,
            "transformers": transformers.__version__, **stats, **(extra or {})}
    save_calibration(str(out_dir), skews, cols, meta)
    return meta


def materialize(payload: dict, engine, cfg) -> tuple[str, tempfile.TemporaryDirectory | None]:
    """In an actor: the calibration directory of ``payload`` (``CalibrationSpec.actor_payload``), and the
    temporary directory holding it when the actor had to calibrate (keep it alive while decoding)."""
    spec = CalibrationSpec(**payload)
    if spec.kind == "shipped":
        d = shipped_dir()
        got = calibration_digest(d)
        if got != spec.sha256:
            raise RuntimeError(f"this worker's {d} (sha256 {got}) is not the driver's ({spec.sha256})")
        return str(d), None
    tmp = tempfile.TemporaryDirectory(prefix="rcr-infinigen-")
    ratio = cfg.rcr.get("infinigen_partial_ratio", 0.25)
    calibrate_rows(engine.model, engine.processor, spec.rows, ratio, tmp.name, spec.source,
                   (cfg.max_frames, cfg.max_image_bytes, cfg.max_image_pixels), window=cfg.rcr.get("window", 32))
    return tmp.name, tmp


def main(argv: list[str] | None = None) -> int:
    """Write the embedded model's shipped calibration (rerun after retraining the model)."""
    from embedded.recipe import Recipe
    from pipeline.data import synthetic
    from rcr.embedded import model_dir
    from rcr.models import load

    ap = argparse.ArgumentParser(prog="python -m pipeline.run.calibration", description=main.__doc__)
    ap.add_argument("--out", default=str(shipped_dir()), help="output directory (default: the shipped one)")
    ap.add_argument("--n", type=int, default=N_HELDOUT, help=f"synthetic detailcaps scenes (default {N_HELDOUT})")
    ap.add_argument("--seed", type=int, default=CALIBRATION_SEED, help=f"scene seed (default {CALIBRATION_SEED})")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    recipe = Recipe.load(model_dir())  # the scenes the model was trained on are drawn with its seeds
    if args.seed in (recipe.seed, recipe.polish_seed, synthetic.HELDOUT_SEED):
        ap.error(f"--seed {args.seed} is a training seed ({recipe.seed}, {recipe.polish_seed}) or the evaluation "
                 f"seed ({synthetic.HELDOUT_SEED})")
    model, processor = load(str(model_dir()), device="cpu", dtype="float32")
    rows = [synthetic.make_record("detailcaps", args.seed, i, layout=synthetic.DEFAULT_LAYOUT) for i in range(args.n)]
    desc = (f"offline: {args.n} synthetic detailcaps scenes (layout {synthetic.DEFAULT_LAYOUT}, seed {args.seed}; "
            f"training uses seeds {recipe.seed} and {recipe.polish_seed}, the evaluation shards "
            f"{synthetic.HELDOUT_SEED})")
    command = " ".join(["python -m pipeline.run.calibration", *(sys.argv[1:] if argv is None else argv)])
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    meta = calibrate_rows(model, processor, rows, 0.25, args.out, desc,
                          extra={"command": command, "created_utc": created, "model": "embedded",
                                 "model_sha256": embedded_weights_sha256()})
    print(f"wrote {Path(args.out) / 'infinigen.safetensors'} (sha256 {calibration_digest(args.out)}): "
          f"{meta['n_layers']} layers x {meta['n_kv_heads']} KV heads, {meta['partial_columns']} partial columns, "
          f"{meta['n_tokens']} tokens from {meta['n_prompts']} scenes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
