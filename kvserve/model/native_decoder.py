"""The decoder stack of a small step in one native call (csrc/decoder/fused_decoder.c).

At batch one a decode step through the torch path makes about ten Python op
calls per layer, each a dispatch and, for the native kernels, a parallel region
of its own: for a 135M model that overhead outweighs the matmuls. For steps of
up to `SMALL_STEP_TOKENS` tokens, or `MAX_TOKENS` where every projection is
held as its GGUF file stores it (csrc/linear/gguf_rows.c, whose rows take any step size),
quantized and runs the panel GEMM (csrc/linear/quant_gemm.c) from its `panel_rows`
on, or is float32 packed into panels (csrc/linear/f32_gemm.c) (batched decode, mixed
serving steps), `NativeDecoder` hands the whole stack
(every layer and the final norm) to one C call that reuses the per-op kernels
inside one parallel region; steps of many tokens split attention by tokens.

It takes what it covers and nothing else; `DecoderModel.forward` keeps the
torch path for any step it declines (None):
- model: CPU, float32 or bfloat16, every projection GGUF blocks as stored (up to
  `MAX_PARTS` tensors side by side), block-quantized or a plain
  float32 or bfloat16 matrix, SiLU or GELU(tanh) gates, head size <= 256, at
  most 32 query heads per KV head; under tensor parallelism no bias on the O
  and down projections (see below); mixture-of-experts MLPs (`SparseMoeBlock`:
  softmax routing, a gated shared expert, gpt-oss's softmax over the top k and biased
  clamped-SwiGLU experts; not under tensor parallelism); attention sinks (gpt-oss);
  Q/K norms per head or over the whole projection (OLMoE);
- step: at most `max_tokens` tokens (above), every KV-cache group a block table (not a
  circular ring, whose read-before-write order the kernel does not follow),
  caches float32 or bfloat16 and contiguous.
Hybrids with Gated DeltaNet layers (Qwen3.5 dense; `NativeDeltaNet`) or Mamba-2 layers
(Granite 4 without routed experts; `NativeMamba`) run in decode steps only (every request one
token): each such layer reads a request's state slots (the worker's float32 state tensors) at
`StateMetadata.read_slot`, computes the new state in the slot its first write names and copies
it to its other write slots (snapshots); attention layers may gate their output (Qwen3-Next's
sigmoid gate), rotate part of each head (partial RoPE) or none (Granite's NoPE). Other state
mixers are declined.
`ModelKernels.native_decoder` (KVSERVE_NATIVE_DECODER=0 in `KernelConfig`) switches it off.

Under tensor parallelism each rank's call runs its shards (QKV and gate/up by
output rows, O and down by input columns) and sums the O and down outputs over
the ranks from inside the call: thread 0 all-reduces the buffer the call writes
those outputs to (`_TensorParallelReduce`: through shared memory where every rank
is on this host, csrc/comm/shm_all_reduce.c; else a callback into Python over gloo),
while the rank's other threads wait at the barrier after it. The
step stays one call (a split into an attention call and an MLP call per layer
would enter two parallel regions per layer and keep Python in the layer loop).
The embedding lookup (vocabulary-sharded, itself all-reduced) and the LM head
(whose logits the caller gathers) stay outside the call on such ranks.

The call keeps its activations in float32 whatever the model's dtype; a bfloat16
model's matmuls round their input rows to bfloat16 (csrc/linear/bf16_rows.c, on the
path `ModelKernels.bf16_isa`), and the output is cast back to bfloat16.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import time

import torch

from kvserve.kv_cache.interface import CircularBufferSpec
from kvserve.model.attention import AttentionMetadata, StateMetadata
from kvserve.model.native_description import ModelDescription, NativeDeclined
from kvserve.model.shm_all_reduce import SharedMemoryAllReduce
from kvserve.native import cpu_kernels, dispatch
from kvserve.native.abi import (ALL_REDUCE_FN, MAX_GROUPS, NativeDeltaNet, NativeLogits, NativeMamba, NativeStep,
                                NativeTokenMask)
from kvserve.native.config import KernelConfig
from kvserve.native.isa import ISA_CODES
from kvserve.sample.structured.grammar_mask import HeadMask

logger = logging.getLogger(__name__)

# Steps up to this many tokens (decode, short drafts) run natively; up to MAX_TOKENS
# (batched decode, mixed serving steps with short prefill chunks) where every projection
# takes the panel GEMM from `panel_rows` tokens on. Longer prefills keep the per-op path
# and its dense GEMM.
SMALL_STEP_TOKENS = 8
MAX_TOKENS = 128
_PARALLEL_MIN_LAYER_BYTES = 256 * 1024

# The head waits at most this long for a grammar mask's fill (the mask thread always
# publishes, even when the fill fails: this bounds a bug, not a normal step); after it the
# logits come back unmasked and the runner masks them. Tests shorten it to force that path.
HEAD_WAIT_ENV = "KVSERVE_TEST_GRAMMAR_HEAD_WAIT_MS"
_MASK_TIMEOUT_NS = int(float(os.environ.get(HEAD_WAIT_ENV) or 2000) * 1_000_000)


def _widest_isa(kernel_config: KernelConfig | None, kernel: str) -> str | None:
    """The widest path of `kernel` that this build and CPU run, capped at
    `kernel_config.quant_isa` (KVSERVE_QUANT_ISA); None without the library."""
    config = kernel_config or KernelConfig()
    return dispatch.widest(kernel, config.quant_isa) if config.cpu_kernels else None


def bf16_isa(kernel_config: KernelConfig | None = None) -> str | None:
    """The path of the native decoder's bfloat16-weight matmul ("avx512": AVX512-BF16, "avx2",
    "portable"): the widest this build and CPU run, capped at `kernel_config.quant_isa`
    (KVSERVE_QUANT_ISA caps it as it caps the quantized kernel); None without the library."""
    return _widest_isa(kernel_config, "bf16")


def f32_gemm_isa(kernel_config: KernelConfig | None = None) -> str | None:
    """The path of the float32 panel matmul (csrc/linear/f32_gemm.c: "avx512": AVX-512F, "avx2":
    AVX2 + FMA, "portable"), chosen as `bf16_isa` chooses its own; None without the library."""
    return _widest_isa(kernel_config, "f32_gemm")


def attention_isa(kernel_config: KernelConfig | None = None) -> str | None:
    """The path of the paged attention kernel (csrc/attention/paged_attention.c: "avx512", "avx2" with
    F16C, "portable"), chosen as `bf16_isa` chooses its own; None without the library."""
    return _widest_isa(kernel_config, "attention")


# The phases of csrc/decoder/phase_timer.h, in its order.
PHASES = ("norms, residual adds, gate activation", "activation rounding", "QKV matmul",
          "attention (Q/K norms, RoPE, K/V write, paged attention)", "O matmul", "gate/up matmul", "down matmul",
          "LM head matmul", "barrier wait",
          "all-reduce (tensor parallel, thread 0)")


@contextlib.contextmanager
def phase_timing(num_threads: int):
    """Times the native calls made inside the block by phase (csrc/decoder/phase_timer.h) and
    fills the yielded dict on exit: "calls", and "threads", one {phase: seconds} per
    thread. Off outside such a block. Yields an empty dict without the library."""
    lib = cpu_kernels.load_library()
    result: dict = {}
    if lib is None:
        yield result
        return
    lib.kvserve_decoder_profile_enable(1)
    try:
        yield result
    finally:
        sums = (ctypes.c_double * (num_threads * len(PHASES)))()
        result["calls"] = int(lib.kvserve_decoder_profile_read(sums, num_threads))
        lib.kvserve_decoder_profile_enable(0)
        result["threads"] = [{name: sums[t * len(PHASES) + k] for k, name in enumerate(PHASES)}
                             for t in range(num_threads)]


def _as_int64(t: torch.Tensor) -> torch.Tensor:
    """`t` as a contiguous int64 tensor (itself when it is one: the runner's step inputs are)."""
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.long().contiguous()


class _TensorParallelReduce:
    """The all-reduce a tensor-parallel rank's call makes after its O and down projections:
    the call writes their partial sums to `buffer` and thread 0 calls `function(context,
    buffer, count)`. Where every rank of the group is on this host (and `shared_memory`)
    that is the C all-reduce over a shared segment (`SharedMemoryAllReduce`); otherwise a
    callback that sums `buffer[:count]` over the group with torch.distributed, as
    `RowParallelLinear` does on the per-op path. An exception cannot cross the C frame: it
    is kept in `error` and the callback returns 1 (the call then stops; see `raise_error`)."""

    def __init__(self, tp, num_elements: int, shared_memory: bool) -> None:
        self.group = tp.group
        self.buffer = torch.empty(num_elements, dtype=torch.float32)
        self.error: BaseException | None = None
        self.shared = SharedMemoryAllReduce.connect(tp.group, num_elements) if shared_memory else None
        if self.shared is not None:
            self.function, self.context = ALL_REDUCE_FN(self.shared.function), ctypes.addressof(self.shared.context)
        else:  # held here: the call keeps only its pointer
            self.function, self.context = ALL_REDUCE_FN(self._all_reduce), None

    def _all_reduce(self, context: int | None, buffer: int, count: int) -> int:
        try:
            torch.distributed.all_reduce(self.buffer[:count], group=self.group)
            return 0
        except BaseException as exc:  # KeyboardInterrupt too: re-raised once the call is back
            self.error = exc
            return 1

    def raise_error(self) -> None:
        if self.shared is not None:
            self.shared.raise_error()
        error, self.error = self.error, None
        raise error if error is not None else RuntimeError("the native decoder's all-reduce failed")


class NativeDecoder:
    """One model's layers, described once for the native call; `forward` runs a step.

    Holds its `ModelDescription` (kvserve/model/native_description.py), which holds every
    tensor the call points at (float32 norm weights, the quantized or plain projection
    weights) so none is freed under it."""

    def __init__(self, model) -> None:
        description = ModelDescription(model, MAX_TOKENS)
        self.model = model
        self._description = description  # holds every tensor and struct the call points at
        self._layers, self._desc, self._head = description.layers, description.model_desc, description.head
        self._state_mixers = description.state_mixers
        # Off by default for now. Stored GGUF weights split on every kernel path; on SmolLM2 (2
        # threads, alternating rounds in one process) it ran 0.63-0.76x when the machine was
        # calm and 1.3-2.4x when other work loaded it (barriers are what a loaded machine pays
        # for): the short rows' partial products cost more than the barriers they save. The
        # repacked weights' split changed greedy int8 trajectories (the structured-output
        # server test's JSON no longer closed within its token budget).
        self.fewer_barriers = False
        # Layers this small are not worth a second thread: the barriers between the
        # matmuls would cost more than the rows they share out.
        self.num_threads = torch.get_num_threads() if description.layer_bytes >= _PARALLEL_MIN_LAYER_BYTES else 1
        self._bound_caches: dict | None = None
        self._bound_tensors: list[torch.Tensor] = []
        self._step = NativeStep(rope_by_position=1)  # refilled by every step (the call is synchronous)
        self._rope_tables: list = []
        self._rope_freqs: list = []  # the frequencies the tables pointed at were built for
        self._rope_capacity = 0  # positions the tables pointed at hold
        # many-token steps only where the panel GEMM covers every projection, and short of
        # the steps the per-op path gives its dense GEMM
        self.max_tokens = max(min(MAX_TOKENS, description.gemm_rows - 1), SMALL_STEP_TOKENS) if description.all_panel \
            else SMALL_STEP_TOKENS
        self._token_index = torch.arange(self.max_tokens, dtype=torch.int64)
        # Wall time inside the native call, summed over calls (`kvserve bench host` reads them).
        self.num_calls = 0
        self.call_ns = 0
        self.num_routing_ties = 0  # steps handed back to the per-op path for a routing tie
        self._reduce: _TensorParallelReduce | None = None
        if model.tp.size > 1:
            self._reduce = _TensorParallelReduce(model.tp, self.max_tokens * self._desc.hidden,
                                                 model.kernels.shm_all_reduce)
            self._desc.reduce_buffer = self._reduce.buffer.data_ptr()
            self._desc.all_reduce, self._desc.reduce_ctx = self._reduce.function, self._reduce.context

    @property
    def fewer_barriers(self) -> bool:
        """Whether the call meets at fewer barriers a layer (off by default): the O and down
        projections split by input columns where their kernel allows, attention by query heads
        (each thread computing the QKV rows and writing the K/V its heads read) on steps of a few
        tokens. Off: every matmul split by output rows, the K/V written once (for A/B
        measurements, `kvserve bench profile --ab-fewer-barriers`)."""
        return bool(self._desc.fewer_barriers)

    @fewer_barriers.setter
    def fewer_barriers(self, on: bool) -> None:
        self._desc.fewer_barriers = int(on)

    MOE_SPLITS = ("auto", "rows", "experts")

    @property
    def moe_split(self) -> str:
        """How the threads share a MoE layer's chosen experts (fused_decoder.c's moe_mlp): "rows"
        (each expert's rows over the threads), "experts" (whole experts per thread, balanced by
        work) or "auto" (experts from 4 chosen experts a thread on). For tests and A/B runs: a
        row's result is the same either way."""
        moes = [layer.moe.contents for layer in self._layers if layer.moe]
        return self.MOE_SPLITS[moes[0].split] if moes else "auto"

    @moe_split.setter
    def moe_split(self, split: str) -> None:
        for layer in self._layers:
            if layer.moe:
                layer.moe.contents.split = self.MOE_SPLITS.index(split)

    @classmethod
    def for_model(cls, model) -> "NativeDecoder | None":
        """The native decoder for `model`, or None where the library is missing or it does not
        cover the model (whether the model wants one is `ModelKernels.native_decoder`)."""
        if cpu_kernels.load_library() is None:
            return None
        try:
            decoder = cls(model)
        except NativeDeclined as reason:
            logger.info("native decoder not used: %s", reason)
            return None
        logger.info("native decoder: steps of up to %d tokens run the %d layers in one call", decoder.max_tokens,
                    len(model.layers))
        return decoder

    def _bind_caches(self, kv_caches: dict[str, torch.Tensor], group_ids: list[int]) -> bool:
        """Point each layer at its KV cache (again only for another cache dict: a runner
        allocates its caches once and never swaps a tensor inside the dict); False when a
        cache is not one the kernel reads."""
        if kv_caches is self._bound_caches:
            return True
        self._bound_caches = None
        caches = [kv_caches[name] for name in self.model.layer_names]
        for i, (desc, cache, group) in enumerate(zip(self._layers, caches, group_ids)):
            desc.group = group
            if i in self._state_mixers:
                if not self._bind_states(self._state_mixers[i], cache):
                    return False
                continue
            if (cache.device.type != "cpu" or not cache.is_contiguous()
                    or not cpu_kernels.supports_kv_dtype(cache.dtype)):
                return False
            _, _, num_blocks, block_size, head_dim = cache.shape
            desc.k_cache, desc.v_cache = cache[0].data_ptr(), cache[1].data_ptr()
            desc.cache_head_stride = num_blocks * block_size * head_dim
            desc.block_size = block_size
            desc.kv_dtype = cpu_kernels.kv_dtype_code(cache.dtype)
            desc.attention_isa = ISA_CODES[self.model.kernels.attention_isa or "portable"]
        self._bound_caches, self._bound_tensors = kv_caches, caches  # held: never freed under the call
        return True

    @staticmethod
    def _bind_states(net: NativeDeltaNet | NativeMamba, cache: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Point a state layer at its slots (conv inputs, then the delta-rule or SSM state: the
        worker's tensors [slots, *shape], read and written in place); False unless float32,
        contiguous, on the CPU."""
        if not all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in cache):
            return False
        recurrent = "delta_states" if isinstance(net, NativeDeltaNet) else "ssm_states"
        net.conv_states = cache[0].data_ptr()
        setattr(net, recurrent, cache[1].data_ptr())
        return True

    # -- a step -----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata_by_group: list[AttentionMetadata],
                kv_caches: dict[str, torch.Tensor], group_ids: list[int],
                logits_rows: torch.Tensor | None = None,
                num_draft_tokens: int = 0,
                head_mask: HeadMask | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(The final norm's output [T, hidden], the LM head's logits [len(logits_rows), vocab]
        of the tokens `logits_rows` or None) for the tokens `input_ids` [T] (embedded inside the
        call where it holds the table); None when this step is not one the native call takes. The logits are None
        too when none are asked for or the LM head is not one the call runs.
        `num_draft_tokens` of the tokens (each with a logits row) are speculative drafts: the
        matmul kernels are those of the step without them (see `quantized.linear`'s `num_draft_rows`).
        A step where some token's top-k experts end in a tie of router logits is None too (the
        per-op path's torch.topk breaks such ties; it writes the same KV slots again).
        With `head_mask` the head applies that grammar mask once it is filled (see `HeadMask`;
        it sets `head_mask.applied` when it did)."""
        num_tokens = input_ids.shape[0]
        if not 0 < num_tokens <= self.max_tokens or len(metadata_by_group) > MAX_GROUPS:
            return None
        attention = [md for md in metadata_by_group if not isinstance(md, StateMetadata)]
        if any(isinstance(md.spec, CircularBufferSpec) or md.slot_mapping is None for md in attention):
            return None
        states = {g: md for g, md in enumerate(metadata_by_group) if isinstance(md, StateMetadata)}
        # state layers run in decode steps only: every request one token
        if any(md.max_query_len != 1 or md.read_slot.numel() != num_tokens for md in states.values()):
            return None
        if not self._bind_caches(kv_caches, group_ids):
            return None
        md0 = attention[0]
        table_row = _as_int64(md0.token_request_index())
        positions = _as_int64(positions)
        step = self._step
        step.num_tokens, step.num_draft_tokens, step.positions, step.table_row, step.token_index = (
            num_tokens, num_draft_tokens, positions.data_ptr(), table_row.data_ptr(), self._token_index.data_ptr())
        keep = [positions, table_row]
        for g, md in states.items():
            keep += self._point_at_state_slots(step, g, md)
        for g, md in enumerate(metadata_by_group):
            if g in states:
                continue
            table, slots = _as_int64(md.block_table), _as_int64(md.slot_mapping)
            keep += [table, slots]
            step.block_table[g], step.block_table_stride[g], step.slots[g] = (table.data_ptr(), table.stride(0),
                                                                              slots.data_ptr())
        self._point_at_rope_tables(step, md0.max_seq_len)
        step.token_ids = None
        if self._desc.embed.out:
            input_ids = _as_int64(input_ids)
            keep.append(input_ids)
            step.token_ids = input_ids.data_ptr()
            out = torch.empty(num_tokens, self._desc.hidden, dtype=torch.float32)
        else:
            hidden = self.model.embed(input_ids)
            out = hidden.float().contiguous().clone() if hidden.dtype != torch.float32 else hidden.contiguous()
        head, logits = self._logits_request(logits_rows, keep)
        mask = None if head is None else self._mask_request(head, head_mask, keep)
        started_ns = time.perf_counter_ns()
        failed = cpu_kernels.load_library().kvserve_decoder_forward_logits(
            ctypes.byref(self._desc), self._layers, ctypes.byref(step), out.data_ptr(),
            None if head is None else ctypes.byref(head), self.num_threads)
        self.call_ns += time.perf_counter_ns() - started_ns
        self.num_calls += 1
        if failed == 4:  # a tie at a token's top-k boundary: torch.topk's order decides it (see fused_decoder.c)
            self.num_routing_ties += 1
            return None
        if failed == 3:
            self._reduce.raise_error()
        if failed == 2:
            raise IndexError(f"a token id of {input_ids.tolist()} is outside the embedding table")
        if failed:
            raise MemoryError("the native decoder could not allocate its buffers")
        if mask is not None:
            head_mask.applied = bool(mask.applied)
            head_mask.wait_s, head_mask.mask_s = mask.wait_ns * 1e-9, mask.mask_ns * 1e-9
        del keep
        return out.to(self.model.norm.weight.dtype), None if logits is None else logits[:, :self.model.lm_head.vocab_size]

    @staticmethod
    def _point_at_state_slots(step: NativeStep, group: int, md: StateMetadata) -> list[torch.Tensor]:
        """Give the call state group `group`'s slots for a decode step (request r's one token is
        token r): the slot each reads, the slot its first write names (the state is computed
        there), and its other writes as copies. Returns the tensors pointed at."""
        read = _as_int64(md.read_slot)
        first: dict[int, int] = {}
        copies: list[tuple[int, int]] = []
        for req, slot in zip(md.write_req.tolist(), md.write_slot.tolist()):
            if req in first:
                copies.append((req, slot))
            else:
                first[req] = slot
        write = torch.tensor([first[r] for r in range(read.numel())], dtype=torch.int64)
        copy_token = torch.tensor([c[0] for c in copies] or [0], dtype=torch.int64)
        copy_slot = torch.tensor([c[1] for c in copies] or [0], dtype=torch.int64)
        step.state_read[group], step.state_write[group] = read.data_ptr(), write.data_ptr()
        step.state_copy_token[group], step.state_copy_slot[group] = copy_token.data_ptr(), copy_slot.data_ptr()
        step.state_copies[group] = len(copies)
        return [read, write, copy_token, copy_slot]

    def _point_at_rope_tables(self, step: NativeStep, num_positions: int) -> None:
        """Give the call the RoPE cos/sin tables (`RotaryEmbedding.table`, held here while
        pointed at): it reads each token's row by its position."""
        model = self.model
        rotaries = [model.rotary_global] if model.rotary_local is None else [model.rotary_global, model.rotary_local]
        if num_positions <= self._rope_capacity and all(r.inv_freq is f for r, f in zip(rotaries, self._rope_freqs)):
            return  # the tables pointed at still hold these positions, for these frequencies
        tables = [rotary.table(num_positions) for rotary in rotaries]
        pointers = [(t.data_ptr(), t.data_ptr() + t[0].numel() * t.element_size()) for t in tables]
        (step.cos, step.sin), (step.cos_local, step.sin_local) = pointers[0], pointers[-1]
        self._rope_tables, self._rope_freqs = tables, [rotary.inv_freq for rotary in rotaries]
        self._rope_capacity = min(t.shape[1] for t in tables)

    def _logits_request(self, rows: torch.Tensor | None, keep: list) -> tuple[NativeLogits | None, torch.Tensor | None]:
        """The LM-head part of the call for the tokens `rows` and the tensor it fills, or
        (None, None) when the call computes no logits."""
        if rows is None or self._head is None or rows.numel() == 0:
            return None, None
        rows = _as_int64(rows)
        logits = torch.empty(rows.numel(), self._head.out, dtype=torch.float32)
        keep += [rows, logits]
        return NativeLogits(head=self._head, rows=rows.data_ptr(), num_rows=rows.numel(), logits=logits.data_ptr()), logits

    @staticmethod
    def _mask_request(head: NativeLogits, head_mask: HeadMask | None, keep: list) -> NativeTokenMask | None:
        """Points the head at `head_mask` (None when there is none or it does not fit these logits)."""
        if head_mask is None:
            return None
        bitmask, rows = head_mask.bitmask, head_mask.rows
        if (bitmask.dtype != torch.int32 or not bitmask.is_contiguous() or bitmask.shape[0] != len(rows)
                or len(set(rows)) != len(rows) or not all(0 <= r < head.num_rows for r in rows)):
            return None
        logits_row = torch.tensor(rows, dtype=torch.int64)
        mask = NativeTokenMask(bitmask=bitmask.data_ptr(), logits_row=logits_row.data_ptr(), num_mask_rows=len(rows),
                          num_words=bitmask.shape[1], ready=head_mask.ready.data_ptr(), timeout_ns=_MASK_TIMEOUT_NS,
                          ready_value=head_mask.ready_value, isa=ISA_CODES[head_mask.isa])
        keep += [logits_row, mask]
        head.mask = ctypes.pointer(mask)
        return mask
