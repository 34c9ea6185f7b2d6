"""Reasoning in the Responses and Messages APIs (#28), through the official openai and anthropic
clients, for a harmony model (gpt-oss's analysis channel) and a think-block model (Qwen3's
`<think>...</think>`).

Every reply is certain: the model-free engine (fake_engine.py: the real EngineCore, AsyncLLM,
detokenizer and HTTP stack) writes one fixed script for every request, in the real tokenizer's
tokens. Oracles: the script's parts, the prompt rendered here (usage.input_tokens), and the
clients' own types and stream accumulators.
"""
from __future__ import annotations

import anthropic
import openai
import pytest
from helpers.harmony_model import harmony_tokenizer
from openai.types.responses import ResponseReasoningItem, ResponseReasoningTextDeltaEvent

from kvserve.server.app import build_app
from kvserve.server.harmony import render_harmony
from kvserve.server.protocol import ChatMessage

from .conftest import ThreadedServer
from .fake_engine import make_fake_async_llm

MODEL = "reasoner"
REASONING = "The user asks about Paris. Say it is sunny."
ANSWER = "It is sunny."
HARMONY_SCRIPT = (f"<|channel|>analysis<|message|>{REASONING}<|end|>"
                  f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>")
THINK_SCRIPT = f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"
# Qwen3's template in miniature: an assistant turn's reasoning rendered in its think block, and
# `enable_thinking=False` writing an empty block into the generation prompt.
THINK_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n"
    "{%- endif %}{{ m.content or '' }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}")
USER = [{"role": "user", "content": "Weather in Paris?"}]
THINKING = {"type": "enabled", "budget_tokens": 1024}


def think_tokenizer():
    """A byte-level tokenizer with `<think>` / `</think>` as tokens of their own (not special, as
    in Qwen3's), ChatML markers, and `THINK_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.add_tokens(["<think>", "</think>"])
    fast.chat_template = THINK_TEMPLATE
    return fast


def _serve(tokenizer, script: str):
    engine = make_fake_async_llm(tokenizer, script=script, max_model_len=4096, step_delay_s=0.001)
    return ThreadedServer(build_app(engine, MODEL))


@pytest.fixture(scope="module", params=["harmony", "think"])
def server(request):
    tokenizer = harmony_tokenizer() if request.param == "harmony" else think_tokenizer()
    with _serve(tokenizer, HARMONY_SCRIPT if request.param == "harmony" else THINK_SCRIPT) as running:
        running.kind, running.tokenizer = request.param, tokenizer
        yield running


@pytest.fixture(scope="module")
def openai_client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def anthropic_client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


def _prompt_len(server, messages: list[dict], effort: str | None = None, enable_thinking: bool | None = None) -> int:
    """The prompt's token count as the model's format renders `messages` here."""
    tokenizer = server.tokenizer
    if server.kind == "harmony":
        text = render_harmony([ChatMessage(**m) for m in messages], None, effort, True)
    else:
        switches = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **switches)
    return len(tokenizer.encode(text, add_special_tokens=False))


# ---- Responses ----------------------------------------------------------------------------------

def test_responses_reasoning_item_then_message(server, openai_client):
    response = openai_client.responses.create(model=MODEL, input="Weather in Paris?", reasoning={"effort": "high"})
    reasoning, message = response.output
    assert isinstance(reasoning, ResponseReasoningItem) and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", REASONING)]
    assert reasoning.status == "completed" and reasoning.id.startswith("rs_")
    assert message.type == "message" and response.output_text == ANSWER
    assert response.status == "completed" and response.reasoning.effort == "high"
    usage = response.usage
    assert usage.output_tokens_details.reasoning_tokens == len(server.tokenizer.encode(REASONING, add_special_tokens=False))
    assert usage.output_tokens == len(server.tokenizer.encode(
        HARMONY_SCRIPT if server.kind == "harmony" else THINK_SCRIPT, add_special_tokens=False)) + (server.kind == "think")
    # harmony's system message says the effort asked for
    assert usage.input_tokens == _prompt_len(server, USER, effort="high" if server.kind == "harmony" else None)


def test_responses_stream_sends_reasoning_text_events(server, openai_client):
    events = list(openai_client.responses.create(model=MODEL, input="Weather in Paris?", stream=True))
    types = [event.type for event in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if isinstance(e, ResponseReasoningTextDeltaEvent)]
    assert "".join(d.delta for d in deltas) == REASONING and {d.output_index for d in deltas} == {0}
    first = types.index("response.reasoning_text.delta")
    assert types[first - 2:first] == ["response.output_item.added", "response.content_part.added"]
    assert events[first - 1].part.type == "reasoning_text"
    done = [e for e in events if e.type == "response.reasoning_text.done"]
    assert [d.text for d in done] == [REASONING] and types.index("response.reasoning_text.done") < \
        types.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == REASONING and final.output_text == ANSWER
    assert final.usage.output_tokens_details.reasoning_tokens > 0


def test_responses_keep_reasoning_for_the_next_turn(server, openai_client):
    """The reasoning goes back to the model with `previous_response_id` and as an input item;
    the think template renders it in the assistant turn, so the prompt's length shows it did."""
    first = openai_client.responses.create(model=MODEL, input="Weather in Paris?")
    follow = [{"role": "user", "content": "And tomorrow?"}]
    chained = openai_client.responses.create(model=MODEL, input=follow, previous_response_id=first.id)
    items = [*USER, first.output[0].model_dump(exclude_none=True), {"role": "assistant", "content": ANSWER}, *follow]
    given_back = openai_client.responses.create(model=MODEL, input=items)
    assistant = {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING}
    expected = _prompt_len(server, [*USER, assistant, *follow])
    assert chained.usage.input_tokens == given_back.usage.input_tokens == expected
    if server.kind == "think":  # harmony drops the reasoning of turns before the last user message
        assert expected > _prompt_len(server, [*USER, {"role": "assistant", "content": ANSWER}, *follow])


def test_responses_refuse_an_unknown_effort(server, openai_client):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.responses.create(model=MODEL, input="hi", reasoning={"effort": "extreme"})
    error = caught.value.body
    assert error["param"] == "reasoning.effort" and error["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.responses.create(model=MODEL, input=[{"type": "reasoning", "id": "rs_1", "summary": [],
                                                            "content": [{"type": "reasoning_text"}]}])
    assert caught.value.body["param"] == "input[0].content"


# ---- Messages -----------------------------------------------------------------------------------

def _read(usage) -> int:
    """The prompt's tokens of a Messages usage (Anthropic counts those read from the cache apart)."""
    return usage.input_tokens + usage.cache_read_input_tokens


def test_messages_show_thinking_only_when_enabled(server, anthropic_client):
    shown = anthropic_client.messages.create(model=MODEL, max_tokens=2048, messages=USER, thinking=THINKING)
    thinking, text = shown.content
    assert thinking.type == "thinking" and thinking.thinking == REASONING and thinking.signature
    assert text.type == "text" and text.text == ANSWER and shown.stop_reason == "end_turn"
    hidden = anthropic_client.messages.create(model=MODEL, max_tokens=2048, messages=USER)
    assert [(b.type, b.text) for b in hidden.content] == [("text", ANSWER)]
    disabled = anthropic_client.messages.create(model=MODEL, max_tokens=2048, messages=USER,
                                                thinking={"type": "disabled"})
    assert [b.type for b in disabled.content] == ["text"]
    # Without thinking a think-block model is asked not to think (the template's enable_thinking).
    assert _read(hidden.usage) == _prompt_len(server, USER, enable_thinking=False if server.kind == "think" else None)
    assert _read(shown.usage) == _prompt_len(server, USER, enable_thinking=True if server.kind == "think" else None)
    omitted = anthropic_client.messages.create(model=MODEL, max_tokens=2048, messages=USER,
                                               thinking={**THINKING, "display": "omitted"})
    assert omitted.content[0].type == "thinking" and omitted.content[0].thinking == ""
    assert omitted.content[0].signature and omitted.content[1].text == ANSWER


def test_messages_stream_thinking_then_signature(server, anthropic_client):
    whole = anthropic_client.messages.create(model=MODEL, max_tokens=2048, messages=USER, thinking=THINKING)
    with anthropic_client.messages.stream(model=MODEL, max_tokens=2048, messages=USER, thinking=THINKING) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    deltas = [e.delta for e in events if e.type == "content_block_delta" and e.index == 0]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == REASONING
    assert deltas[-1].type == "signature_delta" and deltas[-1].signature == whole.content[0].signature
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]
    with anthropic_client.messages.stream(model=MODEL, max_tokens=2048, messages=USER) as stream:
        assert [b.type for b in stream.get_final_message().content] == ["text"]


def test_messages_take_their_thinking_back_and_check_its_signature(server, anthropic_client):
    first = anthropic_client.messages.create(model=MODEL, max_tokens=2048, messages=USER, thinking=THINKING)
    follow = {"role": "user", "content": "And tomorrow?"}
    turns = [*USER, {"role": "assistant", "content": [b.model_dump() for b in first.content]}, follow]
    again = anthropic_client.messages.create(model=MODEL, max_tokens=2048, messages=turns, thinking=THINKING)
    assistant = {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING}
    assert _read(again.usage) == _prompt_len(server, [*USER, assistant, {**follow}], enable_thinking=True
                                                   if server.kind == "think" else None)
    forged = [b.model_dump() for b in first.content]
    forged[0]["thinking"] = "Something else."
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client.messages.create(model=MODEL, max_tokens=2048, thinking=THINKING,
                                         messages=[*USER, {"role": "assistant", "content": forged}, follow])
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
    assert "signature" in caught.value.body["error"]["message"]


@pytest.mark.parametrize(("thinking", "extra", "says"), [
    ({"type": "enabled", "budget_tokens": 100}, {}, "budget_tokens"),
    ({"type": "enabled", "budget_tokens": 4096}, {}, "max_tokens"),
    ({"type": "enabled"}, {}, "budget_tokens"),
    ({"type": "sometimes"}, {}, "thinking.type"),
    ({"type": "adaptive", "display": "full"}, {}, "thinking.display"),
    (THINKING, {"tool_choice": {"type": "any"}, "tools": [{"name": "f", "input_schema": {"type": "object"}}]},
     "tool_choice forces tool use"),
])
def test_messages_refuse_bad_thinking_in_anthropics_shape(server, anthropic_client, thinking, extra, says):
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client.messages.create(model=MODEL, max_tokens=2048, messages=USER, thinking=thinking, **extra)
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert says in body["error"]["message"]


# ---- Chat Completions (the same reading) --------------------------------------------------------

def test_chat_completions_give_the_reasoning_apart(server, openai_client):
    reply = openai_client.chat.completions.create(model=MODEL, messages=USER)
    message = reply.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content") == REASONING and message.content == ANSWER
    reasoning, content = "", ""
    for chunk in openai_client.chat.completions.create(model=MODEL, messages=USER, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        reasoning += ((delta.model_extra or {}).get("reasoning_content") or "") if delta else ""
        content += (delta.content or "") if delta else ""
    assert (reasoning, content) == (REASONING, ANSWER)
