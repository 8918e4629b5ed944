"""A request body's structured output, in whichever of its OpenAI and vLLM forms it comes, as the engine's
StructuredOutputsParams.

The forms: OpenAI's `response_format` ({"type": "json_object"}, or {"type": "json_schema", "json_schema": {"name",
"schema", "strict"}}; {"type": "text"} asks for none), vLLM's `structured_outputs` ({"json" | "json_object" |
"regex" | "choice" | "grammar": ..., "disable_any_whitespace": bool}) and its older `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar`. One form a request; a malformed one is a 400 naming its field. Whether a
well-formed schema, regex or grammar compiles, the engine decides (`engine_error` names the same field).
"""

from __future__ import annotations

from typing import Any

from engine.interface import StructuredOutputsParams
from gateway.errors import APIError

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar", "disable_any_whitespace")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def structured_field(response_format: dict[str, Any] | None, extra: dict[str, Any]) -> str | None:
    """The one field that asks for a structured output (None: none does); a 400 when several do."""
    return _the_one(response_format, extra)[0]


def structured_outputs(response_format: dict[str, Any] | None, extra: dict[str, Any]) -> StructuredOutputsParams | None:
    """The structured output the body asks for (response_format, and the body's extra fields), or None."""
    field, value = _the_one(response_format, extra)
    if field is None:
        return None
    if field == "response_format":
        options = _from_response_format(value)
    elif field == "structured_outputs":
        options = _from_structured_outputs(value)
    else:
        options = {GUIDED_FIELDS[field]: value}
    try:
        return StructuredOutputsParams(**options)
    except ValueError as e:
        why = str(e).removeprefix("invalid sampling parameter 'structured_outputs': ")
        raise APIError(400, f"invalid {field}: {why}", param=field) from None


def _the_one(response_format: dict[str, Any] | None, extra: dict[str, Any]) -> tuple[str | None, Any]:
    """(field, value) of the one field that asks for a structured output, (None, None) where none does; a 400 naming
    the second where several do."""
    given = []
    if response_format is not None and response_format.get("type", "text") != "text":
        given.append(("response_format", response_format))
    for name in ("structured_outputs", *GUIDED_FIELDS):
        if extra.get(name) is not None:
            given.append((name, extra[name]))
    if len(given) > 1:
        fields = [name for name, _ in given]
        raise APIError(400, f"give one structured output, not {' and '.join(fields)}", param=fields[1])
    return given[0] if given else (None, None)


def _from_response_format(response_format: dict[str, Any]) -> dict[str, Any]:
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMATS:
        known = ", ".join(RESPONSE_FORMATS)
        raise APIError(400, f"response_format of type {kind!r} is not supported ({known} are)", param="response_format")
    if kind == "json_object":
        return {"json_object": True}
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        message = "response_format of type 'json_schema' needs json_schema.schema, a JSON schema object"
        raise APIError(400, message, param="response_format")
    return {"json": spec["schema"]}  # `strict` or not, the schema is enforced


def _from_structured_outputs(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise APIError(400, "structured_outputs must be an object", param="structured_outputs")
    unknown = sorted(set(value) - set(STRUCTURED_KEYS))
    if unknown:
        message = f"structured_outputs.{unknown[0]} is not supported (only {', '.join(STRUCTURED_KEYS)} are)"
        raise APIError(400, message, param="structured_outputs")
    return {key: v for key, v in value.items() if v is not None}
