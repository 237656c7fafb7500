"""The embedded model's recipe as data (embedded/recipe.py, cli.py): one file holds the shipped recipe,
a flag overrides one field, bad values are refused naming the field, and a checkpoint resumes only under the
recipe that made it."""

from __future__ import annotations

import json

import pytest

from embedded import cli
from embedded.recipe import ALL_FIELDS, MAIN_FIELDS, POLISH_FIELDS, VISION_FIELDS, Recipe, shipped_recipe_path
from pipeline.data import synthetic as S
from rcr.config import ConfigError


def shipped() -> dict:
    return json.loads(shipped_recipe_path().read_text())


def test_the_shipped_recipe_is_one_file_the_trainer_reads_by_default():
    r = Recipe.load()
    assert r.to_dict() == shipped()
    recipe, opts = cli.parse([])
    assert recipe == r and opts.out.parent == opts.run_dir  # the model lands inside the run directory
    assert Recipe.load(shipped_recipe_path().parent) == r  # a model directory carrying its recipe


def test_a_flag_overrides_one_field_and_only_that_one():
    base = Recipe.load().to_dict()
    recipe, _ = cli.parse(["--steps", "4000", "--polish-mix", "textcaps=2", "--sink-ramp", "none",
                           "--ground-tasks", "textcaps", "detailcaps", "detailcaps", "--threads", "auto"])
    got = recipe.to_dict()
    assert got["steps"] == 4000 and got["polish_mix"] == {"textcaps": 2.0} and got["sink_ramp"] is None
    assert got["ground_tasks"] == ["detailcaps", "textcaps"] and got["threads"] == "auto"  # one spelling per set
    changed = {k for k in base if base[k] != got[k]}
    assert changed == {"steps", "polish_mix", "sink_ramp", "ground_tasks", "threads"}


@pytest.mark.parametrize("change, field", [
    ({"size": "huge"}, "size"), ({"layout": "v9"}, "layout"), ({"threads": 0}, "threads"), ({"lr": 0}, "lr"),
    ({"vision_lr_scale": 0}, "vision_lr_scale"), ({"steps": 0}, "steps"), ({"ground_loss": -1}, "ground_loss"),
    ({"sink_ramp": [0.5, 0.3]}, "sink_ramp"), ({"sink_ramp": [0.1, 1.5]}, "sink_ramp"),
    ({"polish_steps": 5000}, "polish_steps"), ({"polish_cooldown": 1.5}, "polish_cooldown"),
    ({"seed": S.HELDOUT_SEED}, "seed"), ({"polish_seed": S.HELDOUT_SEED}, "polish_seed"),
    ({"polish_mix": {"images": 1.0}}, "polish_mix"), ({"polish_mix": {"video": 0.0}}, "polish_mix"),
    ({"polish_mix": {"video": float("inf")}}, "polish_mix"), ({"ground_layer": 4}, "ground_layer"),
    ({"ground_tasks": ["video"]}, "ground_tasks"), ({"layout": "v2"}, "ground_tasks"),
    ({"polish_ground_spread": ["detailcaps"], "polish_steps": 0}, "polish_ground_spread"),
    ({"share_steps": -1}, "share_steps"), ({"share_steps": 5000}, "share_steps"),
    ({"share_layout": "v5"}, "share_layout"),
    ({"share_loss": -1}, "share_loss"), ({"share_range": [0.3, 0.01]}, "share_range"),
    ({"share_range": [0.0, 0.3]}, "share_range"), ({"share_layers": [4], "share_steps": 10}, "share_layers"),
    ({"share_tasks": ["video"]}, "share_tasks"), ({"share_heads": "query"}, "share_heads"),
    ({"share_ground": "cell"}, "share_ground"), ({"share_value_lr_scale": 0}, "share_value_lr_scale"),
])
def test_a_bad_value_is_refused_naming_its_field(change, field):
    with pytest.raises(ConfigError, match=f"field 'recipe.{field}'") as err:
        Recipe.from_dict({**shipped(), **change})
    assert err.value.field == f"recipe.{field}"


def test_the_share_stage_fields_are_optional_and_written_only_where_the_stage_runs():
    """A recipe file without the share stage's fields gets their defaults (share_steps 0: no stage) and is written
    back without them, as it was; a recipe with the stage writes every field, and reads back equal."""
    r = Recipe.from_dict(shipped())
    assert r.share_steps == 0 and "share_steps" not in r.to_dict() and "share_loss" in r.to_dict(full=True)
    drift = r.replace(share_steps=60, share_heads="kv", share_range=[0.02, 0.4])
    written = drift.to_dict()
    assert written["share_steps"] == 60 and written["share_layout"] == "v6" and written["share_range"] == [0.02, 0.4]
    assert Recipe.from_dict(json.loads(json.dumps(written))) == drift


def test_a_share_stage_runs_alone_from_a_model_its_recipe_made_up_to_that_stage():
    """``starts_from``: a saved model whose recipe agrees with this one on every field before the share stage
    (threads aside) is where the share stage starts; a recipe without the stage, or a model of another main or
    polish stage, starts nothing (the whole run trains from those weights)."""
    from embedded.share import share_target, starts_from

    base = shipped()
    drift = Recipe.from_dict(base).replace(share_steps=60)
    assert starts_from(drift, base) and starts_from(drift, {**base, "threads": 1})
    assert not starts_from(Recipe.from_dict(base), base) and not starts_from(drift, None)
    assert not starts_from(drift, {**base, "polish_lr": 1e-3}) and not starts_from(drift, {**base, "steps": 4000})
    assert share_target(0.0, (0.01, 0.3)) == pytest.approx(0.01)
    assert share_target(1.0, (0.01, 0.3)) == pytest.approx(0.3)
    assert share_target(0.5, (0.01, 0.3)) == pytest.approx((0.01 * 0.3) ** 0.5)  # log-linear: the geometric mean


def test_a_recipe_file_with_a_missing_or_unknown_field_is_refused(tmp_path):
    data = shipped()
    del data["warmup"]
    with pytest.raises(ConfigError, match="'recipe.warmup': missing from"):
        Recipe.from_dict(data)
    with pytest.raises(ConfigError, match="'recipe.wramup': unknown field"):
        Recipe.from_dict({**shipped(), "wramup": 100})
    bad = tmp_path / "recipe.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="is not JSON"):
        Recipe.load(bad)
    with pytest.raises(SystemExit):  # the command line says it in one line and exits 2
        cli.parse(["--recipe", str(bad)])


def test_the_command_line_names_the_field_of_a_bad_override(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.parse(["--polish-cooldown", "2"])
    assert exit_.value.code == 2 and "field 'recipe.polish_cooldown'" in capsys.readouterr().err


def test_each_stage_depends_on_its_own_fields():
    """A finished vision stage serves any main stage that agrees on the tower's fields, a finished main stage any
    polish stage; the thread count is part of the arithmetic but never of a checkpoint's identity."""
    assert set(VISION_FIELDS) < set(MAIN_FIELDS) < set(POLISH_FIELDS) < set(ALL_FIELDS)
    assert not any(f.startswith("share") for f in POLISH_FIELDS) and "share_steps" in ALL_FIELDS
    assert not any(f.startswith("polish") for f in MAIN_FIELDS)
    assert "threads" not in ALL_FIELDS
