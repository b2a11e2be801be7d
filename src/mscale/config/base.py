"""Shared pieces of every schema: strict models and YAML/JSON loading with actionable errors.

Every file mscale reads goes through `load_model`, so a typo in any config, plan or run-directory
record produces the same kind of message: the file, the dotted field, what is wrong, how to fix it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from mscale.errors import MscaleError

try:  # the C loader is ~10x faster on 12,288-rank plans; same safety as SafeLoader
    _SafeLoader: type = yaml.CSafeLoader
except AttributeError:  # pragma: no cover - pyyaml built without libyaml
    _SafeLoader = yaml.SafeLoader


class StrictModel(BaseModel):
    """Base for all schemas: unknown fields are errors (a typo must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=True)


M = TypeVar("M", bound=BaseModel)


def read_text(path: str | Path) -> str:
    """Read a small text file, local or any fsspec URL, with a clear error when it is missing.

    Local paths (no ``scheme://``) are read with plain ``open()``, so non-seekable files such as
    ``/dev/stdin`` or a shell's ``<(...)`` pipe work; fsspec (which seeks) only handles URLs.
    """
    text = str(path)
    try:
        if "://" not in text:
            with open(text, encoding="utf-8") as f:
                return f.read()
        import fsspec

        with fsspec.open(text, "r") as f:
            return f.read()
    except FileNotFoundError:
        raise MscaleError("file not found", file=text,
                          fix="check the path; relative paths are taken from the current directory")
    except IsADirectoryError:
        raise MscaleError("is a directory, expected a file", file=text)


def parse_yaml(text: str, source: str) -> Any:
    """Parse YAML safely (never constructs Python objects) and report syntax errors by line."""
    try:
        return yaml.load(text, Loader=_SafeLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else None
        raise MscaleError(f"not valid YAML: {getattr(e, 'problem', e)}", file=source, field=where,
                          fix="fix the YAML syntax at that position")


def validation_to_error(err: ValidationError, source: str | None, prefix: str = "") -> MscaleError:
    """Turn pydantic's error list into one MscaleError naming the first bad field.

    All problems are listed in the message; the first one's location becomes the field.
    """
    lines = []
    first_field = None
    for item in err.errors():
        loc = ".".join(str(p) for p in item["loc"])
        loc = f"{prefix}{loc}" if loc else prefix.rstrip(".") or "(top level)"
        first_field = first_field or loc
        msg = item["msg"]
        if item["type"] == "extra_forbidden":
            msg = "unknown field (a typo?)"
        elif item["type"] == "missing":
            msg = "required field is missing"
        lines.append(f"{loc}: {msg}")
    message = lines[0].split(": ", 1)[1] if len(lines) == 1 else "; ".join(lines)
    return MscaleError(message, file=source, field=first_field,
                       fix="correct the field; `mscale plan --help` and docs/ list every field")


def validate(model: type[M], data: Any, source: str | None, prefix: str = "") -> M:
    """Validate already-parsed data against a schema, raising MscaleError on failure."""
    if data is None:
        raise MscaleError("file is empty", file=source, fix="fill in the required fields")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_to_error(e, source, prefix) from None


def load_model(model: type[M], path: str | Path) -> M:
    """Load a YAML (or JSON, a YAML subset) file into a schema."""
    return validate(model, parse_yaml(read_text(path), str(path)), str(path))


def dump_yaml(model: BaseModel) -> str:
    """Serialise a schema instance as YAML; short lists of scalars stay on one line."""
    data = model.model_dump(mode="json", exclude_none=True)
    return yaml.dump(data, Dumper=_FlowListDumper, sort_keys=False, width=100)


_SafeDumper: type = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml: ~10x faster


class _FlowListDumper(_SafeDumper):  # type: ignore[misc,valid-type]
    """Write lists of scalars in flow style ([0, 1, 2]) so rank maps stay one line per rank."""


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flow = all(not isinstance(x, (list, dict)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_FlowListDumper.add_representer(list, _represent_list)
