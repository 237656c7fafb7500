"""``python -m pipeline.lmms.tasks`` (pipeline/lmms/tasks.py) as a user runs it: where its tasks go by default, and
the scene layout of the shards it generates, which must be the one the named embedded model answers."""

from __future__ import annotations

import json

import pytest

from pipeline.data.shards import SUCCESS_MARKER
from pipeline.lmms.tasks import main
from rcr.embedded import DIRECTORIES, NAME, scene_layout


@pytest.mark.parametrize("model", list(DIRECTORIES))
def test_generated_shards_are_in_the_layout_of_the_named_model(model, tmp_path, monkeypatch, capsys):
    """Each embedded model is trained on one scene layout and answers only that one: tasks written for
    ``--model embedded-drift`` over the default's scenes would measure a model on scenes it never saw. The tasks of
    another model go to their own directory, so that one ``--include_path`` never holds two ``rcr_detailcaps``."""
    monkeypatch.setenv("RCR_RUNS_DIR", str(tmp_path / "runs"))
    assert main(["--model", model, "--n", "1"]) == 0
    out = tmp_path / "runs" / ("lmms-tasks" if model == NAME else f"lmms-tasks-{model}")
    assert {p.name for p in out.glob("*.yaml")} == {"rcr_detailcaps.yaml", "rcr_textcaps.yaml"}
    for task in ("detailcaps", "textcaps"):
        marker = json.loads((out / "shards" / task / SUCCESS_MARKER).read_text())
        assert (marker["layout"], marker["rows"]) == (scene_layout(model), 1)
    printed = capsys.readouterr().out
    for task in ("detailcaps", "textcaps"):  # the slow stage says where it is
        assert f"[rcr-lmms] drawing 1 {task} scene(s) (layout {scene_layout(model)}) into {out / 'shards' / task}" \
            in printed, printed
    # the command it prints runs as is, and writes its results under the runs directory too
    assert f"pretrained={model},method=rcr --include_path {out} " in printed
    assert f"--output_path {tmp_path / 'runs' / 'lmms-results'}" in printed


def test_the_two_embedded_models_answer_different_layouts():
    """What the test above relies on to tell the layouts apart."""
    assert len({scene_layout(m) for m in DIRECTORIES}) == len(DIRECTORIES)


def test_an_unknown_model_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        main(["--model", "Qwen/Qwen2-VL-7B-Instruct"])
    assert "--model" in capsys.readouterr().err
