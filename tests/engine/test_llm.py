"""LLM end to end on a tiny random Llama, against transformers' greedy generate."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import transformers

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import SamplingParamsError
from helpers.greedy_check import assert_greedy_continuations

PROMPTS = [
    "The quick brown fox",
    "A much longer prompt that spans more than one KV-cache block of sixteen tokens, "
    "so the prefill covers several blocks and a partial one at the end.",
    "你好",
    "1 2 3",
]
ENGINE_KWARGS = dict(kv_cache_memory="32MiB", max_model_len=512, max_num_seqs=16, dtype="float32")


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory, smollm_tokenizer):
    """A random 2-layer Llama with the default model's tokenizer (vocabulary and
    chat template), saved in float32 like a Hugging Face checkpoint."""
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(smollm_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    smollm_tokenizer.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def reference_model(tiny_llama_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request, tiny_llama_dir):
    engine = LLM(tiny_llama_dir, async_scheduling=request.param, **ENGINE_KWARGS)
    yield engine
    engine.shutdown()


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def assert_no_blocks_held(llm: LLM) -> None:
    scheduler = llm.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    assert not scheduler.has_unfinished_requests()
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all but the null block


def test_single_prompt_matches_transformers(llm, reference_model):
    output = llm.generate(PROMPTS[0], greedy(16), use_tqdm=False)[0]
    prompt_ids = llm.get_tokenizer().encode(PROMPTS[0])
    assert output.prompt_token_ids == prompt_ids
    assert_greedy_continuations(reference_model, [prompt_ids], [output.outputs[0].token_ids], 16)
    assert output.outputs[0].finish_reason == "length"
    tokenizer = llm.get_tokenizer()
    full_text = tokenizer.decode(prompt_ids + output.outputs[0].token_ids, skip_special_tokens=True)
    assert full_text == tokenizer.decode(prompt_ids, skip_special_tokens=True) + output.outputs[0].text


def test_batch_matches_transformers_in_input_order(llm, reference_model):
    max_tokens = [12, 5, 20, 9]
    params = [greedy(n) for n in max_tokens]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for prompt, output, n in zip(PROMPTS, outputs, max_tokens):
        assert output.prompt == prompt
        assert_greedy_continuations(reference_model, [tokenizer.encode(prompt)], [output.outputs[0].token_ids], n)
    assert_no_blocks_held(llm)


def test_token_id_prompts(llm, reference_model):
    prompts = [[5, 900, 33, 1200, 7], [42] * 20]
    outputs = llm.generate(prompts, greedy(8), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.prompt is None and output.prompt_token_ids == prompt
        assert_greedy_continuations(reference_model, [prompt], [output.outputs[0].token_ids], 8)
    # One prompt as a list of ids, a tensor, or a dict: the same request.
    single = [llm.generate(p, greedy(8), use_tqdm=False)[0].outputs[0].token_ids
              for p in (prompts[0], torch.tensor(prompts[0]), {"prompt_token_ids": prompts[0]})]
    assert single == [outputs[0].outputs[0].token_ids] * 3


def test_chat_uses_the_template(llm, reference_model):
    conversation = [{"role": "user", "content": "Hi there"}]
    output = llm.chat(conversation, greedy(6), use_tqdm=False)[0]
    expected_ids = llm.get_tokenizer().apply_chat_template(conversation, add_generation_prompt=True,
                                                           tokenize=True)
    expected_ids = list(expected_ids["input_ids"] if hasattr(expected_ids, "keys") else expected_ids)
    assert output.prompt_token_ids == expected_ids
    assert output.prompt.endswith("<|im_start|>assistant\n")
    assert_greedy_continuations(reference_model, [expected_ids], [output.outputs[0].token_ids], 6)
    two = llm.chat([conversation, conversation + [{"role": "assistant", "content": "Hello"},
                                                  {"role": "user", "content": "Bye"}]],
                   greedy(3), use_tqdm=False)
    assert two[0].outputs[0].token_ids == output.outputs[0].token_ids[:3]
    assert len(two[1].prompt_token_ids) > len(two[0].prompt_token_ids)


def test_stop_string_across_token_boundary(llm):
    prompt = PROMPTS[1]
    params = dict(skip_special_tokens=False)
    full = llm.generate(prompt, greedy(24, **params), use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    # End offset of each token's text; a stop string made of the last character
    # of token i and the whole text of token i + 1 crosses a token boundary.
    ends = [len(tokenizer.decode(full.token_ids[:k + 1], skip_special_tokens=False))
            for k in range(len(full.token_ids))]
    text = full.text
    candidates = [text[ends[i] - 1:ends[i + 1]] for i in range(2, len(ends) - 2)
                  if ends[i + 1] > ends[i] > ends[i - 1] and "\ufffd" not in text[:ends[i + 1]]]
    assert candidates, "the random model produced no usable text"
    stop = candidates[0]
    out = llm.generate(prompt, greedy(24, stop=[stop], **params), use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == text[:text.find(stop)]
    assert out.token_ids == full.token_ids[:len(out.token_ids)]
    assert len(out.token_ids) < len(full.token_ids)
    assert_no_blocks_held(llm)


def test_stream_yields_deltas(llm):
    chunks = list(llm.stream(PROMPTS[0], greedy(10)))
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert len(chunks) >= 5
    final = chunks[-1].outputs[0]
    assert "".join(c.outputs[0].new_text for c in chunks) == final.text
    assert [t for c in chunks for t in c.outputs[0].new_token_ids] == final.token_ids
    assert final.token_ids == llm.generate(PROMPTS[0], greedy(10), use_tqdm=False)[0].outputs[0].token_ids


def test_stream_closed_early_aborts(llm):
    stream = llm.stream(PROMPTS[0], greedy(200))
    next(stream)
    stream.close()
    assert_no_blocks_held(llm)


def test_n_samples_share_the_prompt_blocks(tiny_llama_dir):
    block_size = 16
    with LLM(tiny_llama_dir, block_size=block_size, **ENGINE_KWARGS) as engine:
        prompt_ids = list(range(100, 100 + 3 * block_size + 5))
        params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
        request_id = engine._add_request(None, prompt_ids, params, final_only=True)
        for _ in range(2):  # the children's prefill has been scheduled
            processed = engine.output_processor.process_outputs(engine.engine_core.step())
            assert processed.request_outputs == []
        manager = engine.engine_core.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        tables = [manager.req_to_blocks[f"{i}_{request_id}"] for i in range(4)]
        full_blocks = len(prompt_ids) // block_size
        shared = {tuple(block.block_id for block in table[:full_blocks]) for table in tables}
        assert len(shared) == 1, "the children's prompt blocks differ"
        assert all(table[full_blocks].block_id != tables[0][full_blocks].block_id for table in tables[1:])
        outputs = {o.request_id: o for o in engine._step_until_done()}
        result = outputs[request_id]
        assert result.num_cached_tokens >= full_blocks * block_size
        assert len(result.outputs) == 4
        assert all(len(c.token_ids) == 6 for c in result.outputs)
        assert_no_blocks_held(engine)


def test_n_greedy_children_equal_single_greedy(tiny_llama_dir, reference_model):
    # Children hit the prompt blocks their siblings compute in the same step.
    with LLM(tiny_llama_dir, **ENGINE_KWARGS) as engine:
        prompt_ids = list(range(100, 153))
        result = engine.generate(prompt_ids, greedy(6, n=4), use_tqdm=False)[0]
        # The same path for every child: the same tokens, greedy under the reference.
        assert [c.token_ids for c in result.outputs] == [result.outputs[0].token_ids] * 4
        assert_greedy_continuations(reference_model, [prompt_ids], [result.outputs[0].token_ids], 6)


def test_n_seeded_children_differ_and_reproduce(tiny_llama_dir):
    with LLM(tiny_llama_dir, **ENGINE_KWARGS) as engine:
        prompt_ids = list(range(100, 153))
        engine.generate(prompt_ids, greedy(1), use_tqdm=False)  # prompt blocks computed once
        params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
        first = engine.generate(prompt_ids, params, use_tqdm=False)[0]
        second = engine.generate(prompt_ids, params, use_tqdm=False)[0]
        assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
        assert len({tuple(c.token_ids) for c in first.outputs}) > 1, "seeded children sampled alike"
        single = engine.generate(prompt_ids, dataclasses.replace(params, n=1, seed=4), use_tqdm=False)[0]
        assert single.outputs[0].token_ids == first.outputs[1].token_ids  # child 1 has seed 3 + 1


def test_hundred_random_requests_leave_no_blocks(tiny_llama_dir):
    rng = random.Random(0)
    with LLM(tiny_llama_dir, kv_cache_memory="4MiB", max_model_len=512, max_num_seqs=32,
             max_num_batched_tokens=256, async_scheduling=True) as engine:
        prompts = [[rng.randrange(3, 40000) for _ in range(rng.randint(1, 200))] for _ in range(100)]
        params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=i, ignore_eos=True,
                                 max_tokens=rng.randint(1, 24), stop=["zz"] if i % 7 == 0 else [])
                  for i in range(100)]
        outputs = engine.generate(prompts, params, use_tqdm=False)
        for prompt, param, output in zip(prompts, params, outputs):
            assert output.prompt_token_ids == prompt and output.finished
            completion = output.outputs[0]
            if completion.finish_reason == "length":
                assert len(completion.token_ids) == param.max_tokens
            else:
                assert (completion.finish_reason, completion.stop_reason) == ("stop", "zz")
        assert_no_blocks_held(engine)


def test_clear_errors(llm):
    with pytest.raises(SamplingParamsError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["a"], [greedy(1), greedy(1)], use_tqdm=False)
    with pytest.raises(ValueError, match="context length"):
        llm.generate([[5] * 600], greedy(4), use_tqdm=False)
    assert_no_blocks_held(llm)
    # The engine still works after a rejected batch.
    assert len(llm.generate("ok", greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_progress_bar_reports_tokens_per_second(llm, capsys):
    llm.generate(PROMPTS, greedy(4), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "tok/s" in err and "4/4" in err
    llm.generate(PROMPTS, greedy(4), use_tqdm=False)
    assert capsys.readouterr().err == ""
