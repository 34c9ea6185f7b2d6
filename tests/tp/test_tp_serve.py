"""`kvserve serve -tp 2` answers the openai client with what `LLM(tensor_parallel_size=1)` generates."""
from __future__ import annotations

import os
import signal

import pytest
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
        expected_completion = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
        expected_chat = llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0]

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
    assert completion.choices[0].text == expected_completion.text
    assert completion.choices[0].finish_reason == expected_completion.finish_reason
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == expected_chat.text
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
