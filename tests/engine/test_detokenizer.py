"""IncrementalDetokenizer against the tokenizer's own decode of the whole sequence."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.sampling_params import SamplingParams

TEXTS = [
    "Hello world, the end.",
    "  leading spaces and\nnew lines\n\n",
    "naïve café — déjà vu, Straße",
    "你好，世界！这是一个测试。",
    "emoji: 😀👍🏽🇫🇷 family 👨‍👩‍👧 done",
    "mixed 日本語 text with ✓ and ∑ symbols",
    "tokenizer stop here the end",
]


def oracle_output_text(tokenizer, prompt_ids, output_ids, skip_special_tokens=True):
    """Text the outputs add to the prompt, according to decode() of the full sequence."""
    kwargs = dict(skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    full = tokenizer.decode(prompt_ids + output_ids, **kwargs)
    prompt = tokenizer.decode(prompt_ids, **kwargs)
    assert full.startswith(prompt)
    return full[len(prompt):]


def stream(tokenizer, prompt_ids, output_ids, params=None, seed=0):
    """Feed tokens in random-sized chunks; return (deltas, detokenizer, stop string)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params or SamplingParams())
    rng = random.Random(seed)
    deltas, position, stop = [], 0, None
    while position < len(output_ids) and stop is None:
        chunk = output_ids[position:position + rng.choice([1, 1, 1, 2, 3])]
        position += len(chunk)
        stop = detok.update(chunk)
        finished = stop is not None or position >= len(output_ids)
        if finished and stop is None:
            detok.flush()
        deltas.append(detok.get_next_output_text(finished, delta=True))
    return deltas, detok, stop


@pytest.fixture(params=["smollm", "byte_fallback"])
def tokenizer(request, smollm_tokenizer, byte_fallback_tokenizer):
    return smollm_tokenizer if request.param == "smollm" else byte_fallback_tokenizer


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_streamed_text_equals_full_decode(tokenizer, text, seed):
    prompt_ids = tokenizer.encode("Say hello", add_special_tokens=False)
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, detok, _ = stream(tokenizer, prompt_ids, output_ids, seed=seed)
    expected = oracle_output_text(tokenizer, prompt_ids, output_ids)
    assert "".join(deltas) == expected
    assert detok.output_text == expected
    assert detok.token_ids == output_ids
    # An incomplete multi-byte character is never shown as U+FFFD mid-stream.
    assert all("\ufffd" not in delta for delta in deltas)


def test_byte_fallback_tokens_are_really_used(byte_fallback_tokenizer):
    ids = byte_fallback_tokenizer.encode("你好 😀", add_special_tokens=False)
    pieces = byte_fallback_tokenizer.convert_ids_to_tokens(ids)
    assert sum(piece.startswith("<0x") for piece in pieces) >= 10


def test_multibyte_character_waits_for_all_its_bytes(byte_fallback_tokenizer):
    tok = byte_fallback_tokenizer
    emoji_ids = tok.encode("😀", add_special_tokens=False)
    byte_ids = [i for i in emoji_ids if tok.convert_ids_to_tokens(i).startswith("<0x")]
    assert len(byte_ids) == 4
    detok = IncrementalDetokenizer(tok, tok.encode("hi", add_special_tokens=False))
    for token_id in byte_ids[:-1]:
        detok.update([token_id])
        assert detok.get_next_output_text(False, delta=True) == ""
    detok.update([byte_ids[-1]])
    assert detok.get_next_output_text(False, delta=True).endswith("😀")


@pytest.mark.parametrize("seed", range(8))
def test_random_token_ids_match_full_decode(smollm_tokenizer, seed):
    rng = random.Random(seed)
    vocab_size = len(smollm_tokenizer)
    prompt_ids = smollm_tokenizer.encode("Random text:", add_special_tokens=False)
    output_ids = [rng.randrange(3, vocab_size) for _ in range(60)]
    deltas, _, _ = stream(smollm_tokenizer, prompt_ids, output_ids, seed=seed)
    assert "".join(deltas) == oracle_output_text(smollm_tokenizer, prompt_ids, output_ids)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(smollm_tokenizer, skip):
    tok = smollm_tokenizer
    special = tok.convert_tokens_to_ids("<|im_end|>")
    output_ids = tok.encode("one two", add_special_tokens=False) + [special] + \
        tok.encode(" three", add_special_tokens=False)
    prompt_ids = tok.encode("count:", add_special_tokens=False)
    deltas, _, _ = stream(tok, prompt_ids, output_ids, SamplingParams(skip_special_tokens=skip))
    text = "".join(deltas)
    assert text == oracle_output_text(tok, prompt_ids, output_ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) == (not skip)


STOP_CASES = [
    # (generated text, stop strings, expected output)
    ("tokenizer stop here the end", ["stop here"], "tokenizer "),
    ("tokenizer stop here the end", ["op he"], "tokenizer st"),
    ("hello world hello world", ["lo wo", "the"], "hel"),
    ("你好，世界！这是一个测试。", ["世界"], "你好，"),
    ("emoji: 😀👍🏽 done", ["👍"], "emoji: 😀"),
    ("nothing matches here", ["xyz"], "nothing matches here"),
]


@pytest.mark.parametrize("text, stops, expected", STOP_CASES)
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_across_token_boundaries(tokenizer, text, stops, expected, include):
    prompt_ids = tokenizer.encode("Go:", add_special_tokens=False)
    output_ids = tokenizer.encode(" " + text, add_special_tokens=False)
    full = oracle_output_text(tokenizer, prompt_ids, output_ids)
    expected = full[:len(full) - len(text)] + expected  # the leading space, as decoded
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    deltas, detok, stop = stream(tokenizer, prompt_ids, output_ids, params)
    matched = sorted((s for s in stops if s in full), key=full.index)
    assert stop == (matched[0] if matched else None)
    if include and matched:
        expected += stop
    assert "".join(deltas) == expected
    if matched and not include:
        # Held back while streaming: no delta ever showed part of the stop string.
        shown = ""
        for delta in deltas:
            shown += delta
            assert expected.startswith(shown)


def test_stop_string_completed_mid_chunk_drops_later_tokens(smollm_tokenizer):
    tok = smollm_tokenizer
    output_ids = tok.encode(" alpha beta gamma delta", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["beta"]))
    assert detok.update(output_ids) == "beta"
    assert detok.get_next_output_text(True, delta=False) == " alpha "
    assert len(detok.token_ids) < len(output_ids)
    assert tok.decode(detok.token_ids).endswith("beta")


def test_stop_strings_ignored_before_min_tokens(smollm_tokenizer):
    tok = smollm_tokenizer
    output_ids = tok.encode("stop and stop", add_special_tokens=False)
    params = SamplingParams(stop=["stop"], min_tokens=2, max_tokens=20)
    deltas, _, stop = stream(tok, [], output_ids, params)
    assert stop == "stop"
    assert "".join(deltas) == "stop and "


def test_stop_token_text_not_added(smollm_tokenizer):
    tok = smollm_tokenizer
    body = tok.encode("Answer", add_special_tokens=False)
    stop_token = tok.encode(" now", add_special_tokens=False)[0]
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop_token_ids=[stop_token]))
    detok.update(body)
    detok.update([stop_token], stop_terminated=True)
    detok.flush()
    assert detok.token_ids == body + [stop_token]
    assert detok.get_next_output_text(True, delta=False) == "Answer"


def test_flush_emits_an_incomplete_trailing_character(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = tok.encode("ok 😀", add_special_tokens=False)
    truncated = ids[:-1]  # the emoji's last byte never arrives
    deltas, _, _ = stream(tok, [], truncated)
    assert "".join(deltas) == tok.decode(truncated)
    assert "".join(deltas).endswith("\ufffd")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=1, max_size=40), seed=st.integers(0, 1000),
       stop=st.text(min_size=1, max_size=3))
def test_property_any_text_any_chunking(tokenizer, text, seed, stop):
    prompt_ids = tokenizer.encode("Q:", add_special_tokens=False)
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    if not output_ids:
        return
    expected = oracle_output_text(tokenizer, prompt_ids, output_ids)
    deltas, _, _ = stream(tokenizer, prompt_ids, output_ids, seed=seed)
    assert "".join(deltas) == expected
    deltas, _, found = stream(tokenizer, prompt_ids, output_ids, SamplingParams(stop=[stop]), seed=seed)
    streamed = "".join(deltas)
    if found is None:
        assert streamed == expected
    else:
        # Cut right before the first occurrence of the stop string.
        assert found == stop and stop not in streamed
        assert expected.startswith(streamed) and expected[len(streamed):].startswith(stop)
