"""Flags generated from config fields (engine/argspec.py): names, types, booleans, what counts as given."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from engine.argspec import add_arguments, given, markdown_table, setting


@dataclass
class _Cfg:
    max_things: int = setting(4, help="how many")
    ratio: float | None = setting(None, help="a ratio")
    name: str = setting("x", help="a name", choices=("x", "y"))
    loud: bool = setting(False, help="be loud")
    names: list[str] | None = setting(None, parse=str, nargs="+", help="names", aliases=("--alias",))
    hidden: int = setting(1, help="not a flag: set by code", flag=False)
    plain: int = 3


def _parse(argv):
    p = argparse.ArgumentParser()
    add_arguments(p, _Cfg)
    return p.parse_args(argv)


def test_flags_parse_to_the_field_types_and_only_given_ones_count():
    args = _parse(["--max-things", "7", "--ratio", "0.5", "--no-loud", "--alias", "a", "b"])
    assert given(args, _Cfg) == {"max_things": 7, "ratio": 0.5, "loud": False, "names": ["a", "b"]}
    assert given(_parse([]), _Cfg) == {}
    assert _Cfg(**given(_parse(["--loud", "--name", "y"]), _Cfg)) == _Cfg(loud=True, name="y")


def test_bad_values_and_unlisted_fields_are_argparse_errors():
    for argv in (["--max-things", "many"], ["--name", "z"], ["--hidden", "2"], ["--plain", "2"]):
        with pytest.raises(SystemExit):
            _parse(argv)


def test_a_field_whose_type_cannot_be_inferred_needs_parse():
    @dataclass
    class Bad:
        items: dict = setting(None, help="no parse given")

    with pytest.raises(TypeError, match="parse"):
        add_arguments(argparse.ArgumentParser(), Bad)


def test_markdown_table_lists_every_flag_with_its_default():
    table = markdown_table(_Cfg)
    assert "| `--max-things` | `4` | how many |" in table
    assert "`--names`, `--alias`" in table and "--hidden" not in table and "--plain" not in table
