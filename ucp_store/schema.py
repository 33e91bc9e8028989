"""JSON Schema validation of the public records (``schemas/<kind>.schema.json``, Draft 2020-12).

    from ucp_store.schema import validate
    validate("provenance", record)      # raises ucp_store.errors.ValidationError

The schema files ship as the package ``ucp_store._schemas`` (the ``schemas/`` folder of a source
checkout). A schema may ``$ref`` another by file name (``"provenance.schema.json"``); references are
resolved against the same folder.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
from pathlib import Path
from typing import Any

import jsonschema
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.exceptions import NoSuchResource
from referencing.jsonschema import DRAFT202012

from ucp_store.errors import ValidationError

__all__ = ["KINDS", "validate", "is_valid", "load_schema", "schema_path", "schemas_dir"]

#: record kinds with a schema file
KINDS = ("pattern", "topology", "provenance", "manifest")

_SUFFIX = ".schema.json"


def schemas_dir() -> Path:
    """The folder of the schema files: ``ucp_store._schemas`` if installed, else ``<checkout>/schemas``."""
    try:
        res = importlib.resources.files("ucp_store._schemas")
    except ModuleNotFoundError:
        res = None
    if res is not None:
        return res if isinstance(res, Path) else Path(str(res))
    return Path(__file__).resolve().parent.parent / "schemas"


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"validate: unknown record kind {kind!r}; expected one of {list(KINDS)}")


def schema_path(kind: str) -> Path:
    """The file holding the schema of ``kind``."""
    _check_kind(kind)
    return schemas_dir() / f"{kind}{_SUFFIX}"


def _read(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValidationError(f"no JSON Schema for this record kind: {path} does not exist") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValidationError(f"JSON Schema {path} is not valid JSON: {e}") from None
    try:
        Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValidationError(f"JSON Schema {path} is not a valid Draft 2020-12 schema: {e.message}") from None
    return schema


def _retrieve(uri: str) -> Resource:
    # "$ref": "provenance.schema.json" (relative to the referring schema's $id) -> schemas/<name>
    name = uri.rstrip("/").rsplit("/", 1)[-1].split("#", 1)[0]
    if not name.endswith(_SUFFIX) or "/" in name or name.startswith("."):
        raise NoSuchResource(ref=uri)  # type: ignore[call-arg]  # referencing's attrs class takes ref=
    path = schemas_dir() / name
    if not path.is_file():
        raise NoSuchResource(ref=uri)  # type: ignore[call-arg]
    return Resource.from_contents(_read(path), default_specification=DRAFT202012)


@functools.cache
def _validator(kind: str) -> Draft202012Validator:
    schema = _read(schema_path(kind))
    return Draft202012Validator(
        schema,
        registry=Registry(retrieve=_retrieve),  # type: ignore[call-arg]  # attrs field, unseen by mypy
        format_checker=Draft202012Validator.FORMAT_CHECKER,
    )


def load_schema(kind: str) -> dict[str, Any]:
    """The (parsed, checked, cached) schema of ``kind``."""
    _check_kind(kind)
    return _validator(kind).schema


def validate(kind: str, record: Any) -> None:
    """Check ``record`` against ``schemas/<kind>.schema.json``.

    Raises ``ValidationError`` naming the record kind, the JSON path of the offending field
    (``$.library_versions.torch``) and what was expected; further errors are counted.
    """
    _check_kind(kind)
    validator = _validator(kind)
    errors = list(validator.iter_errors(record))
    if not errors:
        return
    best = jsonschema.exceptions.best_match(errors, key=jsonschema.exceptions.relevance)
    path = best.json_path
    where = "at the top level" if path == "$" else f"at {path}"
    expectation = best.message
    detail = f" (schema rule {best.validator!r} at {'/'.join(str(p) for p in best.absolute_schema_path) or '/'})"
    more = len(errors) - 1
    tail = f"; and {more} more error{'s' if more != 1 else ''}" if more else ""
    raise ValidationError(f"invalid {kind} record {where}: {expectation}{detail}{tail}")


def is_valid(kind: str, record: Any) -> bool:
    """Whether ``record`` matches the schema of ``kind``."""
    _check_kind(kind)
    return _validator(kind).is_valid(record)
