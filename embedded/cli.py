"""The trainer's command line: run options, ``--recipe FILE``, and one flag per recipe field that overrides it.

    python jobs/train_embedded.py                        # the shipped recipe (rcr/embedded_model/recipe.json)
    python jobs/train_embedded.py --steps 40 --polish-steps 8 --vision-steps 4   # one field each
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from pipeline.run.config import default_runs_root
from rcr.config import ConfigError

from .loops import RunOptions
from .recipe import Recipe, shipped_recipe_path

EXAMPLES = """examples:
  python jobs/train_embedded.py --same-as rcr/embedded_model  # retrain the shipped model, compare (~92 min, 2 cores)
  python jobs/train_embedded.py --export /tmp/peek            # a running training's last checkpoint, as a model dir
  python jobs/train_embedded.py --device cuda                 # minutes on a GPU (other weights: other arithmetic)
"""


def _none_or(parse):
    def convert(text: str):
        return None if text.lower() == "none" else parse(text)
    return convert


def _threads(text: str):
    return text if text == "auto" else int(text)


def _mix_word(text: str) -> tuple[str, float]:
    task, _, w = text.partition("=")
    try:
        return task, float(w)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give TASK=W with a number W") from None


def _add_recipe_flags(group) -> None:
    """One flag per recipe field, default None (= the recipe file's value)."""
    for f in dataclasses.fields(Recipe):
        flag, kind = f"--{f.name.replace('_', '-')}", str(f.type)
        help = f.metadata["help"].replace("%", "%%")  # argparse formats help strings
        if f.name == "threads":
            group.add_argument(flag, type=_threads, help=help)
        elif f.name == "sink_ramp":
            group.add_argument(flag, nargs="+", metavar="FRAC", type=_none_or(float), help=help)
        elif f.name == "polish_mix":
            group.add_argument(flag, nargs="+", metavar="TASK=W", type=_none_or(_mix_word), help=help)
        elif kind.startswith("tuple[str"):
            group.add_argument(flag, nargs="*", metavar="TASK", help=help)
        elif kind.startswith("tuple[int"):
            group.add_argument(flag, nargs="+", metavar="LAYER", type=int, help=help)
        elif kind.startswith("tuple[float"):
            group.add_argument(flag, nargs=2, metavar=("LOW", "HIGH"), type=float, help=help)
        else:
            group.add_argument(flag, type={"int": int, "float": float, "str": str}[kind], help=help)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="train_embedded.py", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        description="Train the embedded model (a tiny Qwen2-VL on synthetic scenes) from its recipe: a vision stage, "
                    "a main stage and a polish stage, checkpointed every few minutes; rerun, it resumes.")
    run = ap.add_argument_group("run")
    root = default_runs_root() / "train_embedded"
    run.add_argument("--recipe", default=None, metavar="FILE",
                     help=f"recipe file, or a model directory carrying one (default: the shipped one, "
                          f"{shipped_recipe_path().relative_to(shipped_recipe_path().parents[2])})")
    run.add_argument("--out", default=str(root / "model"), help="where the trained model directory goes "
                     "(default: %(default)s)")
    run.add_argument("--run-dir", default=str(root), help="checkpoints and summary (default: %(default)s)")
    run.add_argument("--device", default="cpu", help="cpu or cuda")
    run.add_argument("--same-as", default=None, metavar="DIR", help="a model directory (read at the start) whose "
                     "weights this run should reproduce: the last line says whether it did, bit for bit")
    run.add_argument("--export", default=None, metavar="DIR", help="save --run-dir's checkpoint as a model "
                     "directory at DIR and exit (no training): look at a run while it trains")
    run.add_argument("--init-from", default=None, metavar="DIR", help="start from a saved model directory's weights")
    run.add_argument("--fresh", action="store_true", help="ignore existing checkpoints in --run-dir")
    run.add_argument("--ckpt-minutes", type=float, default=4.0, help="minutes between checkpoints")
    run.add_argument("--minutes", type=float, default=None, help="stop and save after this many minutes (smoke runs)")
    run.add_argument("--stop-after", type=int, default=None, metavar="N",
                     help="checkpoint and stop after N steps of this process, over all stages (no model saved)")
    _add_recipe_flags(ap.add_argument_group("recipe fields (each overrides the recipe file's value)"))
    return ap


def parse(argv=None) -> tuple[Recipe, RunOptions]:
    """The recipe (the file's, with the flags' overrides) and the run options; a bad field exits with a message
    that names it."""
    ap = parser()
    args = ap.parse_args(argv)
    changes = {}
    for f in dataclasses.fields(Recipe):
        value = getattr(args, f.name)
        if value is None:
            continue
        if f.name in ("sink_ramp", "polish_mix"):
            value = None if value == [None] else value
            if f.name == "polish_mix" and value is not None:
                value = dict(value)
        changes[f.name] = value
    try:
        recipe = Recipe.load(args.recipe).replace(**changes)
    except ConfigError as exc:
        ap.error(str(exc))
    opts = RunOptions(run_dir=Path(args.run_dir), out=Path(args.out), device=args.device, minutes=args.minutes,
                      stop_after=args.stop_after, ckpt_minutes=args.ckpt_minutes, fresh=args.fresh,
                      init_from=args.init_from, same_as=args.same_as, export=args.export)
    return recipe, opts


def main(argv=None) -> int:
    """``python jobs/train_embedded.py``: print the recipe, train (``embedded.train.run``)."""
    from . import train

    recipe, opts = parse(argv)
    print("recipe: " + " ".join(f"{k}={v}" for k, v in recipe.to_dict().items()), flush=True)
    train.run(recipe, opts)
    return 0
