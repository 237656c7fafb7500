"""`--help` of the jobs states every flag's real default (what JobConfig.validate fills in), never `None`."""

from __future__ import annotations

from pipeline.run.config import build_arg_parser, default_runs_root


def test_help_gives_every_flag_a_text_and_its_real_default():
    p = build_arg_parser("textcaps")
    text = p.format_help()
    assert "default: None" not in text
    for a in p._actions:
        if a.dest == "help":
            continue
        assert a.help and "(default: " in a.help, f"{a.option_strings[0]} has no help text with its default"
    helps = {a.dest: a.help for a in p._actions}
    assert "(default: all)" in helps["methods"] and "(default: textcaps 64)" in helps["max_new_tokens"]
    assert f"(default: sqlite:///{default_runs_root() / 'mlflow.db'})" in helps["mlflow_uri"]
    assert f"(default: {default_runs_root()}/<job name>)" in helps["output_dir"]
