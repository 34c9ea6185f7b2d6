"""Constrained decoding at TP=2: rank 0 owns the grammar matchers and samples under the
mask; the greedy output is greedy under the mask by transformers' logits (as TP=1's is), the
seeded one is the draw its seed gives from transformers' masked distribution (as TP=1's is),
and both are valid for their constraint."""
from __future__ import annotations

import functools
import json

import jsonschema
import torch
import transformers
from helpers.greedy_check import GREEDY_SLACK, assert_seeded_samples

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


def _tool_grammar() -> str:
    return ToolRequest([WEATHER], "named", "get_weather", False, "hermes").forcing_grammar()


def _generate(model: str, tensor_parallel_size: int) -> list:
    tool_grammar = _tool_grammar()
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=PICK)),
              SamplingParams(temperature=0.9, seed=5, max_tokens=60,
                             structured_outputs=StructuredOutputsParams(grammar=tool_grammar))]
    with LLM(model=model, kv_cache_memory="4MiB", device="cpu", async_scheduling=True,
             tensor_parallel_size=tensor_parallel_size) as llm:
        outputs = llm.chat(PROMPTS, params, use_tqdm=False)
    return [output.prompt_token_ids for output in outputs], [output.outputs[0] for output in outputs]


@functools.cache
def _compiler(model: str):
    from kvserve.model.tokenizer_files import load_tokenizer
    from kvserve.sample.structured.grammar import GrammarCompiler

    tokenizer = load_tokenizer(model)
    return tokenizer, GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def _masks_along(model: str, constraint: StructuredOutputsParams, token_ids: list[int]) -> list[torch.Tensor]:
    """The allowed tokens (bool [vocab]) where each of `token_ids` was sampled, replayed on a fresh
    matcher: every token, the final EOS included, must be one its mask allowed (a failure here is
    a mask the engine did not apply, one after it is the text)."""
    from kvserve.sample.structured.grammar_mask import disallowed_tokens

    tokenizer, compiler = _compiler(model)
    matcher = compiler.new_matcher(constraint)
    allowed = []
    for position, token_id in enumerate(token_ids):
        allowed.append(~disallowed_tokens(compiler.fill_bitmasks([matcher]), len(tokenizer))[0])
        assert allowed[-1][token_id], (position, token_ids)
        assert matcher.consume_token(token_id), (position, token_ids, matcher.get_error())
    assert token_ids[-1] == tokenizer.eos_token_id and matcher.is_stopped(), token_ids
    return allowed


@functools.cache
def _reference(model: str):
    return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def _assert_masked_greedy(model: str, constraint: StructuredOutputsParams, prompt_ids: list[int],
                          token_ids: list[int]) -> None:
    """Every token is allowed where it was sampled (`_masks_along`) and has the largest allowed
    logit under transformers (float32) fed the prompt and tokens, up to `GREEDY_SLACK` of the
    logits' scale: TP=2 adds the ranks' partial o_proj/down_proj sums in another float order
    than TP=1, so a near-tie may break either way."""
    allowed = _masks_along(model, constraint, token_ids)
    with torch.inference_mode():
        logits = _reference(model)(torch.tensor([list(prompt_ids) + list(token_ids)])).logits[0].float()
    logits = logits[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(token_ids)]
    scale = logits.abs().max().clamp(min=1.0)
    for position, (token_id, mask) in enumerate(zip(token_ids, allowed)):
        row = logits[position].masked_fill(~mask, float("-inf"))
        assert (row.max() - row[token_id]) / scale <= GREEDY_SLACK, (position, token_ids)


def test_constrained_outputs_at_tp2_are_greedy_and_valid(tmp_path):
    model = save_tiny_chat_model(tmp_path / "chat_model")
    _, expected = _generate(model, 1)
    prompt_ids, got = _generate(model, 2)
    tool_grammar = StructuredOutputsParams(grammar=_tool_grammar())
    for (pick, call), prompts in ((got, prompt_ids), (expected, prompt_ids)):
        assert pick.finish_reason == "stop", pick
        _assert_masked_greedy(model, StructuredOutputsParams(json=PICK), prompts[0], pick.token_ids)
        jsonschema.validate(json.loads(pick.text), PICK)
        # The seeded sample: the draws its seed gives from transformers' masked distribution.
        assert call.finish_reason == "stop", call
        assert_seeded_samples(_reference(model), list(prompts[1]), list(call.token_ids), seed=5, temperature=0.9,
                              allowed=_masks_along(model, tool_grammar, call.token_ids))
        content, calls = extract_tool_calls("hermes", call.text)
        assert [c.name for c in calls] == ["get_weather"] and not content
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
