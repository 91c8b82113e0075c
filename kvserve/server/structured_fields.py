"""The request fields that constrain the output, mapped onto SamplingParams.structured_outputs
(kvserve.sampling_params.StructuredOutputsParams; the engine's kvserve/structured/ enforces it):

- `response_format` (chat): {"type": "text"} (no constraint), {"type": "json_object"} (any JSON
  object), {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} (that schema; one
  without a schema is any JSON object). The official client's `chat.completions.parse(
  response_format=PydanticModel)` sends json_schema.
- `structured_outputs` (chat and completions; vLLM's extra body field): StructuredOutputsParams'
  own fields, e.g. {"regex": "[0-9]+"}.
- vLLM's removed `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`: mapped to the
  same, with a deprecation line in the log (once per field per process).

At most one of them per request; every error is a 400 naming the field.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.server.serving import APIError

logger = logging.getLogger(__name__)

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_warned: set[str] = set()


def _deprecated(name: str) -> None:
    if name not in _warned:
        _warned.add(name)
        logger.warning("kvserve: request field %r is deprecated (removed in vLLM): send structured_outputs="
                       '{"%s": ...} instead (logged once)', name, GUIDED[name])


def check_schema(schema: Any, field: str) -> dict[str, Any]:
    """A JSON schema as the grammar takes it: an object, given as one or as its
    JSON text. Whether its keywords are supported is the grammar backend's to say."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise APIError(400, f"{field} is not valid JSON: {e}", param=field) from None
    if not isinstance(schema, dict):
        raise APIError(400, f"{field} must be a JSON schema (an object), got {type(schema).__name__}", param=field)
    return schema


def _from_response_format(rf: Any) -> dict[str, Any] | None:
    if rf is None or rf.type == "text":
        if rf is not None and rf.json_schema is not None:
            raise APIError(400, 'response_format.json_schema is only taken with type "json_schema"',
                           param="response_format.json_schema")
        return None
    if rf.type == "json_object":
        return {"json_object": True}
    if rf.json_schema is None:
        raise APIError(400, 'response_format of type "json_schema" needs a json_schema object (name, schema)',
                       param="response_format.json_schema")
    schema = rf.json_schema.schema_
    if schema is None:
        return {"json_object": True}
    return {"json": check_schema(schema, "response_format.json_schema.schema")}


def requested_constraints(req: Any) -> list[tuple[str, dict[str, Any]]]:
    """Every constraint the request sends, each as (its field, StructuredOutputsParams' keywords)."""
    found = []
    if (rf := _from_response_format(getattr(req, "response_format", None))) is not None:
        found.append(("response_format", rf))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", dict(req.structured_outputs)))
    for name, kind in GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            _deprecated(name)
            found.append((name, {kind: check_schema(value, name) if kind == "json" else value}))
    return found


def structured_outputs(req: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from; (None, None) without one."""
    found = requested_constraints(req)
    if not found:
        return None, None
    if len(found) > 1:
        names = [n for n, _ in found]
        raise APIError(400, f"{' and '.join(names)} each constrain the output; send one of them", param=names[1])
    field, kwargs = found[0]
    if field == "structured_outputs" and kwargs.get("json") is not None:
        kwargs["json"] = check_schema(kwargs["json"], "structured_outputs.json")
    return make_params(kwargs, field), field


def make_params(kwargs: dict[str, Any], field: str) -> StructuredOutputsParams:
    """StructuredOutputsParams(**kwargs); its refusal as a 400 naming `field`."""
    known = {"json", "regex", "choice", "grammar", "json_object", "whitespace_pattern"}
    if unknown := sorted(set(kwargs) - known):
        raise APIError(400, f"{field}: unknown key {unknown[0]!r}; the keys are {', '.join(sorted(known))}",
                       param=f"{field}.{unknown[0]}" if field == "structured_outputs" else field)
    try:
        return StructuredOutputsParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e) if field == "structured_outputs" else f"{field}: {e}", param=field) from None
