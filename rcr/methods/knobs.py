"""A method's own settings ("knobs"): dataclass fields of the method, set through its label.

A label is ``name`` or ``name@field=value,field=value``; a method with a ``shorthand`` knob also takes a bare first
value (``fixed@0.05`` is ``fixed@tau=0.05``). A label names one variant of a method, so one job can run several
(``arkvale,arkvale@rule=recall``); the label is the method's key in the output rows. Values are converted by the
field's type; each method validates its knobs in ``validate``, with errors naming ``<method>.<field>``.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import field
from typing import Any

from ..config import ConfigError

BASE_FIELDS = ("config", "label")  # the fields every method has; the others are its knobs
_TRUE, _FALSE, _NONE = ("true", "1", "yes"), ("false", "0", "no"), ("none", "null")


def knob(default: Any, help: str, key: str | None = None):
    """A method's knob: a field with a default and a one-line ``help``. ``key``: the knob's name in a job's record
    of every method's defaults (:func:`default_record`), where that is not the field's own name."""
    return field(default=default, metadata={"help": help, "key": key})


def knob_fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.name not in BASE_FIELDS and f.init}


def _convert(cls, name: str, text: str, label: str) -> Any:
    hint = typing.get_type_hints(cls)[name]
    args = typing.get_args(hint)
    optional = type(None) in args
    kinds = [a for a in args if a is not type(None)] or [hint]
    low = text.lower()
    if optional and low in _NONE:
        return None
    kind = kinds[0]
    try:
        if kind is bool:
            if low not in _TRUE + _FALSE:
                raise ValueError
            return low in _TRUE
        if kind in (int, float):
            return kind(text)
        return text
    except ValueError:
        raise ConfigError("method", f"{label!r}: {cls.name}.{name} must be {kind.__name__}, got {text!r}") from None


def parse_knobs(cls, args: str, label: str) -> dict[str, Any]:
    """``field=value,...`` (or a bare shorthand value first) of label ``label`` -> the knob values for ``cls``."""
    fields = knob_fields(cls)
    listing = ", ".join(fields) or "none"
    if not args:
        raise ConfigError("method", f"{label!r}: nothing after '@'; {cls.name}'s fields: {listing}")
    out: dict[str, Any] = {}
    for i, part in enumerate(args.split(",")):
        name, eq, text = (s.strip() for s in part.partition("="))
        if not eq:
            if i > 0 or cls.shorthand is None:
                raise ConfigError("method", f"{label!r}: expected FIELD=VALUE, got {part!r}; {cls.name}'s fields: "
                                            f"{listing}")
            name, text = cls.shorthand, part.strip()
        if name not in fields:
            raise ConfigError("method", f"{label!r}: {cls.name} has no field {name!r}; its fields: {listing}")
        if name in out:
            raise ConfigError("method", f"{label!r}: {name} is given twice")
        out[name] = _convert(cls, name, text, label)
    return out


def describe(cls) -> str:
    """``name: field=default (help); ...``: one method's knobs, for --help and the docs."""
    parts = [f"{f.name}={f.default} ({f.metadata['help']})" for f in knob_fields(cls).values()]
    return f"{cls.name}: " + ("; ".join(parts) if parts else "no knobs")


def default_record(classes) -> dict[str, Any]:
    """Every method's knob defaults, one flat mapping (``key`` or field name -> default): what a job records of
    the methods it can run, in its config hash and run record, so that a changed default re-keys its outputs.
    Methods that share a knob name share its value (``page_size``; RCR's detector and candidates)."""
    out: dict[str, Any] = {}
    for cls in classes:
        for f in knob_fields(cls).values():
            key = f.metadata.get("key") or f.name
            if key in out and out[key] != f.default:
                raise ValueError(f"knob {key!r} has two defaults ({out[key]!r}, {cls.name}: {f.default!r})")
            out[key] = f.default
    return out
