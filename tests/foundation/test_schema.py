"""marind.core.schema: field kinds, conversion both ways, tables and their errors (pure)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from marind.core.errors import SpecError
from marind.core.schema import (
    closest,
    convert,
    did_you_mean,
    export,
    load_toml,
    parse_table,
    spec_field,
    string_pairs,
    table_of,
)

pytestmark = pytest.mark.unit


@dataclass(frozen=True, kw_only=True)
class Section:
    count: int = spec_field(1, "int")
    size: int | None = spec_field(None, "int?")
    ratio: float = spec_field(0.5, "float")
    name: str = spec_field("x", "str")
    on: bool = spec_field(True, "bool", key="enabled")
    wait: float = spec_field(10.0, "duration")
    every: float | None = spec_field(None, "duration?")
    nodes: tuple[int, int] = spec_field((1, 1), "nodes")
    env: tuple[tuple[str, str], ...] = spec_field((), "env")


@pytest.mark.parametrize(("kind", "value", "expected"), [
    ("int", 3, 3), ("int?", None, None), ("float", 2, 2.0), ("str", "a", "a"), ("bool", False, False),
    ("duration", "2m", 120.0), ("duration?", None, None), ("nodes", "1:3", (1, 3)),
    ("env", {"B": 2, "A": "x"}, (("A", "x"), ("B", "2"))),
])
def test_convert_and_export_round_trip(kind, value, expected):
    held = convert(kind, value, "s.k")
    assert held == expected
    assert convert(kind, export(kind, held), "s.k") == held


@pytest.mark.parametrize(("kind", "value", "message"), [
    ("int", True, "s.k must be an integer, got boolean True"),
    ("float", "1", "s.k must be a number, got string '1'"),
    ("str", 1, "s.k must be a string, got integer 1"),
    ("bool", 1, "s.k must be true or false, got integer 1"),
    ("env", {"A": True}, "s.k must be a table of NAME"),
    ("nodes", "2:1", "need 1 <= min <= max"),
])
def test_convert_names_the_key_and_what_it_got(kind, value, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(")):
        convert(kind, value, "s.k")


def test_unknown_kind_is_refused_when_the_field_is_made():
    with pytest.raises(ValueError, match="unknown field kind"):
        spec_field(0, "integer")


def test_parse_table_reads_toml_keys_and_reports_the_keys_given():
    section, given = parse_table(Section, {"enabled": False, "wait": "5s", "nodes": 2}, "sec")
    assert section == Section(on=False, wait=5.0, nodes=(2, 2))
    assert given == {"enabled", "wait", "nodes"}
    assert table_of(section)["enabled"] is False and table_of(section)["nodes"] == "2:2"


def test_parse_table_errors_name_the_path():
    with pytest.raises(SpecError, match=r"unknown key 'sec.cont' \(did you mean 'count'\?\); remove or rename it"):
        parse_table(Section, {"cont": 1}, "sec")
    with pytest.raises(SpecError, match=r"\[sec\] must be a table, got integer"):
        parse_table(Section, 3, "sec")


def test_hints_and_toml_errors():
    assert closest("slot", ["slots", "node"]) == "slots" and closest("zzz", ["slots"]) is None
    assert did_you_mean("zzz", ["b", "a"]) == " (known: a, b)"
    assert string_pairs({"b": 1, "a": 2}) == (("a", "2"), ("b", "1"))
    with pytest.raises(SpecError, match="f.toml: TOML syntax error: .*; fix it"):
        load_toml("[a\n", "f.toml", fix="; fix it")
