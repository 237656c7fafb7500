"""`--help` of the jobs: user flags in groups, each with its real default (what JobConfig.validate fills in), never
`None`; the internal `--engine` accepted but not listed; two examples that are valid commands."""

from __future__ import annotations

import argparse
import re
import shlex

from pipeline.run.cli import build_arg_parser, job_config
from pipeline.run.config import default_runs_root


def test_help_gives_every_flag_a_text_and_its_real_default():
    p = build_arg_parser("textcaps")
    text = p.format_help()
    assert "default: None" not in text
    for a in p._actions:
        if a.dest == "help" or a.help == argparse.SUPPRESS:
            continue
        assert a.help and "(default: " in a.help, f"{a.option_strings[0]} has no help text with its default"
    helps = {a.dest: a.help for a in p._actions}
    assert "(default: all: full, bacon," in helps["methods"] and "(default: textcaps 64)" in helps["max_new_tokens"]
    assert f"(default: sqlite:///{default_runs_root() / 'mlflow.db'})" in helps["mlflow_uri"]
    assert f"(default: {default_runs_root()}/<job name>)" in helps["output_dir"]


def test_help_groups_user_flags_and_hides_the_engine():
    p = build_arg_parser("detailcaps")
    text = p.format_help()
    groups = {g.title: {a.dest for a in g._group_actions} for g in p._action_groups}
    assert {"model", "shards", "methods", "limit"} <= groups["what to run"]
    assert {"output_dir", "mlflow_uri"} <= groups["where results go"]
    assert {"num_actors", "batch_size", "device"} <= groups["resources"]
    listed = [a for a in p._actions if a.dest not in ("help", "engine")]
    assert all(any(a in g._group_actions for g in p._action_groups[2:]) for a in listed)  # none left ungrouped
    assert "--engine" not in text and "module:Class" not in text
    cfg = job_config(["--engine", "tests.pipeline_helpers:FakeEngine"], task="detailcaps")
    assert cfg.engine == "tests.pipeline_helpers:FakeEngine"  # still accepted (the tests' fake engines)


def test_help_epilog_gives_two_valid_example_commands():
    text = build_arg_parser("textcaps").format_help()
    epilog = text[text.index("examples:"):]
    commands = [" ".join(m.split()) for m in re.findall(r"^  (python jobs/.*?)(?=^      [a-z])",
                                                          epilog.replace("\\\n", " "), re.M | re.S)]
    assert len(commands) == 2, epilog
    for cmd in commands:
        argv = shlex.split(cmd)
        assert argv[:2] == ["python", "jobs/textcaps.py"], cmd
        job_config(argv[2:], task="textcaps")  # the job's own validation: a bad flag would raise
