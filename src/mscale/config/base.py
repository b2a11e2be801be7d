"""Shared pieces of every schema: strict models and YAML/JSON loading with actionable errors.

Every file mscale reads goes through `load_model` (or `read_text` + `parse_yaml` or
`json_reader.parse_json` + `validate`), so a typo, a wrong type, a number out of range or a
hostile file produces the same kind of message: the file, the dotted field, what is wrong, how
to fix it; never a traceback.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from mscale.config.files import MAX_CONFIG_BYTES, decode_text, read_bytes, read_text
from mscale.config.json_reader import parse_json
from mscale.errors import MscaleError

__all__ = ["MAX_CONFIG_BYTES", "FieldError", "StrictModel", "decode_text", "dump_yaml",
           "field_path", "load_json_model", "load_model", "parse_yaml", "read_bytes", "read_text",
           "validate", "validation_to_error"]

try:  # the C loader is ~10x faster on 12,288-rank plans; same safety as SafeLoader
    _SafeLoader: type = yaml.CSafeLoader
except AttributeError:  # pragma: no cover - pyyaml built without libyaml
    _SafeLoader = yaml.SafeLoader

REFERENCE = "docs/config-reference.md"
_LISTS = f"{REFERENCE} lists every field with its type and bounds"
FIX = f"correct the field; {_LISTS}"
MAPPING_FIX = ("write one `field: value` per line (nodes: 4), not a list (- ...) or a lone value; "
               f"{_LISTS}")
"""A file (or section) that is not a mapping has no field to correct: say what it should be."""


class StrictModel(BaseModel):
    """Base for all schemas: what the file says is what runs, or it is refused.

    - unknown fields are errors (a typo must not be silently ignored);
    - strict types: ``true`` is not the integer 1, ``96.5`` is not a layer count, ``"64"`` is not
      a number (an int is still accepted where a float is expected);
    - no ``.inf``/``.nan`` in any float field;
    - attribute docstrings become the field descriptions that docs/config-reference.md lists.
    """

    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=True,
                              strict=True, allow_inf_nan=False, use_attribute_docstrings=True)


def flag(name: str, *, hidden: bool = False, metavar: str | None = None, **extra) -> dict:
    """A field's command-line flag, for ``Field(json_schema_extra=flag(...))``: the CLI derives
    the option, its help (the field's docstring) and its bounds from the field (cli/options.py).
    ``extra``: ``bounds`` of a ``RANK:VALUE`` map's values, ``choices`` of a string,
    ``negative`` (the ``--no-…`` spelling of a bool)."""
    return {"flag": name, "hidden": hidden, "metavar": metavar, **extra}


NOT_A_FLAG = {"flag": None}
"""``json_schema_extra`` of an options field that has no flag of its own."""


class FieldError(ValueError):
    """Raised by a model validator to blame one field (relative to the model), so the error
    names ``cluster.nodes`` instead of ``cluster`` and the message need not repeat the field."""

    def __init__(self, field: str, message: str, fix: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.fix = fix
        """What to change, when more specific than the generic `FIX`."""


M = TypeVar("M", bound=BaseModel)

# -- YAML -----------------------------------------------------------------------------------------
_FLOAT_TAG = "tag:yaml.org,2002:float"
_MERGE_TAG = "tag:yaml.org,2002:merge"
MAX_INT_CHARS = 100
"""Longest integer literal read: far past any bound, far below what makes int() slow or fail."""
ALIAS_SLACK = 10_000
"""Nodes that aliases may add beyond twice the file's size: room for ``<<: *defaults``, never
for a "billion laughs" file, whose few hundred bytes expand to 10^9 nodes."""


class _Loader(_SafeLoader):  # type: ignore[misc,valid-type]
    """The safe loader, plus YAML 1.2 floats without a dot (``1e-4``, which YAML 1.1 reads as a
    string), refusing non-finite floats (``.inf``, ``.nan``, ``1e999``) wherever they appear."""


class _BadNode(Exception):
    """A problem found while walking or constructing; ``node`` (if any) locates it."""

    def __init__(self, node: yaml.Node | None, message: str, fix: str) -> None:
        super().__init__(message)
        self.node, self.message, self.fix = node, message, fix


def _finite_float(loader: yaml.BaseLoader, node: yaml.ScalarNode) -> float:
    value = yaml.SafeLoader.construct_yaml_float(loader, node)
    if not math.isfinite(value):
        raise _BadNode(node, f"non-finite number {node.value!r}",
                       "write a finite number (mscale refuses .inf and .nan in every file)")
    return value


def _short_int(loader: yaml.BaseLoader, node: yaml.ScalarNode) -> int:
    if len(node.value) > MAX_INT_CHARS:  # Python refuses > 4,300 digits, with a ValueError
        raise _BadNode(node, f"integer of {len(node.value):,} characters",
                       "write a number within the bounds in " + REFERENCE)
    return yaml.SafeLoader.construct_yaml_int(loader, node)


_Loader.add_implicit_resolver(
    _FLOAT_TAG, re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))
_Loader.add_constructor(_FLOAT_TAG, _finite_float)
_Loader.add_constructor("tag:yaml.org,2002:int", _short_int)


def parse_yaml(text: str, source: str) -> Any:
    """Parse YAML safely (never constructs Python objects) and report problems by field or line.

    Before building anything, the node graph is walked once with aliases expanded: a file whose
    aliases expand past ``2·len(text) + ALIAS_SLACK`` nodes is refused (files without aliases
    never come close), and so is a mapping that repeats a key (YAML would keep the last silently).
    """
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        _check_nodes(root, 2 * len(text) + ALIAS_SLACK)
        return loader.construct_document(root)
    except _BadNode as e:
        if e.node is None:
            raise MscaleError(e.message, file=source, fix=e.fix) from None
        mark = e.node.start_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}"
        path = _node_path(root, e.node)
        raise MscaleError(f"{e.message} ({where})" if path else e.message, file=source,
                          field=path or where, fix=e.fix) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else None
        raise MscaleError(f"not valid YAML: {getattr(e, 'problem', None) or e}", file=source,
                          field=where, fix="fix the YAML syntax at that position") from None
    except RecursionError:
        raise MscaleError("nested too deeply", file=source,
                          fix="a config is a few levels of mappings and lists") from None
    finally:
        loader.dispose()


def _check_nodes(root: yaml.Node, budget: int) -> None:
    """Walk the graph as construction would (aliases expanded): bounded size, no repeated keys."""
    stack, seen = [root], 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > budget:
            raise _BadNode(None, f"YAML aliases expand to more than {budget:,} values (an alias "
                           "bomb?)", "write the values out instead of through &anchors/*aliases")
        if node.id == "sequence":
            stack.extend(node.value)
        elif node.id == "mapping":
            keys = set()
            for key, value in node.value:
                if key.id == "scalar" and key.tag != _MERGE_TAG:
                    if (key.tag, key.value) in keys:
                        raise _BadNode(key, "appears twice in one mapping",
                                       "keep one of the two (YAML would silently use the last)")
                    keys.add((key.tag, key.value))
                stack.append(key)
                stack.append(value)


def _node_path(root: yaml.Node, target: yaml.Node) -> str | None:
    """Dotted path of ``target`` below ``root`` (keys by name, list items by index), or None."""
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    seen: set[int] = set()
    while stack:
        node, path = stack.pop()
        if node is target:
            return path or None
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.id == "sequence":
            stack.extend((n, f"{path}[{i}]") for i, n in enumerate(node.value))
        elif node.id == "mapping":
            for key, value in node.value:
                name = f"{path}.{key.value}" if path else str(key.value)
                stack.extend(((key, name), (value, name)))
    return None


# -- validation -----------------------------------------------------------------------------------
def validation_to_error(err: ValidationError, source: str | None, prefix: str = "",
                        model: type | None = None) -> MscaleError:
    """Turn pydantic's error list into one MscaleError naming the first bad field.

    The field goes in ``field`` only (the CLI prints ``file: field: message``), never again in the
    message; further problems follow as ``also: field: message``. With the ``model`` validated,
    an unknown field names the known one it is closest to (``gpu_per_node``: gpus_per_node?).
    """
    problems = [_problem(item, prefix, model) for item in err.errors()]
    field, message, fix = problems[0]
    if len(problems) > 1:
        rest = [f"{f}: {m}" for f, m, _ in problems[1:4]]
        more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
        message += "; also " + "; ".join(rest) + more
    return MscaleError(message, file=source, field=field, fix=fix)


def _problem(item: Any, prefix: str, model: type | None = None) -> tuple[str, str, str]:
    """(dotted field, message without the field, fix) of one pydantic error."""
    loc = list(item["loc"])
    kind, msg = item["type"], item["msg"]
    error = (item.get("ctx") or {}).get("error")
    homes: list[str] = []  # an unknown field's right section(s), elsewhere in the file
    if isinstance(error, FieldError):
        loc.append(error.field)
        msg = str(error)
    elif kind == "value_error":
        msg = msg.removeprefix("Value error, ")
    elif kind == "extra_forbidden":
        near = _closest_field(model, loc)
        homes = [] if near else _homes_elsewhere(model, loc, item.get("input"))
        msg = (f"unknown field (a typo of {near}?)" if near else
               f"not a field of this section (it goes at {_either(homes)})" if homes else
               "unknown field (a typo?)")
    elif kind == "missing":
        msg = "required field is missing"
    field = field_path(prefix.rstrip("."), *loc) or "(top level)"
    value = item.get("input")
    if kind not in ("missing", "extra_forbidden", "value_error") and _scalar(value):
        msg += f", got {_show(value)}"
    fix = error.fix if isinstance(error, FieldError) and error.fix else _fix(kind, value)
    if homes:
        fix = f"move it to {_either(homes)}; {_LISTS}"
    return field, msg, fix


def _sections(model: type | None, path: str = "", depth: int = 3):
    """(dotted path, schema) of ``model`` and every section nested in it, ``depth`` deep."""
    import typing

    if model is None or not hasattr(model, "model_fields"):
        return
    yield path, model
    if depth == 0:
        return
    for name, info in model.model_fields.items():
        for t in [info.annotation, *typing.get_args(info.annotation)]:
            if isinstance(t, type) and issubclass(t, BaseModel):
                yield from _sections(t, f"{path}.{name}" if path else name, depth - 1)


def _homes_elsewhere(model: type | None, loc: list, value: Any) -> list[str]:
    """The other sections with a field named ``loc[-1]`` that takes ``value`` (``layout.tp``
    for ``tp: 2`` written under ``training``): a field in the wrong section is not a typo, and
    "correct the field" does not say to move it. Empty when no section has it."""
    name, here = str(loc[-1]), field_path(*[p for p in loc[:-1] if not isinstance(p, int)])
    return [field_path(path, name) for path, schema in _sections(model)
            if path != here and name in schema.model_fields
            and _takes(schema.model_fields[name].annotation, value)][:3]


def _takes(annotation: Any, value: Any) -> bool:
    """Whether a field of type ``annotation`` can hold ``value`` (its bounds aside): ``tp: 2``
    goes to ``layout.tp``, not to ``placement.groups.tp``, a list of rank lists."""
    try:
        TypeAdapter(annotation).validate_python(value)
    except ValidationError:
        return False
    return True


def _either(paths: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return " or ".join(paths) if len(paths) < 3 else f"{', '.join(paths[:-1])} or {paths[-1]}"


def _closest_field(model: type | None, loc: list) -> str | None:
    """The field of the model at ``loc``'s parent whose name is closest to ``loc``'s last part,
    if one is close; None when the model cannot be followed there."""
    import difflib
    import typing

    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
            continue  # a list item: the list's own model is already current
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        model = next((t for t in [field.annotation, *typing.get_args(field.annotation)]
                      if isinstance(t, type) and issubclass(t, BaseModel)), None)
    names = list(getattr(model, "model_fields", {})) if model is not None else []
    close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.75)
    return close[0] if close else None


def field_path(*parts: str | int) -> str:
    """The one spelling of a field's path in every error: names joined by dots, list items by
    index in brackets (``training.data.sources[1].path``), as `_node_path` locates a YAML node.
    Empty parts are skipped; a part may itself be a path (``eval.interval``)."""
    out = ""
    for p in parts:
        if isinstance(p, int) and not isinstance(p, bool):
            out += f"[{p}]"
        elif p != "":
            out += f".{p}" if out else str(p)
    return out


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _show(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _fix(kind: str, value: Any) -> str:
    if kind == "int_type" and isinstance(value, bool):
        return f"write a whole number, not true/false; {_LISTS}"
    if kind == "int_type" and isinstance(value, float):
        return f"write a whole number, without a decimal point or exponent; {_LISTS}"
    if kind in ("int_type", "float_type") and isinstance(value, str):
        return f"write a plain number such as 16 or 3e-4, without quotes; {_LISTS}"
    if kind == "string_type" and isinstance(value, (int, float)):
        return f'quote the value to make it a string (name: "175"); {_LISTS}'
    return FIX


def validate(model: type[M], data: Any, source: str | None, prefix: str = "") -> M:
    """Validate already-parsed data against a schema, raising MscaleError on failure."""
    if data is None:
        raise MscaleError("file is empty", file=source, fix="fill in the required fields")
    if not isinstance(data, (dict, BaseModel)):
        raise MscaleError(f"expected a mapping of fields, found a {_kind(data)}", file=source,
                          field=prefix.rstrip(".") or None, fix=MAPPING_FIX)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_to_error(e, source, prefix, model) from None
    except RecursionError:
        raise MscaleError("nested too deeply", file=source, field=prefix.rstrip(".") or None,
                          fix=FIX) from None


def _kind(data: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number",
            float: "number"}.get(type(data), type(data).__name__)


def load_model(model: type[M], path: str | Path) -> M:
    """Load a YAML (or JSON, a YAML subset) file into a schema."""
    return validate(model, parse_yaml(read_text(path), str(path)), str(path))


def load_json_model(model: type[M], path: str | Path, fix: str | None = None) -> M:
    """Load a file mscale writes as JSON and operators may edit (``quarantine.json``) into a
    schema, by JSON's rules, finite numbers only (a record that may hold NaN, ``preflight.json``,
    goes through `load_model`): an operator's hand edit with a trailing comma is refused here as by
    every other reader of it, not half-accepted as YAML (recover once called such a
    quarantine.json "not valid JSON" and obeyed it). ``fix``: what to do about bad JSON."""
    return validate(model, parse_json(read_text(path), str(path), fix=fix), str(path))


# -- writing --------------------------------------------------------------------------------------
def dump_yaml(model: BaseModel) -> str:
    """Serialise a schema instance as YAML; short lists of scalars stay on one line."""
    data = model.model_dump(mode="json", exclude_none=True)
    return yaml.dump(data, Dumper=_FlowListDumper, sort_keys=False, width=100)


_SafeDumper: type = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml: ~10x faster


class _FlowListDumper(_SafeDumper):  # type: ignore[misc,valid-type]
    """Write lists of scalars in flow style ([0, 1, 2]) so rank maps stay one line per rank.

    Never anchors: a value that appears twice is written twice, so the loader's alias budget
    never sees a file mscale wrote."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flow = all(not isinstance(x, (list, dict)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_FlowListDumper.add_representer(list, _represent_list)
