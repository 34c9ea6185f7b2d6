"""ModelRunner: turns one SchedulerOutput into sampled tokens.

Per step: apply the scheduler's diff to the persistent `InputBatch`, perform
the step's copy-on-write block copies on the KV tensors of their group, run
the model over the flattened batch, compute logits only for requests whose
scheduled tokens reach their last known token, sample, and record the
sampled tokens in the batch (the next step may feed them back as async
placeholders).
"""
from __future__ import annotations

import functools
import logging
import os

import numpy as np
import torch

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.errors import ConfigError
from kvserve.native.config import KernelConfig
from kvserve.kv_cache.interface import KVCacheConfig, KVCacheSpec, StateSpec
from kvserve.kv_cache.layout import StatePoolSizing, kv_bytes_wanted
from kvserve.model.attention import AttentionMetadata, StateMetadata
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from kvserve.model.quantized import holds_quantized_weights
from kvserve.model.tokenizer_files import load_tokenizer
from kvserve.sample.rejection_sampler import verify_drafts
from kvserve.sample.sampler import Sampler, SamplingTensors, argmax_token_ids, make_generator
from kvserve.sampling_params import SamplingParams
from kvserve.messages import ModelRunnerOutput, SchedulerOutput
from kvserve.worker.draft_model import DraftModelProposer
from kvserve.worker.input_batch import InputBatch, PreparedBatch
from kvserve.worker.kv_tensors import KVHugePageGrowth, allocate_kv_caches, copy_kv_blocks, highest_block_id
from kvserve.sample.logits_constraints import LogitsConstraints, PendingMasks
from kvserve.worker.prompt_logprobs import PromptLogprobsPlan, gather_prompt_logprobs, plan_prompt_logprobs

logger = logging.getLogger(__name__)

# CPU default for the KV pool when no size is given: room for every sequence
# at full length, but never more than this nor a quarter of free RAM.
CPU_DEFAULT_KV_CAP_BYTES = 2 << 30
CUDA_ACTIVATION_RESERVE_FRACTION = 0.1


class ModelRunner:
    """Owns the model, its KV tensors and the per-request state of one rank.

    The model's kernels (attention backend, fused ops, weight packing) are chosen
    once, at `load_model`, from `kernel_config` (default: all allowed)."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, device: str = "cpu",
                 scheduler_config: SchedulerConfig | None = None, seed: int = 0,
                 tp_rank: int = 0, tp_size: int = 1, kernel_config: KernelConfig | None = None,
                 draft_model_config=None) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config or SchedulerConfig(max_model_len=model_config.max_model_len)
        self.device = torch.device(device)
        self.seed = seed
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.kernel_config = kernel_config or KernelConfig()
        self.model = None
        self.kv_cache_config: KVCacheConfig | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.kv_huge_pages: KVHugePageGrowth | None = None
        # Why the KV pool has its size (for the start-up log line); None where not known.
        self.kv_memory_note: str | None = None
        self.input_batch: InputBatch | None = None
        self.sampler = None
        self.logits_constraints = LogitsConstraints(model_config, load_tokenizer, self.device, self.kernel_config)
        # SchedulerOutput does not carry a request's EOS id; min_tokens blocks the
        # model's (the engine's default EOS for every request).
        eos_token_ids = model_config.eos_token_ids
        self._eos_token_id = eos_token_ids[0] if eos_token_ids else None
        # Requests of a failed step: skipped until the engine reports them finished.
        self._failed_req_ids: set[str] = set()
        self.drafter: DraftModelProposer | None = None
        if draft_model_config is not None:
            self.drafter = DraftModelProposer(
                draft_model_config, self.scheduler_config.speculative_config.num_speculative_tokens,
                self.device, self.max_model_len)

    @functools.cached_property
    def kv_cache_dtype(self) -> str:
        """What the target's KV cache holds (`CacheConfig.kv_cache_dtype`; "auto": float16 over
        weights held quantized, else the model's dtype)."""
        return self._kv_dtype_of(self.model_config)

    def _kv_dtype_of(self, model_config: ModelConfig) -> str:
        quantized = holds_quantized_weights(model_config, self.device, self.kernel_config)
        return self.cache_config.kv_dtype_for(model_config.dtype, weights_quantized=quantized)

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    @property
    def num_step_threads(self) -> int:
        """The threads a small step keeps busy: the native decoder's (once a step built it;
        it keeps to one for small layers), else torch's."""
        native = getattr(self.model, "native_decoder", None)
        return native.num_threads if native is not None else torch.get_num_threads()

    # ---- set-up -----------------------------------------------------------

    def load_model(self) -> None:
        torch.manual_seed(self.seed)
        if self.tp_rank == 0:
            logger.info("KV cache: %s (kv_cache_dtype %s)", self.kv_cache_dtype, self.cache_config.kv_cache_dtype)
        self.model = load_model(self.model_config, device=str(self.device), tp_rank=self.tp_rank,
                                tp_size=self.tp_size, kernel_config=self.kernel_config,
                                kv_cache_dtype=getattr(torch, self.kv_cache_dtype))
        if self.model.kernels.packed_weights and self.model.pack_linear_weights():
            logger.debug("linear weights packed for oneDNN")
        if self.drafter is not None:
            self.drafter.load_model(self.kernel_config, self._kv_dtype_of(self.drafter.model_config))
        self.sampler = Sampler()

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        """The target's KV layers, then the draft model's (if any)."""
        specs = self.model.kv_cache_specs(self.cache_config.block_size, self.kv_cache_dtype,
                                          sliding_window_kv=self.cache_config.sliding_window_kv)
        if self.drafter is not None:
            specs.update(self.drafter.kv_cache_specs(self.cache_config.block_size,
                                                     self.cache_config.sliding_window_kv))
        if self.scheduler_config.speculative_config is not None and any(
                isinstance(spec, StateSpec) for spec in specs.values()):
            # A rejected draft would leave its tokens in the recurrent state.
            raise ConfigError("speculative decoding is not supported for models with recurrent-state layers")
        return specs

    def available_kv_memory_bytes(self) -> int:
        """Bytes for the KV pool: the configured size, else a device-dependent default.

        CUDA: `gpu_memory_utilization` of the device, minus what is in use,
        minus a reserve for activations. CPU: enough for max_num_seqs
        sequences of max_model_len tokens (and a hybrid's state pool,
        `kv_bytes_wanted`), capped at 2 GiB and a quarter of the free RAM
        (`default_cpu_kv_bytes`); `kv_memory_note` says which.
        """
        if self.cache_config.kv_cache_memory_bytes is not None:
            self.kv_memory_note = "set by kv_cache_memory"
            return self.cache_config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            free_bytes, total_bytes = torch.cuda.mem_get_info(self.device)
            budget = free_bytes - total_bytes * (1.0 - self.cache_config.gpu_memory_utilization)
            return max(int(budget * (1.0 - CUDA_ACTIVATION_RESERVE_FRACTION)), 0)
        sizing = StatePoolSizing(max_num_seqs=self.scheduler_config.max_num_seqs,
                                 max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
                                 enable_caching=self.cache_config.enable_prefix_caching)
        wanted = kv_bytes_with_null_block(self.get_kv_cache_specs(), self.max_model_len, sizing)
        free = _free_ram_bytes()
        chosen, bound = default_cpu_kv_bytes(wanted, free)
        self.kv_memory_note = (f"free memory {free / 2**20:.0f} MiB; {self.scheduler_config.max_num_seqs} "
                               f"sequences x {self.max_model_len} tokens want {wanted / 2**20:.0f} MiB; "
                               f"sized by {bound}; --kv-cache-memory sets it")
        return chosen

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.kv_cache_config = kv_cache_config
        self.kv_caches = allocate_kv_caches(kv_cache_config, self.get_kv_cache_specs(), self.device)
        if self.device.type == "cpu":
            self.kv_huge_pages = KVHugePageGrowth(self.kv_caches)
        self.model.bind_kv_cache_config(kv_cache_config)
        if self.drafter is not None:
            self.drafter.bind_kv_cache_config(kv_cache_config)
        group_specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
        self.input_batch = InputBatch(group_specs, self.max_model_len,
                                      max_num_rows=min(self.scheduler_config.max_num_seqs, 256))

    # ---- one step -----------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. If it fails, its requests are skipped by later steps (the
        engine finishes them) so that steps already scheduled can still run."""
        try:
            return self._execute_model(scheduler_output)
        except Exception:
            self._failed_req_ids.update(scheduler_output.num_scheduled_tokens)
            raise

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        batch = self.input_batch
        batch.apply_scheduler_output(scheduler_output, self._make_generator)
        if self.kv_huge_pages is not None:
            self.kv_huge_pages.note_blocks(highest_block_id(scheduler_output))
        self._failed_req_ids.difference_update(scheduler_output.finished_req_ids)
        if self.drafter is not None:
            self.drafter.forget(scheduler_output.finished_req_ids)
        if scheduler_output.kv_cache_block_copies:
            self._apply_block_copies(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput.make_empty()
        draft_token_ids = None
        if self.drafter is not None:
            draft_token_ids = self.drafter.fill_placeholders(scheduler_output.scheduled_spec_decode_tokens)
        prepared = batch.prepare(scheduler_output, self._failed_req_ids, draft_token_ids)
        sampled_token_ids, logprobs_by_req, prompt_logprobs = (
            self._forward_and_sample(prepared) if prepared.num_reqs else ({}, {}, {}))
        if self.drafter is not None and prepared.num_reqs:
            self.drafter.propose(batch, prepared, sampled_token_ids, scheduler_output.draft_proposal_req_ids,
                                 self.kv_caches, self._build_attention_metadata)
        skipped = [rid for rid in scheduler_output.num_scheduled_tokens if rid in self._failed_req_ids]
        return self._make_output(prepared.req_ids + skipped, sampled_token_ids, logprobs_by_req, prompt_logprobs)

    def _forward_sampled_rows(self, prepared: PreparedBatch, extra_rows: np.ndarray | None = None
                              ) -> torch.Tensor | None:
        """Run the model over the step; the hidden rows of the requests to sample, then
        those of `extra_rows` (None when there are none of either)."""
        hidden = self.model.forward(
            self._to_device(prepared.input_ids),
            self._to_device(prepared.positions),
            self._build_attention_metadata(prepared),
            self.kv_caches,
        )
        rows = prepared.logits_indices if extra_rows is None else np.concatenate([prepared.logits_indices, extra_rows])
        if not len(rows):
            return None
        return hidden[self._to_device(rows)]

    def _forward_sampled_logits(self, prepared: PreparedBatch,
                                pending_masks: PendingMasks | None = None) -> torch.Tensor | None:
        """Run the model over the step; the logits of the requests to sample (None when
        no request reached its last token). The model's LM head may apply the step's
        grammar masks itself (`pending_masks.head_mask`)."""
        if not prepared.sampled_req_ids:
            self._forward_sampled_rows(prepared)
            return None
        return self.model.forward_logits(
            self._to_device(prepared.input_ids),
            self._to_device(prepared.positions),
            self._build_attention_metadata(prepared),
            self.kv_caches,
            self._to_device(prepared.logits_indices),
            head_mask=None if pending_masks is None else pending_masks.head_mask,
        )

    def _forward_and_sample(self, prepared: PreparedBatch) -> tuple[dict[str, list[int]], dict, dict]:
        """Run the model; for each request that reached its last token, sample one
        token or verify its drafts (then 1 to 1 + drafts tokens). Also returns the
        prompt logprobs the step computed, by request (`PromptLogprobsChunk`)."""
        pending_masks = self._start_masks(prepared)
        prompt_plan = plan_prompt_logprobs(prepared, self.input_batch.states)
        prompt_logprobs = {}
        if prompt_plan is None:
            logits = self._forward_sampled_logits(prepared, pending_masks)
        else:
            logits, prompt_logprobs = self._forward_scoring_prompts(prepared, prompt_plan)
        if logits is None:
            return {}, {}, prompt_logprobs
        sampled_token_ids, logprobs_by_req = self._sample(logits, prepared, pending_masks)
        self._record_sampled(sampled_token_ids)
        return sampled_token_ids, logprobs_by_req, prompt_logprobs

    def _forward_scoring_prompts(self, prepared: PreparedBatch, plan: PromptLogprobsPlan
                                 ) -> tuple[torch.Tensor | None, dict]:
        """`_forward_sampled_logits` with the logits of the plan's prompt rows too (the LM
        head runs on both sets of rows at once; the grammar masks are applied after it)."""
        num_sampled = len(prepared.logits_indices)
        logits = self.model.forward_logits(
            self._to_device(prepared.input_ids),
            self._to_device(prepared.positions),
            self._build_attention_metadata(prepared),
            self.kv_caches,
            self._to_device(np.concatenate([prepared.logits_indices, plan.rows])),
        )
        prompt_logprobs = gather_prompt_logprobs(logits[num_sampled:], plan)
        return (logits[:num_sampled] if num_sampled else None), prompt_logprobs

    def _start_masks(self, prepared: PreparedBatch) -> PendingMasks | None:
        """Start filling the step's grammar masks, to overlap them with its forward."""
        sampled_req_ids = prepared.sampled_req_ids
        if not sampled_req_ids:
            return None
        drafts = ([prepared.draft_token_ids.get(rid, []) for rid in sampled_req_ids]
                  if prepared.draft_token_ids else None)
        return self.logits_constraints.start_masks([self.input_batch.states[rid] for rid in sampled_req_ids], drafts)

    def _sample(self, logits: torch.Tensor, prepared: PreparedBatch,
                pending_masks: PendingMasks | None = None) -> tuple[dict[str, list[int]], dict]:
        """Tokens and logprobs (one list per request) from the sampled rows' logits."""
        sampled_req_ids = prepared.sampled_req_ids
        states = [self.input_batch.states[rid] for rid in sampled_req_ids]
        if not prepared.draft_token_ids and all(s.takes_argmax for s in states):
            # The greedy fast path: nothing to apply, no sampling tensors to build.
            return {rid: [t] for rid, t in zip(sampled_req_ids, argmax_token_ids(logits))}, {}
        if prepared.draft_token_ids:
            drafts = [prepared.draft_token_ids.get(rid, []) for rid in sampled_req_ids]
            logits = self.logits_constraints.apply(logits, states, drafts, pending_masks)
            draft_probs = None
            if self.drafter is not None:
                draft_probs = [self.drafter.draft_probs_for(rid, draft) for rid, draft in zip(sampled_req_ids, drafts)]
            sampling_tensors = self._sampling_tensors(sampled_req_ids, drafts)
            verified = verify_drafts(self.sampler, logits, sampling_tensors, drafts, draft_probs)
            first_rows = np.cumsum([0] + [1 + len(d) for d in drafts[:-1]]).tolist()
            missed = self.logits_constraints.outside_masks(pending_masks, verified.token_ids, first_rows)
            if missed:
                logits = self.logits_constraints.mask_again(logits, pending_masks, missed)
                verified = verify_drafts(self.sampler, logits, sampling_tensors, drafts, draft_probs)
            self.logits_constraints.advance(states, verified.token_ids)
            return (dict(zip(sampled_req_ids, verified.token_ids)),
                    {rid: lp for rid, lp in zip(sampled_req_ids, verified.logprobs) if lp is not None})
        logits = self.logits_constraints.apply(logits, states, pending=pending_masks)
        sampling_tensors = self._sampling_tensors(sampled_req_ids)
        sampler_output = self.sampler.sample(logits, sampling_tensors)
        missed = (self.logits_constraints.outside_masks(pending_masks, [[t] for t in sampler_output.token_ids])
                  if pending_masks is not None else [])
        if missed:
            logits = self.logits_constraints.mask_again(logits, pending_masks, missed)
            sampler_output = self.sampler.sample(logits, sampling_tensors)
        sampled_token_ids = {rid: [int(t)] for rid, t in zip(sampled_req_ids, sampler_output.token_ids)}
        self.logits_constraints.advance(states, list(sampled_token_ids.values()))
        logprobs_by_req = {}
        if sampler_output.logprobs is not None:
            logprobs_by_req = {rid: [lp] for rid, lp in zip(sampled_req_ids, sampler_output.logprobs)
                               if lp is not None}
        return sampled_token_ids, logprobs_by_req

    def _record_sampled(self, sampled_token_ids: dict[str, list[int]]) -> None:
        """Append the step's tokens to the batch (a later step may feed them back)."""
        for req_id, token_ids in sampled_token_ids.items():
            for token_id in token_ids:
                self.input_batch.append_sampled_token(req_id, token_id)

    def _apply_block_copies(self, scheduler_output: SchedulerOutput) -> None:
        copy_kv_blocks(self.kv_caches, self.kv_cache_config, scheduler_output.kv_cache_block_copies)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A step input as a tensor on the runner's device (on the CPU a view of the array)."""
        tensor = torch.from_numpy(array)
        return tensor if self.device.type == "cpu" else tensor.to(self.device)

    def _build_attention_metadata(self, prepared: PreparedBatch) -> list:
        to_device = self._to_device
        query_start_loc = to_device(prepared.query_start_loc)
        seq_lens = to_device(prepared.seq_lens)
        req_index = None if prepared.req_index is None else to_device(prepared.req_index)
        max_query_len = int(prepared.num_scheduled_tokens.max())
        max_seq_len = int(prepared.seq_lens.max())
        group_specs = [group.kv_cache_spec for group in self.kv_cache_config.kv_cache_groups]
        return [
            StateMetadata.build(spec, prepared.num_scheduled_tokens, prepared.num_computed_tokens, block_table,
                                self.device)
            if isinstance(spec, StateSpec) else
            AttentionMetadata(
                query_start_loc=query_start_loc, seq_lens=seq_lens,
                block_table=to_device(block_table), slot_mapping=to_device(slot_mapping),
                max_query_len=max_query_len, max_seq_len=max_seq_len, spec=spec, req_index=req_index,
                num_draft_tokens=prepared.total_draft_tokens,
            )
            for spec, block_table, slot_mapping in zip(group_specs, prepared.block_tables,
                                                       prepared.slot_mappings)
        ]

    def _sampling_tensors(self, req_ids: list[str], drafts: list[list[int]] | None = None):
        """One row per request, or with `drafts` one row per draft position plus one
        (row j of a request sees its first j draft tokens as outputs)."""
        states = [self.input_batch.states[rid] for rid in req_ids]
        if drafts is None:
            rows = [(s, s.output_token_ids) for s in states]
        else:
            rows = [(s, s.output_token_ids + draft[:j]) for s, draft in zip(states, drafts)
                    for j in range(len(draft) + 1)]
        return SamplingTensors.from_params(
            [s.sampling_params for s, _ in rows],
            output_token_ids=[outputs for _, outputs in rows],
            prompt_token_ids=[s.prompt_token_ids for s, _ in rows],
            generators=[s.generator for s, _ in rows],
            device=self.device,
            eos_token_ids=[self._eos_token_id] * len(rows),
        )

    def _make_generator(self, sampling_params: SamplingParams):
        return None if sampling_params.seed is None else make_generator(sampling_params.seed, self.device)

    @staticmethod
    def _make_output(req_ids: list[str], sampled_token_ids: dict[str, list[int]],
                     logprobs_by_req: dict, prompt_logprobs: dict | None = None) -> ModelRunnerOutput:
        tokens = [list(sampled_token_ids.get(rid, [])) for rid in req_ids]
        logprobs = None
        if logprobs_by_req:
            logprobs = [list(logprobs_by_req.get(rid, [])) for rid in req_ids]
        return ModelRunnerOutput(req_ids=list(req_ids), sampled_token_ids=tokens, logprobs=logprobs,
                                 prompt_logprobs=prompt_logprobs or None)


def kv_bytes_with_null_block(specs: dict[str, KVCacheSpec], max_model_len: int, sizing: StatePoolSizing) -> int:
    """`kv_bytes_wanted` plus the attention pool's null block (block 0, never handed out), without
    which the pool holds one block less than every sequence at full length needs."""
    null_block = sum(spec.page_size_bytes for spec in specs.values() if not isinstance(spec, StateSpec))
    return kv_bytes_wanted(specs, max_model_len, sizing) + null_block


def default_cpu_kv_bytes(wanted: int, free: int) -> tuple[int, str]:
    """The CPU KV pool's default size and what bounds it: `wanted` (every sequence at full
    length), at most CPU_DEFAULT_KV_CAP_BYTES and a quarter of the `free` memory (the weights,
    activations and other processes need the rest)."""
    chosen = int(min(wanted, CPU_DEFAULT_KV_CAP_BYTES, free // 4))
    if chosen == wanted:
        return chosen, "every sequence at full length"
    if chosen == CPU_DEFAULT_KV_CAP_BYTES:
        return chosen, "the default cap"
    return chosen, "a quarter of the free memory"


def _free_ram_bytes() -> int:
    """Memory the machine can give without swapping: MemAvailable (free pages plus reclaimable
    cache, such as the pages of mapped weight files), else the free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30
