"""Write the embedded model's InfiniGen calibration (rerun after retraining the model):

    python -m embedded.calibration                          # into rcr/embedded_model/infinigen_calibration/
    python -m embedded.calibration --model embedded-drift   # into rcr/embedded_drift_model/infinigen_calibration/

InfiniGen is calibrated offline, once, on prompts it is not evaluated on (docs/algorithms.md, "infinigen"): here 8
synthetic DetailCaps scenes drawn with a seed that neither training nor the evaluation shards use. The directory
records the digest of the weights it was made for; a job refuses it for other weights (``rcr.skewing``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.data import synthetic
from pipeline.tasks import TASKS
from rcr.embedded import NAME, resolve, scene_layout_of
from rcr.methods.infinigen import N_CALIBRATION
from rcr.skewing import SHIPPED_DIR, calibration_digest

CALIBRATION_SEED = 20_000  # synthetic scenes of the shipped calibration: not the recipe's seeds, not evaluation's


def main(argv: list[str] | None = None) -> int:
    from PIL import Image

    from rcr.calibrate_infinigen import calibrate_to_dir
    from rcr.models import build_inputs, load

    from .recipe import Recipe

    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m embedded.calibration", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=NAME, help="an embedded model's name (default: the default, 'embedded') or a "
                    "model directory")
    ap.add_argument("--out", default=None, help="output directory (default: the model's infinigen_calibration/)")
    ap.add_argument("--n", type=int, default=N_CALIBRATION,
                    help=f"synthetic detailcaps scenes (default {N_CALIBRATION})")
    ap.add_argument("--seed", type=int, default=CALIBRATION_SEED, help=f"scene seed (default {CALIBRATION_SEED})")
    args = ap.parse_args(argv)
    where = resolve(args.model)
    recipe = Recipe.load(where)  # the scenes the model was trained on are drawn with its seeds
    if args.seed in (recipe.seed, recipe.polish_seed, synthetic.HELDOUT_SEED):
        ap.error(f"--seed {args.seed} is a training seed ({recipe.seed}, {recipe.polish_seed}) or the evaluation "
                 f"seed ({synthetic.HELDOUT_SEED})")
    out = args.out or str(Path(where) / SHIPPED_DIR)
    layout = scene_layout_of(recipe.to_dict())  # the scenes the model answers (its share stage's, where it has one)
    model, processor = load(where, device="cpu", dtype="float32")
    prompt = TASKS["detailcaps"].prompt
    scenes = [synthetic.render("detailcaps", args.seed, i, layout=layout)[0][0] for i in range(args.n)]
    inputs = [build_inputs(processor, [prompt], [[Image.fromarray(f)]]) for f in scenes]
    desc = (f"offline: {args.n} synthetic detailcaps scenes (layout {layout}, seed {args.seed}; training uses "
            f"seeds {recipe.seed} and {recipe.polish_seed}, the evaluation shards {synthetic.HELDOUT_SEED})")
    meta = calibrate_to_dir(model, inputs, out, meta={
        "description": desc, "model": args.model, "prompt": prompt,
        "command": " ".join(["python -m embedded.calibration", *argv])})
    print(f"wrote {Path(out) / 'infinigen.safetensors'} (sha256 {calibration_digest(out)}): {meta['n_layers']} layers "
          f"x {meta['n_kv_heads']} KV heads, {meta['partial_columns']} partial columns, {meta['n_tokens']} tokens "
          f"from {meta['n_prompts']} scenes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
