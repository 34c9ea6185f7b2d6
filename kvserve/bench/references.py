"""Reference engines run on the same workload: transformers (always), llama.cpp (when importable).

Each runner has `load_s` and `run(workload) -> ThroughputResult`. The
transformers runner is the static-batching baseline a user would write: `generate` over batches of
left-padded prompts; a batch runs until its longest requested output, and
only the requested tokens count as useful output.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvserve.bench.model_info import split_gguf_path
from kvserve.bench.workloads import Workload

logger = logging.getLogger(__name__)


@dataclass
class ThroughputResult:
    """Throughput of one engine on one workload; `elapsed_s` excludes model loading."""

    engine: str
    workload: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    load_s: float
    notes: str = ""

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.elapsed_s

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(requests_per_s=self.requests_per_s, output_tokens_per_s=self.output_tokens_per_s,
                    prompt_tokens_per_s=self.prompt_tokens_per_s)
        return data


class TransformersRunner:
    """Hugging Face transformers `generate` on the same weights (GGUF dequantized at load)."""

    name = "transformers"

    def __init__(self, model_path: str, dtype: str = "float32", batch_size: int | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the GGUF dequantization bars would flood the bench's table
        started = time.perf_counter()
        directory, gguf_file = split_gguf_path(model_path)
        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype), **kwargs).eval()
        self.load_s = time.perf_counter() - started
        self.dtype = dtype
        self.batch_size = batch_size
        config_pad = self.model.generation_config.pad_token_id
        self.pad_token_id = 0 if config_pad is None else int(config_pad)

    def _generate_batch(self, requests) -> None:
        import torch

        longest_prompt = max(r.prompt_len for r in requests)
        max_new_tokens = max(r.output_len for r in requests)
        input_ids = torch.full((len(requests), longest_prompt), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, request in enumerate(requests):
            input_ids[row, longest_prompt - request.prompt_len:] = torch.tensor(request.prompt_token_ids)
            attention_mask[row, longest_prompt - request.prompt_len:] = 1
        with torch.inference_mode():
            # min_new_tokens masks EOS: the reference does the same fixed work as ignore_eos.
            output = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                         pad_token_id=self.pad_token_id)
        if output.shape[1] != longest_prompt + max_new_tokens:
            raise RuntimeError(f"transformers generated {output.shape[1] - longest_prompt} tokens, "
                               f"expected {max_new_tokens}")

    def run(self, workload: Workload) -> ThroughputResult:
        batch_size = self.batch_size or len(workload.requests)
        started = time.perf_counter()
        for first in range(0, len(workload.requests), batch_size):
            self._generate_batch(workload.requests[first:first + batch_size])
        elapsed_s = time.perf_counter() - started
        return ThroughputResult(self.name, workload.name, len(workload.requests), workload.num_prompt_tokens,
                               workload.num_output_tokens, elapsed_s, self.load_s,
                               notes=f"{self.dtype}, static batches of {batch_size}, left padding")


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python on the GGUF file itself (its own quantized weights).

    llama-cpp-python's high-level API decodes one sequence at a time, so this
    is llama.cpp's single-stream speed, run over the workload's requests in turn.
    """

    name = "llama.cpp"

    def __init__(self, model_path: str, n_ctx: int = 4096, n_threads: int | None = None) -> None:
        import llama_cpp

        if not model_path.endswith(".gguf"):
            raise ValueError("llama.cpp needs a .gguf model file")
        started = time.perf_counter()
        # llama-cpp-python defaults to half the cores; use as many threads as torch does.
        n_threads = n_threads or os.cpu_count() or 1
        self.llm = llama_cpp.Llama(model_path=model_path, n_ctx=n_ctx, n_threads=n_threads,
                                   n_threads_batch=n_threads, verbose=False)
        self.load_s = time.perf_counter() - started

    def _generate_one(self, request) -> None:
        self.llm.reset()
        produced = 0
        for _ in self.llm.generate(request.prompt_token_ids, temp=0.0, top_k=1):
            produced += 1
            if produced >= request.output_len:
                break

    def run(self, workload: Workload) -> ThroughputResult:
        started = time.perf_counter()
        for request in workload.requests:
            self._generate_one(request)
        elapsed_s = time.perf_counter() - started
        return ThroughputResult(self.name, workload.name, len(workload.requests), workload.num_prompt_tokens,
                               workload.num_output_tokens, elapsed_s, self.load_s,
                               notes="GGUF weights as stored, one sequence at a time")
