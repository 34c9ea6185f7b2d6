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
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

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
    cached_prompt_tokens: int = 0  # prompt tokens served from a prefix cache (kvserve only)

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
    """Hugging Face transformers on the same weights (GGUF dequantized at load), at its best offline.

    `strategy` "static": `generate` over batches of up to `batch_size` left-padded
    prompts, sorted by length so each batch pads little; a batch runs until its
    longest requested output and only the requested tokens count. "continuous":
    transformers' own continuous batching (the manager behind `generate_batch`),
    each request with its own `max_new_tokens`, at most `batch_size` requests per
    step. EOS is ignored either way, so the work equals kvserve's.
    """

    STRATEGIES = ("static", "continuous")

    def __init__(self, model_path: str, dtype: str = "float32", batch_size: int | None = None,
                 strategy: str = "static") -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        if strategy not in self.STRATEGIES:
            raise ValueError(f"strategy must be one of {self.STRATEGIES}, got {strategy!r}")
        hf_logging.disable_progress_bar()  # the GGUF dequantization bars would flood the bench's table
        started = time.perf_counter()
        directory, gguf_file = split_gguf_path(model_path)
        kwargs = _dequantized_gguf_kwargs(gguf_file) if gguf_file else {}
        self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype), **kwargs).eval()
        self.load_s = time.perf_counter() - started
        self.dtype = dtype
        self.batch_size = batch_size
        self.strategy = strategy
        self.name = "transformers" if strategy == "static" else "transformers-cb"
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

    def _run_static(self, requests, batch_size: int) -> None:
        by_length = sorted(requests, key=lambda r: (r.prompt_len, r.output_len))
        for first in range(0, len(by_length), batch_size):
            self._generate_batch(by_length[first:first + batch_size])

    def _run_continuous(self, requests, batch_size: int) -> None:
        import torch
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        generation_config = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in requests),
                                             eos_token_id=-1, pad_token_id=self.pad_token_id)
        longest = max(r.prompt_len + r.output_len for r in requests)
        cb_config = ContinuousBatchingConfig(max_requests_per_batch=batch_size,
                                             max_batch_tokens=max(2048, max(r.prompt_len for r in requests)),
                                             page_size=16,
                                             num_blocks=batch_size * (-(-longest // 16) + 1))
        manager = self.model.init_continuous_batching(generation_config=generation_config,
                                                      continuous_batching_config=cb_config)
        with torch.inference_mode():
            manager.start()
            try:
                for index, request in enumerate(requests):
                    manager.add_request(request.prompt_token_ids, request_id=f"r{index}",
                                        max_new_tokens=request.output_len, eos_token_id=-1)
                produced = self._collect(manager, len(requests))
            finally:
                manager.stop(block=True)
        for index, request in enumerate(requests):
            if produced.get(f"r{index}") != request.output_len:
                raise RuntimeError(f"transformers continuous batching produced {produced.get(f'r{index}')} "
                                   f"tokens for a request that asked for {request.output_len}")

    @staticmethod
    def _collect(manager, num_requests: int) -> dict[str, int]:
        produced: dict[str, int] = {}
        while len(produced) < num_requests:
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped early")
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"transformers continuous batching failed: {result.error}")
                produced[result.request_id] = len(result.generated_tokens)
        return produced

    def run(self, workload: Workload) -> ThroughputResult:
        batch_size = self.batch_size or len(workload.requests)
        started = time.perf_counter()
        if self.strategy == "static":
            self._run_static(workload.requests, batch_size)
            notes = f"{self.dtype}, length-sorted static batches of {batch_size}, left padding"
        else:
            self._run_continuous(workload.requests, batch_size)
            notes = f"{self.dtype}, transformers continuous batching, up to {batch_size} requests"
        elapsed_s = time.perf_counter() - started
        return ThroughputResult(self.name, workload.name, len(workload.requests), workload.num_prompt_tokens,
                               workload.num_output_tokens, elapsed_s, self.load_s, notes=notes)


def _dequantized_gguf_kwargs(gguf_file: str) -> dict[str, Any]:
    """`from_pretrained` arguments that unpack a GGUF file into plain tensors of the asked dtype.

    Recent transformers keep GGUF blocks packed and compute them with float32 kernels (casting a
    bfloat16 model at every matmul); the reference computes the dequantized weights at kvserve's
    dtype instead, as older versions always did."""
    try:
        from transformers.utils.quantization_config import GgufConfig
    except ImportError:
        return {"gguf_file": gguf_file}
    return {"gguf_file": gguf_file, "quantization_config": GgufConfig(gguf_file=gguf_file, dequantize=True)}


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python's low-level API, batched like its server.

    Up to `max_batch` sequences decode together, each in its own sequence slot of
    its own KV stream: every `llama_decode` call carries one token per decoding
    sequence plus chunks of waiting prompts (at most `n_batch` tokens), a finished
    sequence's cells are cleared and the next request takes its slot, and each
    next token is the argmax of its logits (greedy, EOS ignored, as kvserve runs
    the workloads). With `dtype` the GGUF is first re-stored at that precision
    (`gguf_export`), so llama.cpp computes with the weights kvserve computes with;
    without it llama.cpp runs the file as stored (e.g. Q4_1).

    `extra_buffers` keeps llama.cpp's default "extra" buffer types (weights
    repacked for its fastest CPU kernels). Their AMX repacking crashes on some
    Sapphire Rapids virtual machines (llama.cpp issue 20824); `kvserve bench
    compare` runs each engine in its own process and, when the default crashes,
    retries with `extra_buffers=False` (the plain CPU kernels) and says so.
    `n_threads` defaults to torch's thread count, the threads kvserve uses.
    """

    name = "llama.cpp"

    def __init__(self, model_path: str, dtype: str | None = None, max_batch: int = 32, n_batch: int = 2048,
                 n_threads: int | None = None, extra_buffers: bool = True) -> None:
        import llama_cpp

        if not model_path.endswith(".gguf"):
            raise ValueError("llama.cpp needs a .gguf model file")
        self.lib = llama_cpp
        started = time.perf_counter()
        if dtype is not None:
            from kvserve.bench.gguf_export import export_gguf
            model_path = export_gguf(model_path, dtype)
        self.precision = dtype or "as stored"
        _silence_logs(llama_cpp)
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = extra_buffers
        self.extra_buffers = extra_buffers
        self.model = llama_cpp.llama_model_load_from_file(model_path.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.max_batch, self.n_batch = max_batch, n_batch
        # As many threads as torch uses (llama-cpp-python's own default is half the cores).
        self.n_threads = n_threads or _torch_threads()
        self.ctx, self.ctx_cells = None, 0
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.last_output_token_ids: list[list[int]] = []  # per request of the last run, in order
        self.load_s = time.perf_counter() - started

    def _context(self, cells: int):
        """A context of `cells` KV cells in all (reused when large enough)."""
        lib = self.lib
        if self.ctx is not None and self.ctx_cells >= cells:
            lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
            return self.ctx
        if self.ctx is not None:
            lib.llama_free(self.ctx)
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = cells, self.n_batch, min(self.n_batch, 512)
        # One KV stream per sequence slot (n_ctx / n_seq_max cells each): in a unified cache
        # every token's attention would scan the cells of all sequences.
        params.n_seq_max, params.kv_unified = self.max_batch, False
        params.n_threads = params.n_threads_batch = self.n_threads
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {cells} cells")
        self.ctx_cells = cells
        return self.ctx

    def _batch_entries(self, slots: dict[int, "_Sequence"]) -> tuple[list[tuple[int, int, int, bool]], list[int]]:
        """This step's (token, position, sequence, wants logits) entries and, in the order of
        their logit rows, the sequences that get a next token."""
        entries, owners = [], []
        for seq, state in slots.items():  # one token per decoding sequence first
            if state.prefilled == state.request.prompt_len:
                entries.append((state.last_token, state.request.prompt_len + state.produced - 1, seq, True))
                owners.append(seq)
        for seq, state in slots.items():  # then prompt chunks, as many tokens as fit
            prompt = state.request.prompt_token_ids
            while state.prefilled < len(prompt) and len(entries) < self.n_batch:
                last = state.prefilled == len(prompt) - 1
                entries.append((prompt[state.prefilled], state.prefilled, seq, last))
                state.prefilled += 1
                if last:
                    owners.append(seq)
        return entries, owners

    def _fill_batch(self, entries: list[tuple[int, int, int, bool]]) -> None:
        batch = self.batch
        for i, (token, pos, seq, wants_logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, wants_logits
        batch.n_tokens = len(entries)

    def _argmax(self, ctx, index: int) -> int:
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(ctx, index), shape=(self.n_vocab,))
        return int(logits.argmax())

    def run(self, workload: Workload) -> ThroughputResult:
        longest = max(r.prompt_len + r.output_len for r in workload.requests)
        ctx = self._context(self.max_batch * longest)
        memory = self.lib.llama_get_memory(ctx)
        started = time.perf_counter()
        waiting = [_Sequence(request) for request in workload.requests][::-1]
        finished: list[_Sequence] = []
        slots: dict[int, _Sequence] = {}
        while waiting or slots:
            for seq in range(self.max_batch):
                if seq not in slots and waiting:
                    slots[seq] = waiting.pop()
            entries, owners = self._batch_entries(slots)
            self._fill_batch(entries)
            if self.lib.llama_decode(ctx, self.batch) != 0:
                raise RuntimeError("llama_decode failed")
            logit_rows = [i for i, entry in enumerate(entries) if entry[3]]
            for seq, row in zip(owners, logit_rows):
                state = slots[seq]
                state.last_token = self._argmax(ctx, row)
                state.output_token_ids.append(state.last_token)
                if state.produced >= state.request.output_len:
                    self.lib.llama_memory_seq_rm(memory, seq, -1, -1)
                    finished.append(slots.pop(seq))
        elapsed_s = time.perf_counter() - started
        by_request = {id(state.request): state.output_token_ids for state in finished}
        self.last_output_token_ids = [by_request[id(request)] for request in workload.requests]
        return ThroughputResult(self.name, workload.name, len(workload.requests), workload.num_prompt_tokens,
                               workload.num_output_tokens, elapsed_s, self.load_s,
                               notes=f"weights {self.precision}, batches of up to {self.max_batch} sequences, "
                                     f"{self.n_threads} threads, "
                                     f"{'repacked (extra) buffers' if self.extra_buffers else 'plain CPU buffers'}")

    def __del__(self) -> None:
        lib = getattr(self, "lib", None)
        if lib is None:
            return
        if getattr(self, "ctx", None):
            lib.llama_free(self.ctx)
        if getattr(self, "batch", None) is not None:
            lib.llama_batch_free(self.batch)
        if getattr(self, "model", None):
            lib.llama_model_free(self.model)


def _torch_threads() -> int:
    try:
        import torch
        return torch.get_num_threads()
    except ImportError:
        return os.cpu_count() or 1


_log_sink: list = []  # keeps the ctypes callback alive while llama.cpp holds it


def _silence_logs(llama_cpp) -> None:
    """llama.cpp logs every tensor and context it loads to stderr; the bench's table is the output."""
    if not _log_sink:
        _log_sink.append(llama_cpp.llama_log_callback(lambda level, text, user_data: None))
        llama_cpp.llama_log_set(_log_sink[0], None)


@dataclass
class _Sequence:
    """One request in a llama.cpp sequence slot."""

    request: Any
    prefilled: int = 0
    last_token: int = 0
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def produced(self) -> int:
        return len(self.output_token_ids)
