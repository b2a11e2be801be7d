"""Command-line flags derived from an options model, so that each option is declared once.

An options model (`train.options.TrainOptions`, its `CkptOptions` and `FaultPlan`) marks each
field that is a flag with ``json_schema_extra=flag("--name", ...)`` (`config.base.flag`). From
that field this module derives the typer option: the flag and its ``--no-`` spelling, the help
(the field's docstring), the default, the bounds (``ge``/``le``/``gt``), the choices, and whether it
is hidden; `build` turns the parsed values back into the model, validated by pydantic, with any
error named by its flag. ``RANK:VALUE`` maps (the test hooks) are repeated string options.
"""

from __future__ import annotations

import inspect
import types
import typing
from dataclasses import dataclass
from typing import Any

import typer
from pydantic import BaseModel, ValidationError

from mscale.cli.output import parse_rank_values
from mscale.errors import MscaleError


@dataclass(frozen=True)
class Flag:
    """One field of an options model that is a command-line flag."""

    path: tuple[str, ...]
    """Where the field sits in the model, e.g. ``("ckpt", "level")``."""
    flag: str
    info: Any
    """The pydantic FieldInfo."""
    extra: dict

    @property
    def param(self) -> str:
        """The command function's parameter name."""
        return "__".join(self.path)

    @property
    def kind(self) -> type:
        ann = self.info.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if typing.get_origin(ann) in (typing.Union, types.UnionType) and len(args) == 1:
            ann = args[0]
        return typing.get_origin(ann) or ann

    def value_type(self) -> type:
        """For a ``dict[int, V]`` field, V."""
        return typing.get_args(self.info.annotation)[1]


def flags(model: type[BaseModel], path: tuple[str, ...] = ()) -> list[Flag]:
    """Every flag field of ``model`` and of the options models nested in it, in order."""
    out = []
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            out += flags(info.annotation, path + (name,))
        elif extra.get("flag"):
            out.append(Flag(path + (name,), extra["flag"], info, extra))
    return out


def _bounds(info) -> dict:
    """typer's range of a field: ``ge``/``le`` only. A strict ``gt`` cannot be said by typer's
    range (it would show ``x>=0`` for a field that refuses 0): `_help` says it instead."""
    out = {}
    for m in info.metadata:
        if getattr(m, "ge", None) is not None:
            out["min"] = m.ge
        if getattr(m, "le", None) is not None:
            out["max"] = m.le
    return out


def _above(info):
    return next((m.gt for m in info.metadata if getattr(m, "gt", None) is not None), None)


def _help(f: Flag) -> str:
    text = " ".join((f.info.description or "").split())
    if _above(f.info) is not None:
        text += f" Above {_above(f.info):g}."
    return f"{text} [{f.extra['metavar']}, repeatable]" if f.kind is dict else text


def parameter(f: Flag) -> inspect.Parameter:
    """The typer option of ``f``, as a parameter of the command function."""
    hidden, default = f.extra.get("hidden", False), f.info.get_default(call_default_factory=True)
    if f.kind is bool:
        names = [f"{f.flag}/{f.extra['negative']}"] if f.extra.get("negative") else [f.flag]
        option = typer.Option(default, *names, help=_help(f), hidden=hidden)
        annotation = bool
    elif f.kind is dict:
        option = typer.Option([], f.flag, help=_help(f), hidden=hidden)
        annotation = list[str]
    else:  # a Literal stays one, so typer lists and checks its choices
        literal = typing.get_origin(f.info.annotation) is typing.Literal
        annotation = f.info.annotation if literal else f.kind
        choices = f.extra.get("choices")  # a str field checked in `_parsed`: its words shown
        option = typer.Option(default, f.flag, help=_help(f), hidden=hidden,
                              metavar="|".join(choices) if choices else None, **_bounds(f.info))
    return inspect.Parameter(f.param, inspect.Parameter.KEYWORD_ONLY, default=option,
                             annotation=annotation)


def with_flags(model: type[BaseModel], *skip: str):
    """Decorate a command ``fn(**values)`` so that typer sees one option per flag of ``model``
    (the fields named in ``skip`` excepted) after ``fn``'s own parameters."""
    def wrap(fn):
        own = list(inspect.signature(fn).parameters.values())
        own = [p for p in own if p.kind is not inspect.Parameter.VAR_KEYWORD]
        extra = [parameter(f) for f in flags(model) if f.param not in skip]
        fn.__signature__ = inspect.Signature(own + extra)
        return fn
    return wrap


def _parsed(f: Flag, value):
    choices = f.extra.get("choices")
    if choices and value not in choices:
        raise MscaleError(f"{f.flag} {value!r} is not one of {', '.join(choices)}", field=f.flag,
                          fix=f"{f.flag} {choices[0]} ({_help(f)})")
    if f.kind is not dict:
        return value
    whole = f.value_type() is int
    lo, hi = f.extra.get("bounds", (0, float("inf")))
    out = parse_rank_values(value, f.flag, f.extra["metavar"].split(":")[1], (lo, hi),
                            f.extra.get("example", f"1:{lo if whole else 0.5}"))
    if whole:
        for text, v in zip(value, out.values()):
            if v != int(v):
                raise MscaleError(f"{text!r}: {f.extra['metavar'].split(':')[1]} must be a "
                                  "whole number", field=f.flag, fix=f"e.g. {f.flag} 1:{lo}")
        return {rank: int(v) for rank, v in out.items()}
    return out


def build(model: type[BaseModel], values: dict, **fixed) -> BaseModel:
    """The ``model`` the command line asked for: the flag ``values`` (by parameter name) put
    back into their places, plus ``fixed`` top-level fields; a value the model refuses is an
    error naming its flag."""
    data: dict = dict(fixed)
    by_param = {f.param: f for f in flags(model)}
    for param, value in values.items():
        f = by_param[param]
        node = data
        for key in f.path[:-1]:
            node = node.setdefault(key, {})
        node[f.path[-1]] = _parsed(f, value)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = tuple(str(p) for p in err["loc"])
        f = next((f for f in by_param.values() if where[:len(f.path)] == f.path), None)
        name = f.flag if f else ".".join(where)
        raise MscaleError(f"{err['msg']} (got {err.get('input')!r})", field=name,
                          fix=f"give {name} a value the help allows (`--help`)") from None
