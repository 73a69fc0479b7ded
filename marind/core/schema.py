"""The schema engine behind marind's TOML files: typed fields on frozen dataclasses.

``run.toml`` (``marind.core.spec``) and the agent's ``marind.toml``
(``marind.control.config``) are read with it. A section is a frozen
dataclass whose fields are made with ``spec_field(default, kind)``; the
kind says how a TOML value becomes the field's value (``convert``) and
back (``export``):

* ``int``, ``int?`` (None allowed), ``float`` (an integer is accepted),
  ``str``, ``bool``: checked, never coerced from another type;
* ``strs``: an array of strings, held as a tuple, exported as a list;
* ``duration``, ``duration?``: ``"120s"``, ``"5m"``, ``"250ms"`` or seconds
  (``parse_duration``), held as float seconds;
* ``nodes``: ``"MIN:MAX"`` or ``N`` (``parse_nodes``), held as ``(min, max)``,
  exported as ``"min:max"``;
* ``env``: a table of ``NAME = "value"``, held as sorted ``(name, value)`` pairs.

Every problem is a ``SpecError`` with one line naming the key's path and
the fix; an unknown key gets a did-you-mean (``did_you_mean``).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import field
from typing import Any

from marind.core.errors import SpecError

KINDS = ("int", "int?", "float", "str", "strs", "bool", "duration", "duration?", "nodes", "env")


def spec_field(default: Any, kind: str, key: str | None = None, **kw) -> Any:
    """A dataclass field of ``kind``, read from TOML key ``key`` (default: the field's name).

    Args:
        default: the value when the key is absent.
        kind: one of ``KINDS``.
        key: the TOML key when it differs from the field name (``async`` for ``async_``).
        **kw: passed on to ``dataclasses.field``.

    Returns:
        The field, its kind and key in its metadata.

    Raises:
        ValueError: ``kind`` is not one of ``KINDS``.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown field kind {kind!r}: use one of {', '.join(KINDS)}")
    meta = {"kind": kind}
    if key:
        meta["key"] = key
    return field(default=default, metadata=meta, **kw)


def toml_key(f: dataclasses.Field) -> str:
    """The TOML key a field is read from and exported to."""
    return f.metadata.get("key", f.name)


def field_kind(f: dataclasses.Field) -> str:
    """The kind ``spec_field`` gave a field."""
    return f.metadata["kind"]


# ---------------------------------------------------------------- values

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: Any, path: str = "duration") -> float:
    """``"120s"``, ``"5m"``, ``"1.5h"``, ``"250ms"`` or a number of seconds -> seconds.

    Args:
        value: the TOML value.
        path: the key's path, for the error message.

    Returns:
        Seconds.

    Raises:
        SpecError: a boolean, a negative number, or text that is no duration.
    """
    if isinstance(value, bool):
        raise SpecError(f"{path} must be a duration like \"120s\" or \"5m\", got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise SpecError(f"{path} must not be negative, got {value!r}")
        return float(value)
    if isinstance(value, str):
        m = _DURATION_RE.match(value)
        if m:
            return float(m.group(1)) * _UNIT_S[m.group(2)]
    raise SpecError(f"{path} must be a duration like \"120s\", \"5m\" or \"1h\", got {value!r}")


def parse_nodes(value: Any, path: str = "job.nodes") -> tuple[int, int]:
    """``"1:2"`` -> (1, 2); ``"2"`` or ``2`` -> (2, 2).

    Args:
        value: the TOML value.
        path: the key's path, for the error message.

    Returns:
        (min, max) node counts.

    Raises:
        SpecError: not ``N`` or ``MIN:MAX``, or not ``1 <= min <= max``.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        lo = hi = value
    elif isinstance(value, str):
        parts = value.strip().split(":")
        try:
            if len(parts) == 1:
                lo = hi = int(parts[0])
            elif len(parts) == 2:
                lo, hi = int(parts[0]), int(parts[1])
            else:
                raise ValueError(value)
        except ValueError:
            raise SpecError(f"{path} must be \"N\" or \"MIN:MAX\" node counts, e.g. \"1:2\", got {value!r}") from None
    else:
        raise SpecError(f"{path} must be \"N\" or \"MIN:MAX\" node counts, e.g. \"1:2\", got {value!r}")
    if lo < 1 or hi < lo:
        raise SpecError(f"{path} = {value!r}: need 1 <= min <= max (e.g. \"1:2\")")
    return lo, hi


def string_pairs(table: Mapping) -> tuple[tuple[str, str], ...]:
    """A table as sorted ``(str(key), str(value))`` pairs (the form ``env`` and labels are held in)."""
    return tuple(sorted((str(k), str(v)) for k, v in table.items()))


def type_name(value: Any) -> str:
    """The TOML name of a value's type (``integer``, ``table``, ...), for error messages."""
    return {bool: "boolean", int: "integer", float: "float", str: "string",
            dict: "table", list: "array"}.get(type(value), type(value).__name__)


def convert(kind: str, value: Any, path: str) -> Any:
    """A TOML value as a field of ``kind`` holds it.

    Args:
        kind: one of ``KINDS``.
        value: the TOML value.
        path: the key's path (``section.key``), for the error message.

    Returns:
        The converted value.

    Raises:
        SpecError: the value does not fit the kind.
    """
    if kind == "int" or kind == "int?":
        if kind == "int?" and value is None:
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise SpecError(f"{path} must be an integer, got {type_name(value)} {value!r}")
    if kind == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise SpecError(f"{path} must be a number, got {type_name(value)} {value!r}")
    if kind == "str":
        if isinstance(value, str):
            return value
        raise SpecError(f"{path} must be a string, got {type_name(value)} {value!r}")
    if kind == "strs":
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise SpecError(f"{path} must be an array of strings, got {type_name(value)} {value!r}")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise SpecError(f"{path} must be true or false, got {type_name(value)} {value!r}")
    if kind == "duration":
        return parse_duration(value, path)
    if kind == "duration?":
        return None if value is None else parse_duration(value, path)
    if kind == "nodes":
        return parse_nodes(value, path)
    if kind == "env":
        if isinstance(value, dict) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                                           for v in value.values()):
            return string_pairs(value)
        raise SpecError(f"{path} must be a table of NAME = \"value\" strings")
    raise ValueError(f"unknown field kind {kind!r}")


def export(kind: str, value: Any) -> Any:
    """A field's value in its JSON/TOML form (``convert`` reads it back)."""
    if kind == "nodes":
        lo, hi = value
        return f"{lo}:{hi}"
    if kind == "env":
        return dict(value)
    if kind == "strs":
        return list(value)
    return value


# ---------------------------------------------------------------- tables

def load_toml(text: str, source: str, fix: str = "") -> dict[str, Any]:
    """Parse TOML text.

    Args:
        text: the TOML.
        source: the file's name, first in the error message.
        fix: appended to the error message (e.g. ``"; fix the syntax at that line"``).

    Returns:
        The parsed table.

    Raises:
        SpecError: a syntax error (with its line).
    """
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{source}: TOML syntax error: {exc}{fix}") from exc


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice most like ``word`` (difflib's ratio >= 0.6), if any."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)``, else `` (known: a, b, c)``: the hint after an unknown name."""
    choices = list(choices)
    close = closest(word, choices)
    return f" (did you mean '{close}'?)" if close else f" (known: {', '.join(sorted(choices))})"


def parse_table(cls: type, raw: Any, name: str) -> tuple[Any, set[str]]:
    """A TOML table ``[name]`` as an instance of the section dataclass ``cls``.

    Args:
        cls: a dataclass whose fields were made with ``spec_field``.
        raw: the table.
        name: the section's name, for key paths in error messages.

    Returns:
        (the instance, the keys the table set): a caller fills defaults that
        depend on which keys were given.

    Raises:
        SpecError: ``raw`` is not a table, a key is unknown (with a
            did-you-mean), or a value does not fit its field.
    """
    if not isinstance(raw, Mapping):
        raise SpecError(f"[{name}] must be a table, got {type_name(raw)}")
    fields = {toml_key(f): f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in raw.items():
        if key not in fields:
            raise SpecError(f"unknown key '{name}.{key}'{did_you_mean(key, fields)}; remove or rename it")
        f = fields[key]
        values[f.name] = convert(field_kind(f), value, f"{name}.{key}")
    return cls(**values), set(raw)


def table_of(section: Any) -> dict[str, Any]:
    """A section dataclass instance as its TOML table (``export``-ed values, TOML key names)."""
    return {toml_key(f): export(field_kind(f), getattr(section, f.name)) for f in dataclasses.fields(section)}
