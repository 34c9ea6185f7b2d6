"""Tensor-parallel failures: a killed worker stops the engine with a clear error
within seconds and nothing hangs; a model that cannot be split is refused up front."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import transformers
from helpers.greedy_check import assert_greedy_continuations

from tp_helpers import greedy, is_running, make_engine, random_prompts, run_requests, save_tiny_model
from kvserve.config import ConfigError
from kvserve.engine.core import MAX_STEPS_IN_FLIGHT, EngineCoreRequest
from kvserve.errors import EngineDeadError


def test_killed_worker_makes_the_engine_fail_fast_and_shut_down(tmp_path):
    # One KV head on two ranks: each rank holds a replica of it.
    path = save_tiny_model("llama_mqa", tmp_path / "mqa")
    prompts = random_prompts(4, 5, 20, seed=3)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    core = make_engine(path, 2, kv_cache_memory="1MiB")
    worker_pids = core.executor.worker_pids
    try:
        # Greedy under transformers, not TP=1's tokens: TP=2 sums in another float order.
        got = run_requests(core, prompts, greedy(6))
        assert_greedy_continuations(reference, prompts, [got[str(i)] for i in range(len(prompts))], 6)
        for i in range(3):
            core.add_request(EngineCoreRequest(f"long-{i}", prompts[i], greedy(400)))
        for _ in range(3):
            core.step()
        os.kill(worker_pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        num_steps_after_kill = 0
        with pytest.raises(EngineDeadError, match=r"rank 1 .*exited unexpectedly") as failure:
            while time.monotonic() - killed_at < 60:
                num_steps_after_kill += 1
                core.step()
        # Noticed by the steps already in flight or the next one, not by a timeout
        # (a step count, which a loaded machine cannot upset; the time bound only
        # catches a hang).
        assert num_steps_after_kill <= MAX_STEPS_IN_FLIGHT + 1, num_steps_after_kill
        assert time.monotonic() - killed_at < 30, "the dead worker should be noticed, not waited out"
        assert "-9" in str(failure.value)  # the exit code says it was killed
        with pytest.raises(EngineDeadError):
            core.add_request(EngineCoreRequest("after", prompts[0], greedy(2)))
    finally:
        shutdown_at = time.monotonic()
        core.shutdown()
        shutdown_s = time.monotonic() - shutdown_at
    assert shutdown_s < 30  # no wait on the dead rank's timeout
    assert not any(is_running(pid) for pid in worker_pids), "surviving workers must be stopped"


def test_model_that_cannot_be_split_is_refused_before_starting_workers(tmp_path):
    import transformers

    path = tmp_path / "three_heads"
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=3, num_key_value_heads=3)
    transformers.LlamaForCausalLM(config).save_pretrained(str(path))
    with pytest.raises(ConfigError, match="tensor_parallel_size 2 does not divide the model's 3 attention heads"):
        make_engine(str(path), 2)


def test_worker_start_failure_is_reported_in_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_tiny_model("llama_gqa", tmp_path / "broken")
    weights_file = tmp_path / "broken" / "model.safetensors"
    tensors = load_file(str(weights_file))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(weights_file), metadata={"format": "pt"})
    started_at = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^startup failed on tensor-parallel rank 0: ValueError: "
                                           r"checkpoint is missing 1 tensors") as failure:
        make_engine(path, 2)
    assert "\n" not in str(failure.value)
    assert time.monotonic() - started_at < 60


def test_cuda_run_with_fewer_gpus_than_ranks_is_refused(monkeypatch):
    import torch

    from kvserve.worker.tp_executor import check_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_devices("cuda", 2)
    check_devices("cpu", 8)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 2 on cuda:1 needs GPUs up to cuda:2, but 2 "):
        check_devices("cuda:1", 2)
