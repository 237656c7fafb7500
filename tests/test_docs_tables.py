"""The two reference tables that restate code, checked against it: the README's methods table (every registered
method, its own knobs and their defaults) and docs/library.md's RCRConfig table (every shared field and its
default). A knob or field added, removed or re-defaulted without its table fails here."""

from __future__ import annotations

import dataclasses
import re

from rcr.config import RCRConfig
from rcr.methods import METHODS
from rcr.methods.knobs import knob_fields
from tests.pipeline_helpers import REPO


def table_rows(doc: str, header: str) -> list[list[str]]:
    """The rows of the markdown table whose header line starts with ``header``, as lists of cells."""
    lines = (REPO / doc).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = re.split(r"\|(?=(?:[^`]*`[^`]*`)*[^`]*$)", line.strip().strip("|"))  # a | inside `...` stays
        rows.append([c.strip() for c in cells])
    return rows


def shown(v) -> str:
    """A default as the tables write it: ``none``, ``false``, ``0.03``, ``exact_query``."""
    return "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def same(text: str, v) -> bool:
    try:
        return float(text) == float(v)
    except (TypeError, ValueError):
        return text.lower() == shown(v)


def test_readme_methods_table_lists_every_method_with_its_knobs_and_defaults():
    rows = table_rows("README.md", "| label |")
    listed = {}
    for label, _, knobs in rows:
        names = re.findall(r"`([a-z_]+)`", label)
        listed[names[0]] = knobs
    assert set(listed) == set(METHODS)
    for name, cell in listed.items():
        own = {k: f.default for k, f in knob_fields(METHODS[name]).items()}
        in_table = dict(re.findall(r"`([a-z_0-9]+)` \(([^)]*)\)", cell))
        shared = re.findall(r"`([a-z_]+)`'s( first four)?", cell)  # "`rcr`'s": knobs it shares with another
        for other, first_four in shared:
            theirs = list(knob_fields(METHODS[other]))[:4 if first_four else None]
            assert set(theirs) <= set(own), (name, other)
            own = {k: v for k, v in own.items() if k not in theirs}
        assert in_table == {k: shown(v) for k, v in own.items()}, name


def test_library_config_table_lists_every_shared_field_with_its_default():
    rows = table_rows("docs/library.md", "| field |")
    seen = {}
    for names, defaults, _ in rows:
        fields = re.findall(r"`([a-z_]+)`", names)
        values = [v.strip().strip("`") for v in defaults.split(",")]
        values = values * len(fields) if len(values) == 1 else values  # one default for the row's fields
        assert len(values) == len(fields), names
        seen.update(zip(fields, values))
    config = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
              for f in dataclasses.fields(RCRConfig)}
    assert set(seen) == set(config)
    for name, value in seen.items():
        assert same(value, config[name]), (name, value, config[name])
