"""JSON schemas compiled to bounded grammars (kvserve/sample/structured/json_grammar.py), checked
by feeding texts to a matcher on the default model's vocabulary; accepted texts are checked
with json and jsonschema."""
from __future__ import annotations

import json

import jsonschema
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from kvserve.engine.model_path import default_model_path
from kvserve.errors import InvalidRequestError
from kvserve.model.tokenizer_files import load_tokenizer
from kvserve.sample.structured.grammar import GrammarCompiler
from kvserve.sample.structured.json_grammar import json_schema_lark
from kvserve.sampling_params import StructuredOutputsParams as Constraint
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.structured import constraint_from_request

EOS = 2


class City(BaseModel):
    name: str
    is_capital: bool
    population_millions: float


class Address(BaseModel):
    street: str
    zip_code: int | None = None


class Person(BaseModel):
    name: str
    age: int = Field(ge=0)
    tags: list[str]
    address: Address


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, 49152, [EOS])


@pytest.fixture(scope="module")
def accepts(compiler, tokenizer):
    def check(schema: dict, text: str) -> bool:
        """Whether `text` (the tokenizer's own tokens) is a complete output of the schema's grammar."""
        matcher = compiler.new_matcher(Constraint(json=schema))
        accepted = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()
        if accepted:
            jsonschema.validate(json.loads(text), schema)
        return bool(accepted)
    return check


def test_properties_come_in_the_schema_order_with_compact_separators(accepts):
    schema = to_strict_json_schema(City)
    assert accepts(schema, '{"name": "Paris", "is_capital": true, "population_millions": 2.1}')
    assert not accepts(schema, '{"is_capital": true, "name": "Paris", "population_millions": 2.1}')
    for spaced in ('{"name":"Paris", "is_capital": true, "population_millions": 2.1}',
                   '{ "name": "Paris", "is_capital": true, "population_millions": 2.1}',
                   '{"name": "Paris",\n  "is_capital": true, "population_millions": 2.1}',
                   '{"name": "Paris", "is_capital": true, "population_millions": 2.1 }'):
        assert not accepts(schema, spaced), spaced
    assert not accepts(schema, '{"name": "Paris", "is_capital": true, "population_millions": 2.1, "x": 1}')


def test_integers_stay_within_int64_and_numbers_within_float64(accepts):
    integer = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert accepts(integer, '{"n": -8999999999999999999}')
    assert accepts(integer, '{"n": 0}')
    assert not accepts(integer, '{"n": 9000000000000000000}')  # 19 digits from 9: could pass 2^63 - 1
    assert not accepts(integer, '{"n": ' + "1" * 20 + "}")
    assert not accepts(integer, '{"n": 007}')
    number = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    # At most 17 digits in all (what float64 round-trips), or one digit and an exponent <= 307.
    for text in ("0", "-2.5", "1" * 17, "0." + "1" * 17, "1234567890.1234567", "9.9e307", "-1.5E-307", "3e0"):
        assert accepts(number, '{"x": ' + text + "}"), text
        assert abs(float(text)) < float("inf")
    for text in ("1" * 18, "0." + "1" * 18, "1234567890.12345678", "1e308", "12e5", "1.", ".5", "NaN", "Infinity"):
        assert not accepts(number, '{"x": ' + text + "}"), text
    # A bound the schema gives is kept; the missing one is added.
    at_least_one = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}, "required": ["n"]}
    assert accepts(at_least_one, '{"n": 12}') and not accepts(at_least_one, '{"n": 0}')
    assert not accepts(at_least_one, '{"n": ' + "1" * 20 + "}")


def test_optional_properties_nested_objects_unions_and_refs(accepts):
    schema = to_strict_json_schema(Person)
    assert accepts(schema, '{"name": "A", "age": 5, "tags": ["x", "y"], "address": {"street": "S", "zip_code": null}}')
    assert accepts(schema, '{"name": "A", "age": 5, "tags": [], "address": {"street": "S", "zip_code": 75001}}')
    assert not accepts(schema, '{"name": "A", "age": -5, "tags": [], "address": {"street": "S", "zip_code": 1}}')
    optional = {"type": "object", "required": ["b"], "properties": {
        "a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}}}
    for text, expected in (('{"b": "x"}', True), ('{"a": 1, "b": "x"}', True), ('{"b": "x", "c": true}', True),
                           ('{"a": 1, "b": "x", "c": false}', True), ('{"a": 1}', False), ("{}", False),
                           ('{"c": true, "b": "x"}', False)):
        assert accepts(optional, text) == expected, text
    linked = {"$defs": {"Node": {"type": "object", "additionalProperties": False, "required": ["v", "next"],
                                 "properties": {"v": {"type": "integer"},
                                                "next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}}}},
              "$ref": "#/$defs/Node"}
    assert accepts(linked, '{"v": 1, "next": {"v": 2, "next": null}}')
    assert accepts({"type": ["number", "null"]}, "null") and accepts({"type": ["number", "null"]}, "-0.5")
    assert accepts({"type": "array", "items": {"type": "number"}}, "[1, 2.5, -3e10]")


def test_extra_keys_only_where_the_schema_allows_them(accepts):
    assert accepts({"type": "object"}, '{"q": [1, 2.5]}')
    allowed = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}
    assert accepts(allowed, '{"a": 1, "z": 2}')
    unset = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert not accepts(unset, '{"a": 1, "z": 2}')
    assert json_schema_lark(True) is None  # not an object: llguidance's own compiler takes it


def _strict_request(schema: dict) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "City", "schema": schema, "strict": True}}})


def test_strict_schemas_follow_openai_rules():
    assert constraint_from_request(_strict_request(to_strict_json_schema(City))) is not None
    plain = City.model_json_schema()  # no additionalProperties
    with pytest.raises(InvalidRequestError, match=r"context=\(\), 'additionalProperties' is required") as info:
        constraint_from_request(_strict_request(plain))
    assert info.value.param == "response_format.json_schema.schema"
    not_required = {**to_strict_json_schema(City), "required": ["name"]}
    with pytest.raises(InvalidRequestError, match="Missing 'is_capital'"):
        constraint_from_request(_strict_request(not_required))
    nested = to_strict_json_schema(Person)
    del nested["$defs"]["Address"]["additionalProperties"]
    with pytest.raises(InvalidRequestError, match=r"context=\('\$defs', 'Address'\)"):
        constraint_from_request(_strict_request(nested))
    with pytest.raises(InvalidRequestError, match="'type: \"object\"'"):
        constraint_from_request(_strict_request({"type": "integer"}))
    # Without strict the same schemas are accepted.
    loose = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "City", "schema": plain}}})
    assert constraint_from_request(loose) is not None
