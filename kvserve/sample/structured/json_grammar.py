"""A JSON schema as a Lark grammar for llguidance, bounded so that a small model's
output terminates.

llguidance's own JSON compiler leaves numbers unbounded (a model can write digits until
max_tokens) and cannot take int64's limits as bounds (it reads them as float64). So the
objects, arrays, unions and references of the schema are translated here, and so are its
numbers; every other node (strings, enums, consts, booleans, anything this module does not
handle) is handed to llguidance as an embedded `%json` schema, with the same compact
separators. What the translation guarantees:

- properties come in the schema's order, separated by ", " and ": ", with no other
  whitespace anywhere outside strings;
- an object without `additionalProperties` takes no keys beyond its properties (as
  xgrammar's strict mode and vLLM do); one that allows them explicitly is handed to
  llguidance whole (its semantics, its unbounded extra keys);
- an integer without bounds has at most 19 digits, below 9e18 in magnitude (int64 holds
  +-9.22e18); one with a single bound gets the other at +-9e18;
- a number without bounds is a decimal of at most 17 digits in all (what a float64
  round-trips), or one digit, a fraction and an exponent up to 307: always a finite
  float64; one with a single bound gets the other at +-1e15 (llguidance's range regex).

`json_schema_lark(schema)` returns None where the schema is not an object this module can
walk (a boolean schema, a `$ref` outside the document); llguidance's JSON compiler then
takes the whole schema.
"""
from __future__ import annotations

import json
from typing import Any

SEPARATORS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
INTEGER_RX = r"/-?(0|[1-9][0-9]{0,17}|[1-8][0-9]{18})/"
# float64 round-trips 17 significant digits: a decimal has at most 17 digits in all (an
# integer part of k + 1 digits leaves 16 - k for the fraction), or one digit, up to 16
# fraction digits and an exponent up to 307 (below float64's largest, 1.8e308).
_DECIMALS = "|".join(["0|[1-9][0-9]{0,16}", "0\\.[0-9]{1,17}"]
                     + [f"[1-9][0-9]{{{k}}}\\.[0-9]{{1,{16 - k}}}" for k in range(16)])
NUMBER_RX = (f"/-?({_DECIMALS})/"
             " | /-?[0-9](\\.[0-9]{1,16})?[eE][+-]?(0|[1-9][0-9]?|[12][0-9][0-9]|30[0-7])/")
INTEGER_LIMIT = 9 * 10 ** 18
NUMBER_LIMIT = 1e15
# Keywords that only annotate a schema.
ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
               "writeOnly", "$schema", "$id", "$defs", "definitions", "x-guidance"}
OBJECT_KEYWORDS = {"type", "properties", "required", "additionalProperties"}
ARRAY_KEYWORDS = {"type", "items"}


class _Translator:
    """Builds one Lark rule per schema node (a `$ref` target once), from the root down."""

    def __init__(self, root: dict) -> None:
        self.root = root
        self.rules: list[str] = []
        self.ref_rules: dict[str, str] = {}

    def rule(self, schema: Any) -> str:
        """The name of a new rule matching `schema`."""
        name = f"n{len(self.rules)}"
        self.rules.append("")
        self.rules[int(name[1:])] = f"{name}: {self.body(schema)}"
        return name

    def body(self, schema: Any) -> str:
        if not isinstance(schema, dict):
            return self.embedded(schema)
        keys = set(schema) - ANNOTATIONS
        if keys == {"$ref"}:
            return self.ref(schema["$ref"])
        if keys == {"anyOf"} and isinstance(schema["anyOf"], list) and schema["anyOf"]:
            return " | ".join(self.rule(branch) for branch in schema["anyOf"])
        kind = schema.get("type")
        if isinstance(kind, list) and kind and all(isinstance(k, str) for k in kind) and len(set(kind)) == len(kind):
            return " | ".join(self.rule({**schema, "type": k}) for k in kind)
        if kind == "object" and keys <= OBJECT_KEYWORDS and isinstance(schema.get("properties"), dict) \
                and schema["properties"] and schema.get("additionalProperties", False) is False:
            return self.object(schema)
        if kind == "array" and keys <= ARRAY_KEYWORDS:
            return self.array(schema.get("items", {}))
        if kind == "integer" and keys == {"type"}:
            return INTEGER_RX
        if kind == "number" and keys == {"type"}:
            return NUMBER_RX
        if kind in ("integer", "number"):
            return self.embedded(_with_both_bounds(schema))
        return self.embedded(schema)

    def ref(self, ref: Any) -> str:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise _Untranslatable(f"$ref {ref!r}")
        name = self.ref_rules.get(ref)
        if name is None:
            name = self.ref_rules[ref] = f"n{len(self.rules)}"
            self.rules.append("")
            self.rules[int(name[1:])] = f"{name}: {self.body(_resolve(self.root, ref))}"
        return name

    def object(self, schema: dict) -> str:
        """Properties in order, the optional ones skippable, ", " between those present."""
        names = list(schema["properties"])
        required = set(schema.get("required") or [])
        if not required <= set(names):
            raise _Untranslatable("required names a property not in properties")
        pairs = [f"{_lark_string(json.dumps(name, ensure_ascii=False) + ': ')} {self.rule(schema['properties'][name])}"
                 for name in names]
        # first: the properties from here on when none was written yet; rest: when one was
        # (then each starts with ", "). Lark expressions, "" for nothing.
        first, rest = "", ""
        for name, pair in zip(reversed(names), reversed(pairs)):
            if name in required:
                rest_expr, first_expr = f"\", \" {pair} {rest}", f"{pair} {rest}"
            else:
                rest_expr = f"(\", \" {pair})? {rest}"
                first_expr = f"{pair} {rest} | {first}" if first else f"({pair} {rest})?"
            rest, first = self.named(rest_expr), self.named(first_expr)
        return f"\"{{\" {first} \"}}\""

    def named(self, expression: str) -> str:
        """A new rule for a Lark expression; its name."""
        name = f"n{len(self.rules)}"
        self.rules.append(f"{name}: {expression}")
        return name

    def array(self, items: Any) -> str:
        item = self.rule(items)
        return f"\"[\" \"]\" | \"[\" {item} (\", \" {item})* \"]\""

    def embedded(self, schema: Any) -> str:
        """`schema` compiled by llguidance itself (with the document's definitions, for its refs)."""
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        fragment = dict(schema)
        for defs in ("$defs", "definitions"):
            if defs in self.root and defs not in fragment and "$ref" in json.dumps(schema):
                fragment[defs] = self.root[defs]
        fragment["x-guidance"] = SEPARATORS
        return "%json " + json.dumps(fragment, ensure_ascii=False)


class _Untranslatable(Exception):
    pass


def json_schema_lark(schema: Any) -> str | None:
    """The Lark grammar of a JSON schema (see the module docstring), or None."""
    if not isinstance(schema, dict):
        return None
    translator = _Translator(schema)
    try:
        start = translator.rule(schema)
    except _Untranslatable:
        return None
    return "\n".join([f"start: {start}", *translator.rules]) + "\n"


def _with_both_bounds(schema: dict) -> dict:
    """A numeric schema with one bound given gets the other (llguidance's regex needs both)."""
    limit = INTEGER_LIMIT if schema.get("type") == "integer" else NUMBER_LIMIT
    bounded = dict(schema)
    if "minimum" not in schema and "exclusiveMinimum" not in schema:
        bounded["minimum"] = -limit
    if "maximum" not in schema and "exclusiveMaximum" not in schema:
        bounded["maximum"] = limit
    return bounded


def _resolve(root: dict, ref: str) -> Any:
    """The node a local JSON pointer (`#/$defs/Name`) names."""
    node: Any = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            raise _Untranslatable(f"$ref {ref!r} names nothing")
        node = node[part]
    return node


def _lark_string(text: str) -> str:
    """A Lark string literal of `text`."""
    return json.dumps(text, ensure_ascii=False)
