"""Train the embedded default model (a tiny Qwen2-VL on the synthetic scenes) from its recipe (``embedded/``).

    python jobs/train_embedded.py                                    # the shipped recipe
    python jobs/train_embedded.py --same-as rcr/embedded_model       # ... and say whether it rebuilt the shipped one
    python jobs/train_embedded.py --steps 40 --polish-steps 8 --vision-steps 4 --out /tmp/smoke --run-dir /tmp/smoke

The recipe is ``rcr/embedded_model/recipe.json``; each flag of ``--help``'s "recipe fields" overrides one field.
Installed: ``rcr-train-embedded`` (docs/embedded.md).
"""

from embedded.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
