"""docs/config-reference.md, generated from the schemas so that it cannot drift from them.

    python -m mscale.config.reference > docs/config-reference.md

Every error about a config field points the user there (`mscale.config.base.FIX`); a unit test
fails when the committed file differs from what this module prints.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Literal, Union

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from mscale.config.base import ALIAS_SLACK, StrictModel
from mscale.config.cluster import ClusterConfig
from mscale.config.files import MAX_CONFIG_BYTES
from mscale.config.layout import LayoutConfig
from mscale.config.model import ModelConfig
from mscale.config.plan import Plan
from mscale.config.training import TrainingConfig

SECTIONS: list[tuple[str, type[StrictModel], str]] = [
    ("Cluster", ClusterConfig, "`mscale plan --cluster FILE` (e.g. `plans/clusters/`), and the "
                               "`cluster:` section of a plan"),
    ("Model", ModelConfig, "`mscale plan --model FILE` (e.g. `plans/models/`), and the `model:` "
                           "section of a plan"),
    ("Training", TrainingConfig, "`mscale plan --training FILE` (e.g. `plans/training/`), and the "
                                 "`training:` section of a plan"),
    ("Layout", LayoutConfig, "the `layout:` section of a plan, and `mscale plan --layout FILE`"),
    ("Plan", Plan, "the file `mscale plan -o` writes and `mscale train` runs; its `cluster`, "
                   "`model`, `training` and `layout` sections are described above"),
]
"""(title, schema, where it is read) of every section, in order."""

_SECTION_MODELS = {schema for _, schema, _ in SECTIONS}
_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", Any: "any"}


def generate() -> str:
    """The whole reference as Markdown."""
    out = [_HEADER.format(mib=MAX_CONFIG_BYTES // 2**20, slack=f"{ALIAS_SLACK:,}")]
    for title, schema, where in SECTIONS:
        out += [f"## {title}", "", f"Read from {where}. {_one_line(schema.__doc__)}", "",
                "| field | type | bounds | default | meaning |", "|---|---|---|---|---|"]
        out += _rows(schema, "", top=schema)
        out.append("")
    return "\n".join(out)


_HEADER = """\
# Configuration reference

Generated from the schemas in `src/mscale/config/` by
`python -m mscale.config.reference > docs/config-reference.md`; a unit test fails when the two
disagree. Every config, plan and HF `config.json` is read the same strict way:

- unknown fields are refused (a typo must not be silently ignored; the error names the closest
  known field, or the section of the plan a field written in the wrong one belongs to; in a
  cluster, model or training file given to `plan`, the file or `plan` option it belongs to, e.g.
  `--tp` for `tp`), and so is a key repeated in one mapping;
- types are strict: `true` is not the integer 1, `96.5` or `1e3` is not a count, `"64"` is not a
  number; an integer is accepted where a number is expected, and `1e-4` reads as a number;
- numbers are finite: `.inf`, `.nan` and overflowing literals such as `1e999` are refused anywhere
  in a file, free-form sections included;
- files are UTF-8 text of at most {mib} MiB; YAML aliases may not expand a file beyond twice its
  size plus {slack} values; a pipe that stays silent is given up after a few seconds.

An error names the file, the field (dotted, as in the tables below; a list item by its index:
`data.sources[1].path` is a row `data.sources[].path`) and a fix, and exits with code 3.
"""


def _rows(schema: type[BaseModel], prefix: str, top: type[BaseModel]) -> list[str]:
    rows = []
    for name, info in schema.model_fields.items():
        dotted = f"{prefix}{name}"
        nested = _nested_model(info.annotation)
        kind = (info.json_schema_extra or {}).get("doc_type") or _type(info.annotation)
        elsewhere = nested in _SECTION_MODELS - {top}
        if elsewhere:
            title = next(t for t, schema, _ in SECTIONS if schema is nested)
            kind = f"mapping ([{title}](#{title.lower()}))"
        rows.append(f"| `{dotted}` | {kind} | {_bounds(info)} | "
                    f"{_default(info)} | {_cell(info.description)} |")
        if nested is not None and not elsewhere:
            item = "[]" if _holds_list(info.annotation) else ""
            rows += _rows(nested, f"{dotted}{item}.", top)
    return rows


def _holds_list(annotation: Any) -> bool:
    """Whether a field holds a list (optionally): its items' fields are listed as ``name[].x``,
    as an error names item i's ``name[i].x`` (`config.base.field_path`)."""
    return any(typing.get_origin(a) is list for a in (annotation, *typing.get_args(annotation)))


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The schema a field holds (directly, optionally or as list items), if any."""
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
        if typing.get_origin(arg) is list:
            return _nested_model(typing.get_args(arg)[0])
    return None


def _type(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return " or ".join(_type(a) for a in args if a is not type(None))
    if origin is typing.Annotated:
        return _type(args[0])
    if origin is Literal:
        return "one of " + ", ".join(f"`{_yaml(a)}`" for a in args)
    if origin is list:
        return f"list of {_plural(_type(args[0]))}"
    if origin is dict:
        return "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    return _SCALARS.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _plural(text: str) -> str:
    if text.startswith("list of "):
        return "lists of " + text[len("list of "):]
    return {"mapping": "mappings", "any": "values"}.get(text, text + "s")


_SYMBOLS = ((at.Gt, "gt", "> {}"), (at.Ge, "ge", "≥ {}"), (at.Lt, "lt", "< {}"),
            (at.Le, "le", "≤ {}"))


def _bounds(info: FieldInfo) -> str:
    """Range and length constraints, from the field and from its (optional) annotated type."""
    metadata = list(info.metadata)
    for arg in typing.get_args(info.annotation):
        if typing.get_origin(arg) is typing.Annotated:
            for extra in typing.get_args(arg)[1:]:
                metadata += getattr(extra, "metadata", [extra])
    parts = []
    ge = [m.ge for m in metadata if isinstance(m, at.Ge)]
    le = [m.le for m in metadata if isinstance(m, at.Le)]
    if ge and le and ge == le:  # a version pinned to one value
        return f"= {_number(ge[0])}"
    for m in metadata:
        for kind, attr, text in _SYMBOLS:
            if isinstance(m, kind):
                parts.append(text.format(_number(getattr(m, attr))))
        if isinstance(m, at.MinLen):
            parts.append(f"length ≥ {m.min_length:,}")
        if isinstance(m, at.MaxLen):
            parts.append(f"length ≤ {m.max_length:,}")
    return ", ".join(parts)


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e7:
        value = int(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        return "computed"
    if info.default is PydanticUndefined:
        return "**required**"
    if isinstance(info.default, BaseModel):
        return "see below"
    return f"`{_yaml(info.default)}`"


def _yaml(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return f"{value:g}"
    return json.dumps(value)


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def _cell(text: str | None) -> str:
    return _one_line(text).replace("|", "\\|")


if __name__ == "__main__":
    print(generate(), end="")
