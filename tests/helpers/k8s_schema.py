"""A manifest checked against a CRD's OpenAPI schema (``tests/fixtures/trainjob-crd-*.json``) as the API server checks
an object on create with strict field validation: its group, version and kind, unknown fields, types, required
fields, bounds, patterns, list-map keys, and the CRD's rules on ``metadata.name``. No cluster, no network."""

from __future__ import annotations

import json
import re
from typing import Any

from helpers.paths import ROOT

_INT32 = (-(2**31), 2**31 - 1)
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}
_MATCHES = re.compile(r"^self\.metadata\.name\.matches\('(.*)'\)$")
_SIZE = re.compile(r"^size\(self\.metadata\.name\) <= (\d+)$")


def load_crd(name: str) -> dict[str, Any]:
    return json.loads((ROOT / "tests" / "fixtures" / name).read_text())


def problems(manifest: dict[str, Any], crd: dict[str, Any]) -> list[str]:
    """Every way ``manifest`` fails the CRD, one line each; empty when the API server would accept it."""
    out: list[str] = []
    if manifest.get("apiVersion") != f"{crd['group']}/{crd['version']}" or manifest.get("kind") != crd["kind"]:
        out.append(f"apiVersion/kind {manifest.get('apiVersion')}/{manifest.get('kind')} is not this CRD's")
    schema = crd["openAPIV3Schema"]
    _walk(manifest, schema, "", out)
    name = manifest.get("metadata", {}).get("name", "")
    for rule in schema.get("x-kubernetes-validations", []):
        text = rule["rule"]
        if (m := _MATCHES.match(text)) and not re.search(m[1], name):
            out.append(f"metadata.name: {rule['message']}")
        elif (m := _SIZE.match(text)) and len(name) > int(m[1]):
            out.append(f"metadata.name: {rule['message']}")
        elif not _MATCHES.match(text) and not _SIZE.match(text):
            out.append(f"cannot check the rule {text!r}: teach tests/helpers/k8s_schema.py")
    return out


def _walk(value: Any, schema: dict[str, Any], path: str, out: list[str]) -> None:
    where = path or "."
    if schema.get("x-paratrain-pruned"):
        out.append(f"{where}: the fixture leaves this field's schema out, so it cannot be checked")
        return
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            out.append(f"{where}: {value!r} is neither an integer nor a string")
        elif isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
            out.append(f"{where}: {value!r} does not match {schema['pattern']}")
        return
    kind = schema.get("type")
    if kind == "integer":
        if isinstance(value, bool) or not isinstance(value, int):
            out.append(f"{where}: {value!r} is not an integer")
            return
        low, high = schema.get("minimum", -float("inf")), schema.get("maximum", float("inf"))
        if schema.get("format") == "int32":
            low, high = max(low, _INT32[0]), min(high, _INT32[1])
        if not low <= value <= high:
            out.append(f"{where}: {value} is outside {low} … {high}")
        return
    if kind in _TYPES and not isinstance(value, _TYPES[kind]):
        out.append(f"{where}: {value!r} is not of type {kind}")
        return
    if kind == "object":
        _object(value, schema, path, out)
    elif kind == "array":
        _array(value, schema, path, out)
    elif kind == "string":
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
            out.append(f"{where}: length {len(value)} is outside the allowed lengths")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            out.append(f"{where}: {value!r} does not match {schema['pattern']}")
        if "enum" in schema and value not in schema["enum"]:
            out.append(f"{where}: {value!r} is not one of {schema['enum']}")


def _object(value: dict[str, Any], schema: dict[str, Any], path: str, out: list[str]) -> None:
    properties, extra = schema.get("properties"), schema.get("additionalProperties")
    for key, item in value.items():
        if properties is not None and key in properties:
            _walk(item, properties[key], f"{path}.{key}", out)
        elif isinstance(extra, dict):
            _walk(item, extra, f"{path}.{key}", out)
        elif properties is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out.append(f"{path}.{key}: unknown field")
    for key in schema.get("required", []):
        if key not in value:
            out.append(f"{path}.{key}: required")


def _array(value: list[Any], schema: dict[str, Any], path: str, out: list[str]) -> None:
    if len(value) > schema.get("maxItems", len(value)):
        out.append(f"{path}: {len(value)} items, at most {schema['maxItems']}")
    for i, item in enumerate(value):
        _walk(item, schema.get("items", {}), f"{path}[{i}]", out)
    keys = schema.get("x-kubernetes-list-map-keys")
    if keys:
        seen = [tuple(item.get(k) for k in keys) for item in value if isinstance(item, dict)]
        if len(seen) != len(set(seen)):
            out.append(f"{path}: two items share the key {keys}")
