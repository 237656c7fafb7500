"""Train the embedded default model (a tiny Qwen2-VL on the synthetic scenes) from its recipe.

    python jobs/train_embedded.py                                    # the shipped recipe (~92 min on 2 cores)
    python jobs/train_embedded.py --same-as rcr/embedded_model       # ... and say whether it rebuilt the shipped one
    python jobs/train_embedded.py --steps 40 --polish-steps 8 --vision-steps 4 --out /tmp/smoke --run-dir /tmp/smoke

The recipe is ``rcr/embedded_model/recipe.json``; each flag of ``--help``'s "recipe fields" overrides one field.
The trainer is ``embedded`` (docs/embedded.md).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from embedded import cli, train  # noqa: E402


def main(argv=None):
    recipe, opts = cli.parse(argv)
    print("recipe: " + " ".join(f"{k}={v}" for k, v in recipe.to_dict().items()), flush=True)
    return train.run(recipe, opts)


if __name__ == "__main__":
    main()
