"""lm-evaluation-harness scores a small local multiple-choice task through its
`local-completions` model against a real `kvserve serve` (echo + logprobs on
/v1/completions), and gets the accuracy the same task gets offline through
`SamplingParams(prompt_logprobs=...)`.

lm_eval tokenizes with the server's own tokenizer (saved to a temporary directory: no hub)
and sends token ids, one request at a time; the offline scorer builds the same token ids the
way lm_eval does for a causal model (context, then the tokens the continuation adds to it).
Each request is then alone in its steps on both sides, so the same kernels see the same
inputs and the log-likelihoods are the same numbers.
"""
from __future__ import annotations

import json
import math
import textwrap

import pytest
from helpers.server_process import CLI_SERVE, ServerProcess

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams

pytest.importorskip("lm_eval")

MODEL = "smollm2"
TASK = "kvserve_tiny_mc"
ENGINE_FLAGS = {"max_model_len": 512, "kv_cache_memory": "32MiB"}
DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "Madrid"], "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": ["Fahrenheit", "Celsius", "Kelvin"], "answer": 1},
    {"question": "The largest planet of the solar system is", "choices": ["Mars", "Venus", "Jupiter"],
     "answer": 2},
    {"question": "A week has seven", "choices": ["days", "hours", "years"], "answer": 0},
    {"question": "The opposite of hot is", "choices": ["loud", "cold", "fast"], "answer": 1},
    {"question": "Bees make", "choices": ["honey", "milk", "silk"], "answer": 0},
    {"question": "The chemical symbol of gold is", "choices": ["Ag", "Au", "Gd"], "answer": 1},
    {"question": "Seven times eight is", "choices": ["54", "56", "58"], "answer": 1},
    {"question": "The author of Hamlet is", "choices": ["Dickens", "Shakespeare", "Austen"], "answer": 1},
    # Labelled against the obvious pick, so that the accuracy is not trivially 1.
    {"question": "On a clear day the sky is", "choices": ["blue", "green"], "answer": 1},
]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lm_eval_task")
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (directory / f"{TASK}.yaml").write_text(textwrap.dedent(f"""\
        task: {TASK}
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{question}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: answer
        metric_list:
          - metric: acc
        """))
    return directory


@pytest.fixture(scope="module")
def offline_llm():
    with LLM(**ENGINE_FLAGS) as llm:
        yield llm


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, offline_llm):
    directory = tmp_path_factory.mktemp("tokenizer")
    offline_llm.get_tokenizer().save_pretrained(str(directory))
    return directory


def _offline_accuracy(llm: LLM) -> tuple[float, list[list[float]]]:
    """Accuracy and per-choice log-likelihoods of the task, scored through prompt_logprobs."""
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    correct, scores = 0, []
    for doc in DOCS:
        context = tokenizer.encode(doc["question"], add_special_tokens=False)
        doc_scores = []
        for choice in doc["choices"]:
            whole = tokenizer.encode(doc["question"] + " " + choice, add_special_tokens=False)
            output = llm.generate([{"prompt_token_ids": whole}], params, use_tqdm=False)[0]
            doc_scores.append(sum(output.prompt_logprobs[i][whole[i]].logprob
                                  for i in range(len(context), len(whole))))
        scores.append(doc_scores)
        correct += max(range(len(doc_scores)), key=doc_scores.__getitem__) == doc["answer"]
    return correct / len(DOCS), scores


def test_lm_eval_local_completions_accuracy_equals_offline_prompt_logprobs(
        task_dir, tokenizer_dir, offline_llm, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")  # loopback only
    expected_accuracy, expected_scores = _offline_accuracy(offline_llm)
    flags = [item for key, value in ENGINE_FLAGS.items() for item in (f"--{key.replace('_', '-')}", str(value))]
    server = ServerProcess("--served-model-name", MODEL, *flags, command=CLI_SERVE)
    try:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"model": MODEL, "base_url": f"{server.base_url}/v1/completions",
                        "tokenizer_backend": "huggingface", "tokenizer": str(tokenizer_dir),
                        "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1, "batch_size": 1},
            tasks=[TASK], task_manager=TaskManager(include_path=str(task_dir)), log_samples=True)
    finally:
        server.stop()
        server.remove_log()
    accuracy = results["results"][TASK]["acc,none"]
    assert accuracy == expected_accuracy
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    assert len(samples) == len(DOCS)
    for sample, doc_scores in zip(samples, expected_scores):
        served = [float(loglikelihood) for (loglikelihood, _), in sample["resps"]]
        assert len(served) == len(doc_scores) and all(math.isfinite(x) and x < 0 for x in served)
        assert served == doc_scores, sample["doc_id"]
    print(f"\nlm_eval accuracy {accuracy:.3f} = offline {expected_accuracy:.3f}; log-likelihoods {expected_scores}")
