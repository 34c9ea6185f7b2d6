"""`kvserve serve -tp 2` answers the openai client with what `LLM(tensor_parallel_size=1)` generates,
up to a near-tie: TP=2 adds the ranks' partial o_proj/down_proj sums in another float order, so
where the two greedy choices are within rounding it may take the other one."""
from __future__ import annotations

import os
import signal

import pytest
import torch
import transformers
from helpers.greedy_check import GREEDY_SLACK
from helpers.server_process import CLI_SERVE, ServerProcess

from tp_helpers import cmdline, is_running, save_tiny_chat_model
from kvserve.sampling_params import SamplingParams

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tp_chat_model"))


def test_serve_tp2_matches_llm_tp1(chat_model):
    import openai

    from kvserve.engine.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with LLM(model=chat_model, kv_cache_memory="4MiB", device="cpu") as llm:
        expected_completion_output = llm.generate([PROMPT], params, use_tqdm=False)[0]
        expected_chat_output = llm.chat(MESSAGES, params, use_tqdm=False)[0]
    expected_completion = expected_completion_output.outputs[0]

    server = ServerProcess("--model", chat_model, "-tp", "2", "--kv-cache-memory", "2MiB", "--device", "cpu",
                           command=CLI_SERVE, startup_timeout_s=240.0)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=60)
        model_name = client.models.list().data[0].id
        completion = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                               temperature=0)
        stream = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True)
        chunks = list(stream)
        worker_pids = [pid for pid in child_pids(server.process.pid) if "spawn_main" in cmdline(pid)]
    finally:
        exit_code = server.stop()
    if _assert_same_up_to_near_tie(chat_model, expected_completion_output, completion.choices[0].text):
        assert completion.choices[0].finish_reason == expected_completion.finish_reason
    chat_text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    _assert_same_up_to_near_tie(chat_model, expected_chat_output, chat_text)
    # uvicorn re-raises SIGTERM after its graceful shutdown.
    assert exit_code in (0, -signal.SIGTERM), server.log_text()
    assert "Traceback" not in server.log_text()
    assert len(worker_pids) == 2
    assert not any(is_running(pid) for pid in worker_pids), "TP workers outlived the server"


def child_pids(pid: int) -> list[int]:
    """Live child processes of `pid` (Linux /proc)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.append(int(entry))
    return children


def _assert_same_up_to_near_tie(model: str, expected_output, got_text: str) -> bool:
    """True where `got_text` is TP=1's text. Else TP=1's tokens are decoded one more at a time
    until their text stops being a prefix of `got_text` (or, where TP=1 stopped at EOS and TP=2
    went on, at that EOS); at that step transformers (float32, fed
    TP=1's prompt and tokens) must see a near-tie: its two largest logits within twice
    `GREEDY_SLACK` of the logits' scale (each engine's logits are within `GREEDY_SLACK` of
    transformers', so the two engines' can order such a pair either way)."""
    from kvserve.model.tokenizer_files import load_tokenizer

    expected = expected_output.outputs[0]
    if got_text == expected.text:
        return True
    tokenizer = load_tokenizer(model)
    token_ids = list(expected.token_ids)
    step = next((k for k in range(len(token_ids))
                 if not got_text.startswith(tokenizer.decode(token_ids[:k + 1], skip_special_tokens=True))),
                len(token_ids) - 1 if expected.finish_reason == "stop" else None)
    assert step is not None, (got_text, expected.text)
    prompt_ids = list(expected_output.prompt_token_ids)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt_ids + token_ids])).logits[0, len(prompt_ids) - 1:].float()
    top_two = logits[step].topk(2).values
    gap = (top_two[0] - top_two[1]) / logits.abs().max().clamp(min=1.0)
    assert gap <= 2 * GREEDY_SLACK, (step, got_text, expected.text, gap.item())
    return False
