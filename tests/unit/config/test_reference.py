"""docs/config-reference.md is generated from the schemas and must match them exactly."""

from __future__ import annotations

from mscale.config.reference import SECTIONS, _holds_list, _nested_model, generate

from tests.conftest import REPO


def test_committed_reference_matches_the_schemas():
    committed = (REPO / "docs" / "config-reference.md").read_text()
    assert committed == generate(), (
        "docs/config-reference.md is stale: run "
        "`python -m mscale.config.reference > docs/config-reference.md`")


def test_every_documented_field_has_a_docstring_and_a_row():
    doc = generate()
    missing = []

    def walk(schema, prefix):
        for name, info in schema.model_fields.items():
            if not info.description:
                missing.append(f"{schema.__name__}.{name}")
            assert f"| `{prefix}{name}` |" in doc
            nested = _nested_model(info.annotation)
            if nested is not None and nested not in {s for _, s, _ in SECTIONS}:
                walk(nested, f"{prefix}{name}{'[]' if _holds_list(info.annotation) else ''}.")

    for _, schema, _ in SECTIONS:
        walk(schema, "")
    assert not missing, f"fields without a docstring: {missing}"


def test_list_items_are_spelled_as_errors_spell_them():
    """An error names ``data.sources[1].path`` (config.base.field_path); its row is
    ``data.sources[].path``, never ``data.sources.path``."""
    doc = generate()
    assert "| `data.sources[].path` |" in doc and "`data.sources.path`" not in doc
