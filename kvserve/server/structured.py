"""Request fields that constrain the output, turned into one `StructuredOutputsParams`.

Accepted (at most one of them per request): OpenAI's `response_format`
(`text`, `json_object`, `json_schema`), vLLM's `structured_outputs` extra
field (`json`, `regex`, `choice`, `grammar`, `json_object`) and the older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`.
Errors are 400s naming the field the client used.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.engine.validation import RequestValidator
from kvserve.errors import InvalidRequestError
from kvserve.sample.structured.grammar import StructuredOutputError
from kvserve.sampling_params import SamplingParamsError, StructuredOutputsParams

if TYPE_CHECKING:
    from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
    from kvserve.server.serving import ServingContext

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class ConstraintSource:
    """A constraint and the request field it came from (named in errors)."""

    def __init__(self, params: StructuredOutputsParams, field_name: str) -> None:
        self.params = params
        self.field_name = field_name


def constraint_from_request(body: "CompletionRequest | ChatCompletionRequest") -> ConstraintSource | None:
    """The request's output constraint, or None; raises InvalidRequestError when it is malformed
    or given twice."""
    found: list[ConstraintSource] = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        source = _from_response_format(response_format)
        if source is not None:
            found.append(source)
    given = getattr(body, "structured_outputs", None)
    if given is not None:
        found.append(ConstraintSource(_build(given, "structured_outputs"), "structured_outputs"))
    for field_name, kind in GUIDED_FIELDS.items():
        value = getattr(body, field_name, None)
        if value is not None:
            found.append(ConstraintSource(_build({kind: value}, field_name), field_name))
    if len(found) > 1:
        raise InvalidRequestError(
            f"give at most one output constraint, got {', '.join(s.field_name for s in found)}",
            found[1].field_name)
    return found[0] if found else None


def _from_response_format(response_format: Any) -> ConstraintSource | None:
    return format_constraint(response_format.type, response_format.json_schema, "response_format",
                             "response_format.json_schema")


def format_constraint(kind: Any, json_schema: Any, param: str, schema_param: str) -> ConstraintSource | None:
    """The constraint of an OpenAI output format (`response_format` in Chat Completions,
    `text.format` in Responses): `kind` "text", "json_object" or "json_schema" with
    `json_schema` {name, schema, strict, description}; errors name `param` / `schema_param`."""
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSource(StructuredOutputsParams(json_object=True), param)
    if kind == "json_schema":
        schema = _json_schema_of(json_schema, schema_param)
        return ConstraintSource(StructuredOutputsParams(json=schema), schema_param)
    raise InvalidRequestError(f"{param} type {kind!r} is not one of 'text', 'json_object', "
                              "'json_schema'", f"{param}.type")


def _json_schema_of(spec: Any, param: str) -> dict[str, Any]:
    """The schema of `response_format.json_schema` ({name, schema, strict, description}, as
    OpenAI defines it: `name` required; without `schema`, any JSON object)."""
    if not isinstance(spec, dict):
        raise InvalidRequestError(f"{param} must be an object with a 'name' and a 'schema'", param)
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{param}.name is required (a non-empty string)", f"{param}.name")
    if not isinstance(spec.get("schema", {}), dict):
        raise InvalidRequestError(f"{param}.schema must be a JSON schema object", f"{param}.schema")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise InvalidRequestError(f"{param}.strict must be a boolean", f"{param}.strict")
    schema = spec.get("schema") or {"type": "object"}
    if spec.get("strict"):
        problem = strict_schema_problem(schema)
        if problem is not None:
            raise InvalidRequestError(f"Invalid schema for response_format {name!r}: {problem}", f"{param}.schema")
    return schema


def strict_schema_problem(schema: Any) -> str | None:
    """What breaks OpenAI's rules for a strict schema, naming where, or None: every object
    sets `additionalProperties` to false and lists every property in `required`, and the
    root is an object."""
    if not isinstance(schema, dict) or schema.get("type") != "object":
        return "In context=(), schema must be a JSON Schema of 'type: \"object\"'."
    for path, node in _subschemas(schema, ()):
        if node.get("type") != "object" and "properties" not in node:
            continue
        if node.get("additionalProperties") is not False:
            return f"In context={path!r}, 'additionalProperties' is required to be supplied and to be false."
        properties = node.get("properties") or {}
        required = node.get("required")
        missing = [key for key in properties if not isinstance(required, list) or key not in required]
        if missing:
            return (f"In context={path!r}, 'required' is required to be supplied and to be an array including "
                    f"every key in properties. Missing {missing[0]!r}.")
    return None


def _subschemas(node: dict, path: tuple) -> Any:
    """(path, schema) of `node` and every schema nested in it (properties, items, unions, definitions)."""
    yield path, node
    for key in ("properties", "$defs", "definitions"):
        children = node.get(key)
        if isinstance(children, dict):
            for name, child in children.items():
                if isinstance(child, dict):
                    yield from _subschemas(child, path + (key, name))
    for key in ("anyOf", "allOf", "oneOf", "prefixItems"):
        children = node.get(key)
        if isinstance(children, list):
            for index, child in enumerate(children):
                if isinstance(child, dict):
                    yield from _subschemas(child, path + (key, index))
    if isinstance(node.get("items"), dict):
        yield from _subschemas(node["items"], path + ("items",))


def _build(fields: Any, field_name: str) -> StructuredOutputsParams:
    if not isinstance(fields, dict):
        raise InvalidRequestError(f"{field_name} must be an object", field_name)
    known = {"json", "regex", "choice", "grammar", "json_object"}
    try:
        return StructuredOutputsParams(**{k: v for k, v in fields.items() if k in known})
    except (SamplingParamsError, TypeError) as exc:
        raise InvalidRequestError(f"{field_name}: {exc}", field_name) from None


async def compile_constraint(validator: RequestValidator, source: ConstraintSource) -> None:
    """Compile through the engine's validator (on the grammar pool, without blocking the event
    loop or the engine loop); a failure or a compile past the timeout raises InvalidRequestError
    naming the field."""
    try:
        await validator.check_constraint_async(source.params)
    except StructuredOutputError as exc:
        raise InvalidRequestError(f"{source.field_name}: {exc}", source.field_name) from None


async def checked_constraint(ctx: "ServingContext", body: "CompletionRequest | ChatCompletionRequest",
                             tool_grammar: str | None = None
                             ) -> StructuredOutputsParams | None:
    """The request's constraint (or the grammar forcing its tool calls), compiled so that it
    is known good, or None."""
    return await checked_source(ctx, constraint_from_request(body), tool_grammar)


async def checked_source(ctx: "ServingContext", source: ConstraintSource | None, tool_grammar: str | None = None
                         ) -> StructuredOutputsParams | None:
    """`source` (or the grammar forcing tool calls, which excludes it), compiled so that it is
    known good, or None."""
    if tool_grammar is not None:
        if source is not None:
            raise InvalidRequestError(f"tool_choice 'required' or a named function cannot be combined with "
                                      f"{source.field_name}", source.field_name)
        source = ConstraintSource(StructuredOutputsParams(grammar=tool_grammar), "tool_choice")
    if source is None:
        return None
    await compile_constraint(ctx.engine.validator, source)
    return source.params
