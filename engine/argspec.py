"""Command-line flags derived from a config dataclass: each setting is declared once, on its field (type, default,
help, choices), and the CLI flags, their help and the README's table are generated from that declaration.

    @dataclass
    class ServerConfig:
        api_key: str | None = setting(None, help="...")

    add_arguments(parser.add_argument_group("server"), ServerConfig)   # --api-key
    ServerConfig(**given(args, ServerConfig))                           # only the flags that were given
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Callable, Iterator

_SCALARS = (bool, int, float, str)


def setting(default: Any = dataclasses.MISSING, *, help: str, choices: tuple | None = None,
            parse: Callable[[str], Any] | None = None, aliases: tuple[str, ...] = (), metavar: str | None = None,
            nargs: str | None = None, flag: bool = True, default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field carrying its CLI declaration. ``parse`` turns the flag's text into the value (default:
    from the field's type); ``flag=False`` keeps a field off the command line (it must say why in ``help``)."""
    meta = {"help": help, "choices": choices, "parse": parse, "aliases": aliases, "metavar": metavar,
            "nargs": nargs, "flag": flag}
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"setting": meta})


def _base_type(tp: Any) -> Any:
    """int for `int`, `int | None`, `Optional[int]`; the type itself otherwise."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        scalars = [a for a in args if a in _SCALARS]
        return scalars[0] if len(scalars) == 1 and len(args) == 1 else (str if str in args else None)
    return tp if tp in _SCALARS else None


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def cli_fields(cls: type) -> Iterator[tuple[dataclasses.Field, dict, Any]]:
    """(field, its setting metadata, its scalar type) of every field that is a command-line flag."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("setting")
        if meta is not None and meta["flag"]:
            yield f, meta, _base_type(hints[f.name])


def default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default) if isinstance(f.default, str) else str(f.default)
    return "-" if f.default_factory is dataclasses.MISSING else str(f.default_factory())


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                  skip: tuple[str, ...] = ()) -> None:
    """One flag per setting of `cls`; a flag not given leaves its value None (the config's default then holds)."""
    for f, meta, tp in cli_fields(cls):
        if f.name in skip:
            continue
        names = [flag_name(f.name), *meta["aliases"]]
        text = meta["help"] if "(default" in meta["help"] else f"{meta['help']} (default: {default_text(f)})"
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": text}
        if tp is bool and meta["parse"] is None:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            parse = meta["parse"] or tp
            if parse is None:
                raise TypeError(f"{cls.__name__}.{f.name}: give `parse` for a field of this type")
            kw["type"] = parse
            for key in ("choices", "metavar", "nargs"):
                if meta[key] is not None:
                    kw[key] = meta[key]
        parser.add_argument(*names, **kw)


def given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The settings of `cls` that were given on the command line."""
    return {f.name: getattr(args, f.name) for f, _, _ in cli_fields(cls) if getattr(args, f.name, None) is not None}


def markdown_table(cls: type) -> str:
    """The README's table of flags, generated from the same declarations."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for f, meta, _ in cli_fields(cls):
        names = ", ".join(f"`{n}`" for n in (flag_name(f.name), *meta["aliases"]))
        rows.append(f"| {names} | `{default_text(f)}` | {meta['help'].replace('|', '/')} |")
    return "\n".join(rows)
