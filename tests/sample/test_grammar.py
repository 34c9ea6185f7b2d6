"""Grammar compilation and token masks (llguidance) on the default model's vocabulary."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

from kvserve.engine.model_path import default_model_path
from kvserve.sample.structured.grammar import GrammarCompiler, StructuredOutputError, grammar_source
from kvserve.sample.structured.grammar_mask import apply_bitmask
from kvserve.model.tokenizer_files import load_tokenizer
from kvserve.sampling_params import SamplingParams, SamplingParamsError
from kvserve.sampling_params import StructuredOutputsParams as Constraint

VOCAB_SIZE = 49152
EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB_SIZE, [EOS])


def allowed_ids(bitmask_row: torch.Tensor) -> set[int]:
    """Independent decoder of one bitmask row: bit i of word w allows token 32*w + i."""
    words = [int(w) & 0xFFFFFFFF for w in bitmask_row.tolist()]
    return {32 * w + i for w, word in enumerate(words) for i in range(32) if word >> i & 1}


def walk(compiler, constraint, text, tokenizer):
    """Feed `text` token by token, checking each token is allowed by the mask before it."""
    matcher = compiler.new_matcher(constraint)
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        assert token_id in allowed_ids(compiler.fill_bitmasks([matcher])[0])
        assert matcher.consume_token(token_id)
    return matcher


def test_choice_allows_only_the_prefixes_then_only_eos(compiler, tokenizer):
    constraint = Constraint(choice=["yes", "no"])
    matcher = compiler.new_matcher(constraint)
    first = allowed_ids(compiler.fill_bitmasks([matcher])[0])
    decoded = {tokenizer.decode([t]) for t in first}
    assert decoded and all("yes".startswith(d) or "no".startswith(d) for d in decoded), decoded
    matcher = walk(compiler, constraint, "yes", tokenizer)
    assert allowed_ids(compiler.fill_bitmasks([matcher])[0]) == {EOS}


def test_json_schema_walk_and_rejection(compiler, tokenizer):
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"],
              "additionalProperties": False}
    matcher = walk(compiler, Constraint(json=schema), '{"age": 42}', tokenizer)
    assert matcher.is_accepting()
    fresh = compiler.new_matcher(Constraint(json=schema))
    (letter,) = tokenizer.encode("x", add_special_tokens=False)
    assert letter not in allowed_ids(compiler.fill_bitmasks([fresh])[0])


def test_regex_digits_are_ascii(compiler, tokenizer):
    constraint = Constraint(regex=r"\d{2}")
    matcher = compiler.new_matcher(constraint)
    allowed_text = {tokenizer.decode([t]) for t in allowed_ids(compiler.fill_bitmasks([matcher])[0])}
    assert allowed_text and all(text.isascii() and text.isdigit() for text in allowed_text), allowed_text


def test_gbnf_and_lark_grammars(compiler, tokenizer):
    walk(compiler, Constraint(grammar='root ::= "a" [0-9] "b"'), "a7b", tokenizer)
    walk(compiler, Constraint(grammar='start: "x" NUMBER\n%import common.NUMBER'), "x12", tokenizer)


@pytest.mark.parametrize("constraint, param", [
    (Constraint(regex="[a-"), "regex"),
    (Constraint(json={"type": "foo"}), "json"),
    (Constraint(json="{not json"), "json"),
    (Constraint(grammar="root ::= undefined_rule"), "grammar"),
])
def test_bad_constraints_name_their_parameter(compiler, constraint, param):
    with pytest.raises(StructuredOutputError) as info:
        compiler.compile(constraint)
    assert info.value.kind == param and info.value.reason


def test_constraint_needs_exactly_one_kind():
    with pytest.raises(SamplingParamsError):
        Constraint(regex="a", choice=["b"])
    with pytest.raises(SamplingParamsError):
        Constraint()
    with pytest.raises(SamplingParamsError):
        Constraint(choice=[])


def test_compiled_once_per_source(compiler):
    schema = {"type": "object", "properties": {"q": {"type": "string"}}}
    first = compiler.compile(Constraint(json=schema))
    assert compiler.compile(Constraint(json=json.dumps(schema, sort_keys=True))) is first
    assert grammar_source(Constraint(json=schema)) == grammar_source(Constraint(json=dict(schema)))


def test_check_times_out(compiler, monkeypatch):
    def slow_compile(constraint):
        time.sleep(1.0)
    monkeypatch.setattr(compiler, "compile", slow_compile)
    with pytest.raises(StructuredOutputError, match="did not compile within"):
        compiler.check(Constraint(regex="slow"), timeout_s=0.05)


def test_validator_compiles_constraints_before_queueing(monkeypatch, compiler):
    import kvserve.sample.structured.grammar as grammar
    from kvserve.engine.validation import RequestValidator

    model_config = object()  # only handed to compiler_for_model
    monkeypatch.setattr(grammar, "compiler_for_model", lambda config, load_tokenizer: config is model_config and compiler)
    validator = RequestValidator(max_model_len=64, vocab_size=compiler.vocab_size, model_config=model_config)
    validator.check_constraints([SamplingParams(), SamplingParams(structured_outputs=Constraint(regex="ok"))])
    bad = Constraint(regex="(unclosed")
    with pytest.raises(StructuredOutputError):
        validator.check_constraints([SamplingParams(structured_outputs=bad)])
    asyncio.run(validator.check_constraint_async(Constraint(regex="fine")))
    with pytest.raises(StructuredOutputError):
        asyncio.run(validator.check_constraint_async(bad))
    # A model-free engine (no vocabulary) leaves constraints to the runner.
    RequestValidator(max_model_len=64, vocab_size=10).check_constraints([SamplingParams(structured_outputs=bad)])


def test_apply_bitmask_matches_a_dense_mask():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 70, generator=generator)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 3), dtype=torch.int32, generator=generator)
    out = apply_bitmask(logits, bitmask, rows=[0, 2])
    assert torch.equal(out[1], logits[1])
    for mask_row, row in enumerate([0, 2]):
        allowed = allowed_ids(bitmask[mask_row])
        for token in range(70):
            expected = logits[row, token] if token in allowed else float("-inf")
            assert out[row, token] == expected


def test_error_matcher_allows_only_eos(compiler):
    matcher = compiler.new_matcher(Constraint(choice=["a"]))
    matcher.consume_token(12345)
    assert matcher.is_error()
    assert allowed_ids(compiler.fill_bitmasks([matcher])[0]) == {EOS}


def test_a_sampled_token_the_grammar_rejects_is_logged_once(compiler, tokenizer, caplog):
    """A token outside its mask leaves the matcher allowing only EOS, so the request ends with
    finish_reason "stop" and text its grammar rejects: that is never silent."""
    from types import SimpleNamespace

    from kvserve.sample.logits_constraints import LogitsConstraints

    constraints = LogitsConstraints(None, lambda config: tokenizer)
    constraints._compiler = compiler
    params = SamplingParams(structured_outputs=Constraint(json={"enum": ["red", "green"]}))
    state = SimpleNamespace(req_id="r", sampling_params=params, grammar=None, grammar_backlog=[], output_token_ids=[])
    good = tokenizer.encode('"', add_special_tokens=False)
    state.grammar_backlog.extend(good)
    with caplog.at_level("WARNING", logger="kvserve.sample.logits_constraints"):
        assert not constraints._matcher(state).is_error()
        assert not caplog.records
        state.grammar_backlog.extend([12345, EOS])  # then EOS, the only token its mask now allows
        assert constraints._matcher(state).is_error()
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage().startswith("request r: sampled token 12345 does not fit its grammar: ")


def test_a_matcher_that_fails_computing_its_mask_is_logged_and_allows_only_eos(compiler, caplog):
    class FailingMatcher:  # llguidance's matcher when computing the mask hits a parser limit
        error = ""

        def is_error(self):
            return bool(self.error)

        def get_error(self):
            return self.error

        def unsafe_compute_mask_ptr(self, pointer, num_bytes):
            self.error = "parser limit"

    with caplog.at_level("WARNING", logger="kvserve.sample.structured.grammar"):
        bitmask = compiler.fill_bitmasks([FailingMatcher()])
    assert allowed_ids(bitmask[0]) == {EOS}
    assert [r.getMessage() for r in caplog.records] == [
        "a grammar failed while computing its mask; its request can only end: parser limit"]


def test_a_mask_that_allows_no_token_allows_eos_instead(compiler, caplog):
    class NothingMatcher:  # a healthy matcher whose mask comes out empty
        def is_error(self):
            return False

        def unsafe_compute_mask_ptr(self, pointer, num_bytes):
            pass  # leaves the zeroed row as it is

    with caplog.at_level("WARNING", logger="kvserve.sample.structured.grammar"):
        bitmask = compiler.fill_bitmasks([NothingMatcher()])
    assert allowed_ids(bitmask[0]) == {EOS}
    assert [r.getMessage() for r in caplog.records] == ["a grammar allows no token at all; its request can only end"]
