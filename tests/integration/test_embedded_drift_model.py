"""The shipped drift test bed (rcr/embedded_drift_model, docs/embedded.md): its files and recipe, that it loads by
name wherever the default does, and the one property it exists for: drift that differs in scale between samples,
set by a property its images show, so that a fixed threshold refreshes some samples rarely and others often."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import rcr
from embedded.recipe import Recipe
from pipeline.data import synthetic as S
from pipeline.run.config import JobConfig
from pipeline.tasks import TASKS
from rcr.embedded import model_dir, scene_layout

NAME = "embedded-drift"
# RCR_EMBEDDED_DRIFT_MODEL lets a candidate be checked before it is shipped
MODEL_DIR = Path(os.environ.get("RCR_EMBEDDED_DRIFT_MODEL", model_dir(NAME)))


def test_files_recipe_and_size():
    """The weights (under the default's 16 MB cap), the processor, the InfiniGen calibration, and the recipe that
    made it: the default's recipe with a share stage on the tinted layout v6, which the jobs then draw."""
    weights = MODEL_DIR / "model.safetensors"
    assert weights.is_file() and weights.stat().st_size < 16_000_000
    for f in ("config.json", "tokenizer.json", "processor_config.json", "chat_template.jinja",
              "infinigen_calibration/infinigen.safetensors"):
        assert (MODEL_DIR / f).is_file(), f
    recipe, default = Recipe.load(MODEL_DIR), Recipe.load(model_dir())
    assert recipe.share_steps > 0 and recipe.share_layout == "v6"
    # the default's recipe up to the stage (a recipe without one is written without its fields)
    assert recipe.replace(share_steps=0, threads=default.threads).to_dict() == default.to_dict()
    assert scene_layout(str(MODEL_DIR)) == "v6" and scene_layout("embedded") == S.DEFAULT_LAYOUT


def test_loads_by_name_in_the_library_and_the_job():
    cfg = JobConfig.from_dict({"model": NAME})
    assert cfg.model_path() == str(model_dir(NAME)) and cfg.job_name.endswith(NAME)
    with pytest.raises(ValueError, match="embedded models are embedded, embedded-drift"):
        model_dir("embedded-drifts")


def test_drift_differs_in_scale_between_samples_as_the_tint_says():
    """On held-out v6 descriptions, the three scenes of lowest tint drift several times less than the three of
    highest (the image's share of a step's attention follows the tint), and ``fixed`` at its default threshold
    refreshes the low ones in well under a fifth of the layer-steps and the high ones in over 0.3 more. The full
    figures, by drift tercile on 60 samples with CIs, come from ``jobs/eval_embedded.py --model embedded-drift``."""
    model, processor = rcr.models.load(NAME)
    tints = {i: S.scene_tint("detailcaps", S.HELDOUT_SEED, i, "v6") for i in range(24)}
    ranked = sorted(tints, key=tints.get)
    picks = ranked[:3] + ranked[-3:]
    frames = [[Image.fromarray(S.render("detailcaps", S.HELDOUT_SEED, i, layout="v6")[0][0])] for i in picks]
    inputs = rcr.models.build_inputs(processor, [TASKS["detailcaps"].prompt] * len(picks), frames)
    torch.manual_seed(0)
    res = rcr.generate(model, inputs, method=["full", "fixed"], max_new_tokens=TASKS["detailcaps"].max_new_tokens)
    drift = np.array([np.nanmean(res["fixed"].sample(b)["drift"]) for b in range(len(picks))])
    refresh = np.array([np.nanmean(res["fixed"].sample(b)["trigger"]) for b in range(len(picks))])
    print(f"tints {[round(tints[i], 2) for i in picks]}: drift {drift.round(3)}, fixed refresh {refresh.round(2)}")
    assert drift[3:].mean() > 3 * drift[:3].mean(), drift
    assert refresh[:3].mean() < 0.2 and refresh[3:].mean() > refresh[:3].mean() + 0.3, refresh
