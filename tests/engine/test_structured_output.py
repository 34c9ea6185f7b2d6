"""Structured output through `kvserve.LLM` with the default model (SmolLM2-135M)."""
from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest

from kvserve import LLM, SamplingParams
from kvserve.sample.structured.grammar import StructuredOutputError
from kvserve.sampling_params import StructuredOutputsParams as Constraint

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request):
    engine = LLM(kv_cache_memory="48MiB", max_model_len=512, max_num_seqs=16,
                 async_scheduling=request.param)
    yield engine
    engine.shutdown()


def test_json_schema_under_every_sampling_mode(llm):
    modes = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3),
             SamplingParams(temperature=0.9, top_k=5, top_p=0.8, seed=4),
             SamplingParams(temperature=1.0, min_p=0.2, seed=5),
             SamplingParams(temperature=0.7, presence_penalty=1.5, frequency_penalty=1.0,
                            repetition_penalty=1.3, seed=6),
             SamplingParams(temperature=0.0, logprobs=3),
             SamplingParams(temperature=1.0, n=3, seed=7)]
    params = [SamplingParams(**{**vars(p), "max_tokens": 80, "structured_outputs": Constraint(json=PERSON)})
              for p in modes]
    outputs = llm.chat([ASK] * len(params), params, use_tqdm=False)
    for output in outputs:
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion
            jsonschema.validate(json.loads(completion.text), PERSON)


def test_choice_regex_grammar_and_json_object(llm):
    params = [Constraint(choice=["red", "green", "blue"]), Constraint(regex=r"[0-9]{3}-[0-9]{4}"),
              Constraint(grammar='root ::= "(" [a-z]+ ")"'), Constraint(json_object=True)]
    outputs = llm.chat([ASK] * len(params), [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=c)
                                             for c in params], use_tqdm=False)
    texts = [o.outputs[0].text for o in outputs]
    assert texts[0] in ("red", "green", "blue")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", texts[1])
    assert outputs[2].outputs[0].finish_reason == "length" or re.fullmatch(r"\([a-z]+\)", texts[2])
    assert isinstance(json.loads(texts[3]), dict)


def test_max_tokens_before_the_grammar_ends_is_length(llm):
    (output,) = llm.chat([ASK], SamplingParams(temperature=0.0, max_tokens=4,
                                               structured_outputs=Constraint(json=PERSON)), use_tqdm=False)
    assert output.outputs[0].finish_reason == "length"
    assert len(output.outputs[0].token_ids) == 4


def test_preemption_and_recompute_keep_the_grammar_state():
    # A KV pool of 16 blocks for 8 requests that grow to ~6 blocks each: requests are
    # preempted, and resumed requests rebuild their matcher from their tokens so far.
    people = {"type": "array", "items": PERSON, "minItems": 3, "maxItems": 3}
    with LLM(kv_cache_memory="12MiB", max_model_len=512, max_num_seqs=8) as small:
        params = SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=Constraint(json=people))
        outputs = small.chat([ASK] * 8, params, use_tqdm=False)
        assert small.engine_core.scheduler.num_preemptions > 0
    for output in outputs:
        if output.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(output.outputs[0].text), people)
        else:
            assert len(output.outputs[0].token_ids) == 100


def test_logit_bias_forces_and_bans_tokens(llm):
    tokenizer = llm.get_tokenizer()
    (forced,) = tokenizer.encode(" banana", add_special_tokens=False)[:1]
    (output,) = llm.chat([ASK], SamplingParams(temperature=0.0, max_tokens=3, logit_bias={forced: 100}),
                         use_tqdm=False)
    assert output.outputs[0].token_ids == [forced] * 3
    (plain,) = llm.chat([ASK], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    first = plain.outputs[0].token_ids[0]
    (banned,) = llm.chat([ASK], SamplingParams(temperature=0.0, max_tokens=1, logit_bias={first: -100}),
                         use_tqdm=False)
    assert banned.outputs[0].token_ids[0] != first


def test_bad_constraint_raises_before_anything_runs(llm):
    with pytest.raises(StructuredOutputError, match="regex"):
        llm.generate(["a", "b"], [SamplingParams(), SamplingParams(structured_outputs=Constraint(regex="(a"))],
                     use_tqdm=False)
    (after,) = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert len(after.outputs[0].token_ids) == 2


def test_speculative_drafts_are_masked_and_greedy_output_is_unchanged(llm):
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=Constraint(json=PERSON))
    conversation = [{"role": "user", "content": 'Repeat exactly: {"name": "Ann", "age": 7} {"name": "Ann", "age": 7}'}]
    (plain,) = llm.chat([conversation], params, use_tqdm=False)
    with LLM(kv_cache_memory="32MiB", max_model_len=512, max_num_seqs=4,
             speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}) as spec:
        (drafted,) = spec.chat([conversation], params, use_tqdm=False)
    assert drafted.outputs[0].token_ids == plain.outputs[0].token_ids
    jsonschema.validate(json.loads(drafted.outputs[0].text), PERSON)


def test_masks_are_filled_on_the_mask_thread_while_the_forward_runs(llm, monkeypatch):
    """Each step's mask fill starts on the mask thread while that step's forward runs, one mask
    row per sampled token, and the output is what an unhidden mask gives. The forward waits
    for the fill to begin instead of sleeping, so the check holds however loaded the machine:
    a design that filled only after the forward would make every wait time out."""
    import threading

    runner = llm.engine_core.executor.model_runner
    constraints = runner.logits_constraints
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=Constraint(json=PERSON))
    (reference,) = llm.chat([ASK], params, use_tqdm=False)
    fill_threads = set()
    fill_started = threading.Event()
    fill_began_during_forward = []
    fill, forward = constraints.compiler.fill_bitmasks, runner.model._forward

    def recording_fill(matchers, out=None):
        fill_threads.add(threading.current_thread().name)
        fill_started.set()
        return fill(matchers, out)

    def forward_awaiting_the_fill(*args):
        fill_began_during_forward.append(fill_started.wait(timeout=2.0))
        fill_started.clear()
        return forward(*args)

    monkeypatch.setattr(constraints.compiler, "fill_bitmasks", recording_fill)
    monkeypatch.setattr(runner.model, "_forward", forward_awaiting_the_fill)  # forward and forward_logits
    before = dataclasses.replace(constraints.stats)
    (output,) = llm.chat([ASK], params, use_tqdm=False)
    rows = constraints.stats.rows - before.rows
    assert output.outputs[0].token_ids == reference.outputs[0].token_ids
    assert fill_threads == {"kvserve-mask_0"}
    # Async scheduling runs one step past the EOS (its token is dropped, its mask not needed).
    assert rows - len(output.outputs[0].token_ids) in (0, 1)
    assert fill_began_during_forward.count(False) <= 1, fill_began_during_forward


def test_native_mask_kernel_gives_the_torch_paths_outputs(llm, monkeypatch):
    """The mask written by the native decoder's LM head, the runner's native bitmask kernel
    after the forward and the torch path (unpacked mask, masked_fill_) give the same tokens
    and logprobs under greedy, seeded sampling with top-k/p and penalties, and n > 1."""
    from kvserve.sample import logits_constraints

    constraints = llm.engine_core.executor.model_runner.logits_constraints
    assert constraints.mask_isa is not None  # the CPU kernels are built in this test environment
    modes = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.9, top_k=8, top_p=0.9, seed=11,
                                                                           logprobs=1, repetition_penalty=1.2),
             SamplingParams(temperature=1.0, n=2, seed=12)]
    params = [dataclasses.replace(p, max_tokens=30, structured_outputs=Constraint(json=PERSON)) for p in modes]

    def run():
        outputs = llm.chat([ASK] * len(params), params, use_tqdm=False)
        return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outputs]

    head_rows = constraints.stats.head_rows
    native = run()
    assert constraints.stats.head_rows > head_rows  # the default model's head runs in the native call

    with monkeypatch.context() as patch:
        patch.setattr(logits_constraints.HeadMaskPool, "next", lambda self, rows: None)  # masked after the forward
        head_rows = constraints.stats.head_rows
        assert run() == native
        assert constraints.stats.head_rows == head_rows
    monkeypatch.setattr(constraints, "_mask_isa", None)
    assert run() == native


def test_prefix_cache_hits_leave_the_constrained_output_unchanged(llm):
    """The grammar depends on output tokens only: a request whose prompt is served from the
    prefix cache (whole, then with a different tail) samples under the same masks."""
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=Constraint(json=PERSON))
    (first,) = llm.chat([ASK], params, use_tqdm=False)
    (again,) = llm.chat([ASK], params, use_tqdm=False)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    seeded = SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=60, structured_outputs=Constraint(json=PERSON))
    outputs = llm.chat([ASK + [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Another."}]] * 2,
                       seeded, use_tqdm=False)
    assert outputs[1].num_cached_tokens > 0
    assert [c.token_ids for c in outputs[0].outputs] == [c.token_ids for c in outputs[1].outputs]
    for completion in outputs[0].outputs + outputs[1].outputs:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), PERSON)


def _native_forward_patch(runner, head_mask_then):
    """Wrap the native decoder's step: `head_mask_then(head_mask, forward, args)` runs it."""
    native = runner.model.native_decoder
    assert native is not None  # built by an earlier constrained run
    forward = native.forward

    def patched(*args):
        return head_mask_then(args[-1], forward, args[:-1])
    return native, patched


def test_late_fills_and_head_timeouts_give_the_masked_outputs(llm, monkeypatch):
    """Every fill made late on purpose: it starts only once its step's forward has returned,
    and the LM head waits 0 s. The head never masks, the runner masks after the forward,
    and greedy and seeded outputs are those of masks on time, with no mask missed."""
    import threading

    from kvserve.model import native_decoder

    runner = llm.engine_core.executor.model_runner
    constraints = runner.logits_constraints
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=Constraint(json=PERSON)),
              SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=Constraint(json=PERSON))]
    reference = [o.outputs[0].token_ids for o in llm.chat([ASK] * 2, params, use_tqdm=False)]
    forwards_done = threading.Semaphore(0)  # one release per step forward handed a head mask

    def forward_then_release(head_mask, forward, args):
        try:
            return forward(*args, head_mask)
        finally:
            if head_mask is not None:
                forwards_done.release()
    fill_into = constraints._fill_into

    def fill_after_the_forward(pending, *args):
        if pending.head_mask is not None:
            assert forwards_done.acquire(timeout=30)
        fill_into(pending, *args)
    native, patched = _native_forward_patch(runner, forward_then_release)
    monkeypatch.setattr(native, "forward", patched)
    monkeypatch.setattr(constraints, "_fill_into", fill_after_the_forward)
    monkeypatch.setattr(native_decoder, "_MASK_TIMEOUT_NS", 0)
    before = dataclasses.replace(constraints.stats)
    late = llm.chat([ASK] * 2, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in late] == reference
    assert constraints.stats.head_rows == before.head_rows and constraints.stats.rows > before.rows
    assert constraints.stats.missed_rows == before.missed_rows
    for output in late:
        assert output.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(output.outputs[0].text), PERSON)


def test_a_mask_reported_applied_but_missed_is_caught_before_the_token_is_kept(llm, monkeypatch, caplog):
    """The failure a racing or stale head mask would cause, forced: the LM head reports its
    rows masked but returns them unmasked. Sampled freely, the model's first token is not JSON
    (its matcher would fail and the request end as "stop" mid-text); the runner's check finds
    each banned token, masks the row after the forward and samples again, so the outputs
    are the masked ones and every miss is logged."""
    runner = llm.engine_core.executor.model_runner
    constraints = runner.logits_constraints
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=Constraint(json=PERSON)),
              SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=Constraint(json=PERSON))]
    reference = llm.chat([ASK] * 2, params, use_tqdm=False)
    (free,) = llm.chat([ASK], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    assert not free.outputs[0].text.startswith("{")  # unmasked, the first token is banned

    def claim_applied(head_mask, forward, args):
        out = forward(*args, None)  # the logits come back unmasked
        if head_mask is not None and out is not None:
            head_mask.applied = True
        return out
    native, patched = _native_forward_patch(runner, claim_applied)
    monkeypatch.setattr(native, "forward", patched)
    before = dataclasses.replace(constraints.stats)
    with caplog.at_level("ERROR", logger="kvserve.sample.logits_constraints"):
        caught = llm.chat([ASK] * 2, params, use_tqdm=False)
    assert constraints.stats.missed_rows > before.missed_rows
    assert any("grammar mask missed" in r.getMessage() for r in caplog.records)
    # Greedy is the masked argmax again; the seeded draw is a fresh one from the masked
    # distribution (its generator drew once more), so only its validity is checked.
    assert caught[0].outputs[0].token_ids == reference[0].outputs[0].token_ids
    for output in caught:
        assert output.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(output.outputs[0].text), PERSON)
