"""schemas/*.json agree with the code; the protocol modules expose what they say."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any

import pytest

from bridge.errors import SchemaVersionError
from bridge.protocol.headers import TAGS, headers_to_typed_json, typed_json_to_headers
from bridge.protocol.schema import KNOWN_ROW_SCHEMA_VERSIONS, ROW_SCHEMA_VERSION, row_schema
from tests.unit.test_protocol_manifest import sample_heartbeat, sample_manifest

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def load(name: str) -> Any:
    return json.loads((SCHEMAS / name).read_text(encoding="utf-8"))


def test_rows_v2_json_matches_row_schema_v2() -> None:
    doc = load("rows.v2.json")
    schema = row_schema(2)
    assert doc["version"] == 2 == ROW_SCHEMA_VERSION
    assert [f["name"] for f in doc["fields"]] == schema.names
    for described, field in zip(doc["fields"], schema, strict=True):
        assert described["type"] == str(field.type), field.name
        assert described["nullable"] is field.nullable, field.name
        assert described["description"].strip(), field.name
    meta = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
    assert doc["schema_metadata"] == meta
    assert not (SCHEMAS / "rows.v1.json").exists()  # there is no installed base of v1


def test_rows_v2_json_documents_every_tag_and_its_example_decodes() -> None:
    doc = load("rows.v2.json")
    assert set(doc["properties_raw"]["field_values"]) == TAGS
    documented = "".join(doc["typed_json"]["payloads"]).replace(" ", "")
    assert sorted(documented) == sorted(TAGS)
    example = typed_json_to_headers(doc["typed_json"]["example"])
    assert headers_to_typed_json(example) == doc["typed_json"]["example"]


@pytest.mark.parametrize("version", [1, 3, "2", True, None])
def test_unknown_row_schema_versions_are_refused(version: Any) -> None:
    with pytest.raises(SchemaVersionError, match="upgrade"):
        row_schema(version)  # type: ignore[arg-type]
    assert KNOWN_ROW_SCHEMA_VERSIONS == {2}


# A structural checker for the subset of JSON Schema 2020-12 the two schemas use
# (jsonschema is not a dependency of this project).
_TYPES: dict[str, Any] = {
    "object": dict,
    "array": list,
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "null": type(None),
}


def _is(value: Any, type_name: str) -> bool:
    if type_name in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _TYPES[type_name])


def check(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    errors: list[str] = []
    if "const" in schema and (value != schema["const"] or type(value) is not type(schema["const"])):
        errors.append(f"{path}: not {schema['const']!r}")
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is(value, t) for t in types):
            return [*errors, f"{path}: not {types}"]
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: does not match {schema['pattern']}")
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", 1 << 60):
            errors.append(f"{path}: bad length")
    if _is(value, "number"):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: below minimum")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: above maximum")
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            errors.append(f"{path}: not above exclusiveMinimum")
    if isinstance(value, dict):
        errors += [f"{path}: missing {k}" for k in schema.get("required", []) if k not in value]
        props = schema.get("properties", {})
        for k, v in value.items():
            if k in props:
                errors += check(v, props[k], f"{path}.{k}")
            elif isinstance(schema.get("additionalProperties"), dict):
                errors += check(v, schema["additionalProperties"], f"{path}.{k}")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            errors += check(v, schema["items"], f"{path}[{i}]")
    return errors


def first_manifest() -> Any:
    return sample_manifest(bundle_seq=1, prev_sha256=None)


def idle_heartbeat() -> Any:
    return sample_heartbeat(last_bundle_seq=None, last_seq=None)


@pytest.mark.parametrize(
    ("schema_file", "sample"),
    [
        ("manifest.v1.schema.json", lambda: sample_manifest().to_json()),
        ("manifest.v1.schema.json", lambda: first_manifest().to_json()),
        (
            "manifest.v1.schema.json",
            lambda: sample_manifest(first_seq=None, last_seq=None, rows=0, exchanges={}).to_json(),
        ),
        ("heartbeat.v1.schema.json", lambda: sample_heartbeat().to_json()),
        ("heartbeat.v1.schema.json", lambda: idle_heartbeat().to_json()),
    ],
)
def test_samples_satisfy_the_json_schemas(schema_file: str, sample: Any) -> None:
    schema = load(schema_file)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    doc = json.loads(sample())
    assert check(doc, schema) == []
    assert set(schema["required"]) == set(doc)  # the schema names every field we write


@pytest.mark.parametrize(
    ("schema_file", "make", "key", "bad"),
    [
        ("manifest.v1.schema.json", sample_manifest, "bundle_id", "XYZ"),
        ("manifest.v1.schema.json", sample_manifest, "format", 2),
        ("manifest.v1.schema.json", sample_manifest, "rows", -1),
        ("manifest.v1.schema.json", sample_manifest, "gaps", [{"first_seq": 1}]),
        ("heartbeat.v1.schema.json", sample_heartbeat, "interval_seconds", 0),
        ("heartbeat.v1.schema.json", sample_heartbeat, "counters", {"x": -1}),
    ],
)
def test_the_json_schemas_are_not_vacuous(schema_file: str, make: Any, key: str, bad: Any) -> None:
    doc = json.loads(make().to_json())
    doc[key] = bad
    assert check(doc, load(schema_file)) != []


MODULES = [
    "properties", "headers", "schema", "rows", "manifest", "bundle", "naming", "heartbeat",
    "header_splice",
]  # fmt: skip


@pytest.mark.parametrize("name", MODULES)
def test_public_surface(name: str) -> None:
    module = importlib.import_module(f"bridge.protocol.{name}")
    assert module.__doc__ and module.__doc__.startswith("Protocol core")
    assert len(set(module.__all__)) == len(module.__all__)
    for symbol in module.__all__:
        assert hasattr(module, symbol), f"{name}.{symbol}"


def test_protocol_core_does_no_io() -> None:
    banned = re.compile(
        r"^\s*(import|from)\s+(os|socket|pathlib|subprocess|shutil|io|requests)\b", re.M
    )
    package = Path(__file__).resolve().parents[2] / "bridge" / "protocol"
    for name in MODULES:
        source = (package / f"{name}.py").read_text(encoding="utf-8")
        assert not banned.search(source), name
        assert not re.search(r"(?<![\w.])open\(", source), name
