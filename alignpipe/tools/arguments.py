"""Checking a call's arguments against its tool's ``parameters`` (a JSON Schema subset).

The subset is what OpenAI function schemas use in practice: ``type`` (a name or a list of
names), ``properties``, ``required``, ``additionalProperties: false``, ``enum`` and ``items``.
Other keywords are accepted and not checked. A problem is reported as text the policy can act
on (``argument 'x': expected integer, got string``), never raised.
"""

from __future__ import annotations

__all__ = ["argument_problem", "schema_problem"]

# JSON type name -> Python types that are that JSON type (bool is not a number in JSON).
_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    for name in ("integer", "number", "string", "object", "array", "null"):
        if isinstance(value, _TYPES[name]):
            return name
    return type(value).__name__


def _is(value, type_name: str) -> bool:
    if isinstance(value, bool):
        return type_name == "boolean"
    if type_name == "integer" and isinstance(value, float):
        return value.is_integer()  # JSON has one number type: 3.0 is an integer
    return isinstance(value, _TYPES.get(type_name, (object,)))


def _problem(value, schema: dict, where: str) -> str:
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_is(value, t) for t in names):
            return f"{where}: expected {' or '.join(names)}, got {_json_type(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where}: expected one of {schema['enum']}, got {value!r}"
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        missing = [k for k in schema.get("required") or [] if k not in value]
        if missing:
            return f"{where}: missing required {', '.join(repr(k) for k in missing)}"
        if schema.get("additionalProperties") is False:
            extra = sorted(k for k in value if k not in props)
            if extra:
                return (
                    f"{where}: unexpected {', '.join(repr(k) for k in extra)} (allowed: {', '.join(props)})"
                )
        for key, sub in props.items():
            if key in value and isinstance(sub, dict):
                found = _problem(
                    value[key], sub, f"argument {key!r}" if where == "arguments" else f"{where}.{key}"
                )
                if found:
                    return found
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            found = _problem(item, schema["items"], f"{where}[{i}]")
            if found:
                return found
    return ""


def argument_problem(arguments, parameters: dict) -> str:
    """What is wrong with ``arguments`` (parsed JSON) for ``parameters``, or "" when they fit."""
    if not isinstance(arguments, dict):
        return f"arguments: expected a JSON object, got {_json_type(arguments)}"
    return _problem(arguments, parameters, "arguments")


def schema_problem(parameters) -> str:
    """What is wrong with a tool's ``parameters`` schema as config gives it, or ""."""
    if not isinstance(parameters, dict):
        return f"parameters must be a JSON Schema object, got {type(parameters).__name__}"
    if parameters.get("type", "object") != "object":
        return f"parameters must describe an object (type: object), got type: {parameters['type']!r}"
    for key in ("properties", "required"):
        want = dict if key == "properties" else list
        if key in parameters and not isinstance(parameters[key], want):
            return f"parameters.{key} must be a {'mapping' if want is dict else 'list'}"
    unknown = [t for t in _flat_types(parameters) if t not in _TYPES]
    if unknown:
        return f"parameters: unknown JSON type {unknown[0]!r} (known: {', '.join(_TYPES)})"
    return ""


def _flat_types(schema: dict) -> list[str]:
    found = []
    types = schema.get("type")
    if types is not None:
        found += [types] if isinstance(types, str) else list(types)
    for sub in (schema.get("properties") or {}).values():
        if isinstance(sub, dict):
            found += _flat_types(sub)
    if isinstance(schema.get("items"), dict):
        found += _flat_types(schema["items"])
    return found
