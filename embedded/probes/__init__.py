"""Probes of the embedded model on its synthetic scenes, each runnable as ``python -m embedded.probes.<name>``
(``--help`` says what it measures): ``reading``, ``position``, ``attribute``, ``quality_gap``, ``vision_bootstrap``,
``attention`` (the per-layer attention profile with the described cell), ``drift_spread`` (per kind of scene) and
``budget_sweep``. The premise check for any model is ``jobs/diagnose.py`` (``pipeline.diagnose``).
"""
