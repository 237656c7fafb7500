"""A method's own settings ("knobs"): dataclass fields of the method, set through its label; and the one reader and
writer of labels (the library, the job's ``--methods``, lmms-eval's model args and the analyses all use these).

A label is ``name`` or ``name@field=value,field=value``; a method with a ``shorthand`` knob also takes a bare first
value (``fixed@0.05`` is ``fixed@tau=0.05``). A label names one variant of a method, so one job can run several
(``arkvale,arkvale@rule=recall``); the label is the method's key in the output rows. Values are converted by the
field's type; each method validates its knobs in ``validate``, with errors naming ``<method>.<field>``.

Knobs are a method's own: two methods may each have a knob of the same name with their own defaults. A job records
the defaults per method (:func:`default_record`).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import field
from typing import Any

from ..config import ConfigError

BASE_FIELDS = ("config", "label")  # the fields every method has; the others are its knobs
_TRUE, _FALSE, _NONE = ("true", "1", "yes"), ("false", "0", "no"), ("none", "null")


def knob(default: Any, help: str):
    """A method's knob: a field with a default and a one-line ``help``."""
    return field(default=default, metadata={"help": help})


def split_label(label: str) -> tuple[str, str | None]:
    """``"rcr@rho=0.3,step=0.1"`` -> ``("rcr", "rho=0.3,step=0.1")``; ``"rcr"`` -> ``("rcr", None)``: the method's
    name and the text of its knobs (:func:`parse_knobs` reads it), None without an ``@``."""
    name, sep, args = str(label).strip().partition("@")
    return name, (args if sep else None)


def with_knobs(label: str, values: dict[str, Any]) -> str:
    """``label`` with ``values`` set after its own: ``with_knobs("rcr", {"rho": 0.3})`` -> ``"rcr@rho=0.3"``,
    ``with_knobs("rcr@rho=0.3", {"step": 0.1})`` -> ``"rcr@rho=0.3,step=0.1"``."""
    name, args = split_label(label)
    parts = ([args] if args else []) + [f"{k}={v}" for k, v in values.items()]
    return f"{name}@{','.join(parts)}" if parts else name


def join_labels(pieces: list[str]) -> list[str]:
    """A list of labels split at every comma (``--methods rcr@rho=0.3,step=0.1,bacon``) -> the labels: a piece with
    ``=`` and no ``@`` continues the label before it (``["rcr@rho=0.3,step=0.1", "bacon"]``)."""
    out: list[str] = []
    for piece in pieces:
        if "=" in piece and "@" not in piece:
            if not out or "@" not in out[-1]:
                raise ConfigError("methods", f"{piece!r} is a FIELD=VALUE with no method before it; write "
                                             "NAME@FIELD=VALUE,FIELD=VALUE (e.g. rcr@rho=0.3,step=0.1)")
            out[-1] = f"{out[-1]},{piece}"
        else:
            out.append(piece)
    return out


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


def default_record(classes) -> dict[str, dict[str, Any]]:
    """Each method's knob defaults, by method (``{"rcr": {"rho": 0.4, ...}, "arkvale": {"rule": "topk", ...}}``;
    methods without knobs are left out): what a job records of the methods it can run, in its run record and its
    config hash, so that a changed default re-keys its outputs (``pipeline/run/checks.py``)."""
    out = {cls.name: {f.name: f.default for f in knob_fields(cls).values()} for cls in classes}
    return {name: knobs for name, knobs in out.items() if knobs}
