"""Constrained decoding at TP=2: rank 0 owns the grammar matchers and samples under the
mask; the output is the TP=1 engine's (the oracle) and valid for its constraint."""
from __future__ import annotations

import json

import jsonschema

from tp_helpers import save_tiny_chat_model
from kvserve import LLM, SamplingParams
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.server.tools import ToolRequest, extract_tool_calls

# Bounded schemas: a random tiny model must still finish within max_tokens.
PICK = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                         "size": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "ok": {"type": "boolean"}},
        "required": ["colour", "size", "ok"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["unit", "days"], "additionalProperties": False}}}
PROMPTS = [[{"role": "user", "content": "Pick a colour."}], [{"role": "user", "content": "Weather?"}]]


def _generate(model: str, tensor_parallel_size: int) -> list:
    tool_grammar = ToolRequest([WEATHER], "named", "get_weather", False, "hermes").forcing_grammar()
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=PICK)),
              SamplingParams(temperature=0.9, seed=5, max_tokens=60,
                             structured_outputs=StructuredOutputsParams(grammar=tool_grammar))]
    with LLM(model=model, kv_cache_memory="4MiB", device="cpu", async_scheduling=True,
             tensor_parallel_size=tensor_parallel_size) as llm:
        return [output.outputs[0] for output in llm.chat(PROMPTS, params, use_tqdm=False)]


def _assert_tokens_fit(model: str, constraint: StructuredOutputsParams, token_ids: list[int]) -> None:
    """Every token, the final EOS included, is one the constraint allowed where it was sampled,
    replayed on a fresh matcher: a failure here is a mask the engine did not apply, one after
    it is the text (detokenization)."""
    from kvserve.model.tokenizer_files import load_tokenizer
    from kvserve.sample.structured.grammar import GrammarCompiler

    tokenizer = load_tokenizer(model)
    matcher = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).new_matcher(constraint)
    for position, token_id in enumerate(token_ids):
        assert matcher.consume_token(token_id), (position, token_ids, matcher.get_error())
    assert token_ids[-1] == tokenizer.eos_token_id and matcher.is_stopped(), token_ids


def test_constrained_outputs_at_tp2_equal_tp1_and_are_valid(tmp_path):
    model = save_tiny_chat_model(tmp_path / "chat_model")
    expected = _generate(model, 1)
    got = _generate(model, 2)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    pick, call = got
    assert pick.finish_reason == "stop", pick
    _assert_tokens_fit(model, StructuredOutputsParams(json=PICK), pick.token_ids)
    jsonschema.validate(json.loads(pick.text), PICK)
    assert call.finish_reason == "stop", call
    content, calls = extract_tool_calls("hermes", call.text)
    assert [c.name for c in calls] == ["get_weather"] and not content
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
