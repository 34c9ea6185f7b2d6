"""OutputProcessor driven by hand-made engine-core outputs (no model).

A scripted "engine" emits, for every live engine request, the next token of a
text chosen in advance; the oracle for the text is the tokenizer's decode.
"""
from __future__ import annotations

import pytest

from kvserve.engine.output_processor import OutputProcessor, child_request_id
from kvserve.sampling_params import SamplingParams
from kvserve.messages import EngineCoreOutput, TokenLogprobs


class ScriptedEngine:
    """Emits one planned token per live request per step; finishes at the plan's end."""

    def __init__(self, plans: dict[str, list[int]], eos_token_id: int | None = None) -> None:
        self.plans = plans
        self.positions = {request_id: 0 for request_id in plans}
        self.eos_token_id = eos_token_id
        self.aborted: list[str] = []

    def step(self) -> list[EngineCoreOutput]:
        outputs = []
        for request_id, plan in self.plans.items():
            position = self.positions[request_id]
            if request_id in self.aborted or position >= len(plan):
                continue
            token = plan[position]
            self.positions[request_id] = position + 1
            finish, stop_reason = None, None
            if token == self.eos_token_id:
                finish = "stop"
            elif position + 1 == len(plan):
                finish = "length"
            outputs.append(EngineCoreOutput(request_id, [token], finish, stop_reason, num_cached_tokens=3))
        return outputs

    def run(self, processor: OutputProcessor, max_steps: int = 1000):
        """All RequestOutputs, step by step, aborting what the processor asks to abort."""
        seen = []
        for _ in range(max_steps):
            if not processor.has_unfinished_requests():
                return seen
            processed = processor.process_outputs(self.step())
            self.aborted.extend(processed.request_ids_to_abort)
            seen.extend(processed.request_outputs)
        raise AssertionError("requests did not finish")


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_streaming_deltas_add_up(smollm_tokenizer):
    tok = smollm_tokenizer
    processor = OutputProcessor(tok)
    prompt_ids = encode(tok, "Tell me:")
    answer = " The café serves 你好 and 😀 all day."
    core_requests = processor.add_request("r1", "Tell me:", prompt_ids, SamplingParams(max_tokens=50))
    assert [r.request_id for r in core_requests] == ["r1"]
    assert core_requests[0].prompt_token_ids == prompt_ids
    engine = ScriptedEngine({"r1": encode(tok, answer)})
    outputs = engine.run(processor)

    streamed_text = "".join(o.outputs[0].new_text for o in outputs)
    streamed_ids = [t for o in outputs for t in o.outputs[0].new_token_ids]
    final = outputs[-1]
    expected_text = tok.decode(prompt_ids + encode(tok, answer))[len(tok.decode(prompt_ids)):]
    assert final.finished and not any(o.finished for o in outputs[:-1])
    assert streamed_text == final.outputs[0].text == expected_text
    assert streamed_ids == final.outputs[0].token_ids == encode(tok, answer)
    assert final.outputs[0].finish_reason == "length"
    assert final.prompt == "Tell me:" and final.prompt_token_ids == prompt_ids
    assert final.num_cached_tokens == 3
    assert 0 <= final.metrics.ttft_s <= final.metrics.total_s
    assert not processor.has_unfinished_requests()


def test_final_only_emits_once(smollm_tokenizer):
    processor = OutputProcessor(smollm_tokenizer)
    prompt_ids = encode(smollm_tokenizer, "Count:")
    plan = encode(smollm_tokenizer, " one two three four")
    processor.add_request("r", None, prompt_ids, SamplingParams(), final_only=True)
    outputs = ScriptedEngine({"r": plan}).run(processor)
    assert len(outputs) == 1 and outputs[0].finished
    assert outputs[0].outputs[0].text == " one two three four"
    assert outputs[0].outputs[0].token_ids == plan


def test_stop_string_finishes_and_requests_abort(smollm_tokenizer):
    tok = smollm_tokenizer
    processor = OutputProcessor(tok)
    params = SamplingParams(stop=["STOP"], max_tokens=100)
    processor.add_request("r", None, encode(tok, "Go"), params)
    engine = ScriptedEngine({"r": encode(tok, " first part STOP second part")})
    outputs = engine.run(processor)
    assert engine.aborted == ["r"]
    final = outputs[-1].outputs[0]
    assert (final.finish_reason, final.stop_reason) == ("stop", "STOP")
    assert final.text == " first part "
    assert "".join(o.outputs[0].new_text for o in outputs) == " first part "
    # The engine's later outputs for the aborted id are ignored.
    assert processor.process_outputs([EngineCoreOutput("r", [5])]).request_outputs == []


def test_eos_finish_keeps_token_but_not_its_text(smollm_tokenizer):
    tok = smollm_tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    processor = OutputProcessor(tok)
    processor.add_request("r", None, encode(tok, "Q"), SamplingParams(skip_special_tokens=False))
    plan = encode(tok, " Answer.") + [eos]
    outputs = ScriptedEngine({"r": plan}, eos_token_id=eos).run(processor)
    final = outputs[-1].outputs[0]
    assert final.token_ids == plan
    assert final.text == " Answer."
    assert (final.finish_reason, final.stop_reason) == ("stop", None)


def test_n_children_fan_out_and_gather(smollm_tokenizer):
    tok = smollm_tokenizer
    processor = OutputProcessor(tok)
    prompt_ids = encode(tok, "Pick a word:")
    core_requests = processor.add_request("p", "Pick a word:", prompt_ids, SamplingParams(n=3, seed=7))
    ids = [r.request_id for r in core_requests]
    assert ids == [child_request_id(i, "p") for i in range(3)] == ["0_p", "1_p", "2_p"]
    assert all(r.prompt_token_ids == prompt_ids and r.sampling_params.n == 1 for r in core_requests)
    assert [r.sampling_params.seed for r in core_requests] == [7, 8, 9]
    answers = [" red", " green and blue", " a much longer answer than the others"]
    outputs = ScriptedEngine({i: encode(tok, a) for i, a in zip(ids, answers)}).run(processor)
    assert all(o.request_id == "p" for o in outputs)
    assert [o.finished for o in outputs].count(True) == 1 and outputs[-1].finished
    final = outputs[-1]
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert [c.text for c in final.outputs] == answers
    for index, answer in enumerate(answers):
        streamed = "".join(o.outputs[index].new_text for o in outputs)
        assert streamed == answer


def test_unseeded_children_stay_unseeded(smollm_tokenizer):
    processor = OutputProcessor(smollm_tokenizer)
    core_requests = processor.add_request("p", None, [5, 6], SamplingParams(n=2))
    assert [r.sampling_params.seed for r in core_requests] == [None, None]


def test_logprobs_are_decoded(smollm_tokenizer):
    tok = smollm_tokenizer
    processor = OutputProcessor(tok)
    processor.add_request("r", None, [5, 6], SamplingParams(logprobs=2, max_tokens=2))
    tokens = encode(tok, " hello world")[:2]
    outputs = []
    for step, token in enumerate(tokens):
        top_ids = [token, token + 1]
        entry = TokenLogprobs(token, -0.5 * (step + 1), 1, top_ids, [-0.5 * (step + 1), -2.0])
        finish = "length" if step == len(tokens) - 1 else None
        outputs += processor.process_outputs([EngineCoreOutput("r", [token], finish, new_logprobs=[entry])]
                                             ).request_outputs
    final = outputs[-1].outputs[0]
    assert len(final.logprobs) == 2
    assert final.cumulative_logprob == pytest.approx(-0.5 - 1.0)
    for position, token in zip(final.logprobs, tokens):
        assert set(position) == {token, token + 1}
        assert position[token].rank == 1
        assert position[token].decoded_token == tok.decode([token])
        assert position[token + 1].logprob == -2.0


def test_abort_returns_running_engine_ids(smollm_tokenizer):
    processor = OutputProcessor(smollm_tokenizer)
    processor.add_request("p", None, [5, 6], SamplingParams(n=2))
    processor.process_outputs([EngineCoreOutput("0_p", [7], "length")])
    assert processor.abort_request("p") == ["1_p"]
    assert processor.abort_request("p") == []
    assert not processor.has_unfinished_requests()


def test_duplicate_request_id_rejected(smollm_tokenizer):
    processor = OutputProcessor(smollm_tokenizer)
    processor.add_request("r", None, [5], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        processor.add_request("r", None, [5], SamplingParams())
