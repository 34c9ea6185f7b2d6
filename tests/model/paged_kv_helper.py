"""Test helpers: tiny random transformers models saved to disk, and a hand-driven
paged-KV runner (blocks allocated by hand, no scheduler) for DecoderModel."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import transformers

from kvserve.kv_cache.interface import (CircularBufferSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        KVCacheTensor, SlidingWindowSpec)
from kvserve.kv_cache.utils import KVCacheBlockCopy
from kvserve.model.attention import AttentionMetadata
from kvserve.model.config import ModelConfig
from kvserve.worker.kv_tensors import allocate_kv_caches, copy_kv_blocks
from helpers.tiny_models import MOE_FAMILIES, tiny_moe_config

VOCAB = 256
WINDOW = 12
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_hf_config(family: str):
    """A random-weight config of `family` small enough for a unit test."""
    if family == "llama":
        return transformers.LlamaConfig(**_COMMON, num_hidden_layers=2, tie_word_embeddings=False)
    if family == "llama3":
        return transformers.LlamaConfig(**_COMMON, num_hidden_layers=2, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                         "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64})
    if family == "mistral":
        return transformers.MistralConfig(**_COMMON, num_hidden_layers=2, sliding_window=WINDOW, head_dim=16)
    if family == "qwen2":
        return transformers.Qwen2Config(**_COMMON, num_hidden_layers=2, tie_word_embeddings=True)
    if family == "qwen3":
        return transformers.Qwen3Config(**_COMMON, num_hidden_layers=2, head_dim=32, tie_word_embeddings=False)
    if family == "gemma2":
        return transformers.Gemma2Config(**_COMMON, num_hidden_layers=4, head_dim=16, sliding_window=WINDOW,
                                         query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
                                         final_logit_softcapping=30.0)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(
            **_COMMON, num_hidden_layers=4, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    if family in MOE_FAMILIES:
        return tiny_moe_config(family, VOCAB, window=WINDOW)
    raise ValueError(family)


def save_tiny_model(family: str, path) -> str:
    """Create, seed and save a tiny model of `family` (float32 safetensors); return the directory."""
    torch.manual_seed(0)
    config = tiny_hf_config(family)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.save_pretrained(str(path))
    return str(path)


def assert_same_greedy(ours, ref, max_diff: float) -> None:
    """Two `run_greedy` results (`ours` made to follow `ref`'s tokens where the two paths'
    arithmetic differs): the same tokens, and logits within `max_diff` of the reference's
    scale (at least 1)."""
    (tokens, logits), (ref_tokens, ref_logits) = ours, ref
    assert tokens == ref_tokens
    for req_id in ref_logits:
        for a, b in zip(logits[req_id], ref_logits[req_id]):
            assert (a - b).abs().max().item() <= max_diff * max(1.0, b.abs().max().item())


def random_prompts(count: int, seed: int) -> dict[str, list[int]]:
    """`count` prompts "r0".. of 3 to 29 random tokens (a batch of mixed lengths)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 30, (count,), generator=generator).tolist()
    return {f"r{i}": torch.randint(3, VOCAB, (n,), generator=generator).tolist() for i, n in enumerate(lengths)}


def prompts_of_lengths(lengths: list[int], seed: int = 0) -> dict[str, list[int]]:
    """Prompts "r0".. of random tokens (no special ids), of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    return {f"r{i}": torch.randint(3, VOCAB, (n,), generator=generator).tolist() for i, n in enumerate(lengths)}


def tiny_configs(tmp_path_factory):
    """A getter family -> `ModelConfig` of its tiny model, each saved once under
    `tmp_path_factory` (for a module-scoped fixture)."""
    cache = {}

    def get(family: str) -> ModelConfig:
        if family not in cache:
            cache[family] = ModelConfig.from_path(save_tiny_model(family, tmp_path_factory.mktemp(family)))
        return cache[family]
    return get


def load_hf(path: str):
    """transformers' model of `path` in float32, eager attention; a mixture of experts runs
    its experts one by one (the eager loop, not the grouped matmul, which rejects float64)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    if getattr(model.config, "num_experts_per_tok", None):
        model.set_experts_implementation("eager")
    return model


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy continuation of one prompt, with the logits of each step."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, output_logits=True, return_dict_in_generate=True,
                         eos_token_id=None, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), [step[0].float() for step in out.logits]


@torch.inference_mode()
def hf_forced_logits(model, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """transformers' logits after `prompt` and each prefix of `tokens` (another path's tokens,
    teacher forced: one forward pass), as `hf_greedy` and `run_greedy` list them."""
    ids = torch.tensor([list(prompt) + list(tokens[:-1])])
    rows = model(ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt) - 1:].float()
    return list(rows)


def assert_hf_logits_close(model, prompts: dict[str, list[int]], tokens: dict[str, list[int]],
                           logits: dict[str, list[torch.Tensor]], max_diff: float) -> None:
    """`run_greedy`'s `tokens` and `logits` against transformers' logits on the same tokens
    (teacher forcing: a near-tie another float order breaks the other way is no failure):
    every row within `max_diff` of the reference's scale (at least 1)."""
    for req_id, prompt in prompts.items():
        ref = hf_forced_logits(model, prompt, tokens[req_id])
        assert len(ref) == len(logits[req_id]), req_id
        for ours, theirs in zip(logits[req_id], ref):
            assert (ours - theirs).abs().max().item() <= max_diff * max(1.0, theirs.abs().max().item()), req_id


@dataclass
class _Request:
    tokens: list[int]
    num_computed: int = 0
    block_ids: list[list[int]] = field(default_factory=list)


class PagedRunner:
    """Drives a DecoderModel over paged KV with hand-made block tables.

    Groups: one per distinct spec kind (full first, then windowed). Layers of the
    two groups share backing buffers pairwise, as a hybrid KVCacheConfig does.
    Windowed (sliding) groups get the null block in place of blocks that left
    the window, and those blocks are filled with garbage to prove nobody reads them.
    """

    def __init__(self, model, block_size: int = 4, num_blocks: int = 512, sliding_window_kv: str = "sliding",
                 kv_dtype: torch.dtype | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.block_size = block_size
        dtype = kv_dtype or next(model.parameters()).dtype
        self.specs = model.kv_cache_specs(block_size, dtype, sliding_window_kv)
        by_kind: dict[type, list[str]] = {}
        for name, spec in self.specs.items():
            by_kind.setdefault(type(spec), []).append(name)
        kinds = sorted(by_kind, key=lambda k: k is not FullAttentionSpec)
        groups = [KVCacheGroupSpec(by_kind[k], self.specs[by_kind[k][0]]) for k in kinds]
        page = max(spec.page_size_bytes for spec in self.specs.values())
        tensors = [KVCacheTensor(page * num_blocks, [names[i] for names in by_kind.values() if i < len(names)])
                   for i in range(max(len(n) for n in by_kind.values()))]
        self.kv_cache_config = KVCacheConfig(num_blocks, tensors, groups)
        self.kv_caches = allocate_kv_caches(self.kv_cache_config, self.specs, self.device)
        model.bind_kv_cache_config(self.kv_cache_config)
        self.next_free_block = 1
        self.requests: dict[str, _Request] = {}

    def new_block(self) -> int:
        block = self.next_free_block
        if block >= self.kv_cache_config.num_blocks:  # a bigger pool, not a write past the KV tensors
            raise RuntimeError(f"PagedRunner: all {self.kv_cache_config.num_blocks} blocks are used")
        self.next_free_block += 1
        return block

    def add(self, req_id: str, prompt: list[int], shared_blocks: list[list[int]] | None = None,
            num_computed: int = 0) -> None:
        groups = len(self.kv_cache_config.kv_cache_groups)
        self.requests[req_id] = _Request(list(prompt), num_computed,
                                         [list(b) for b in shared_blocks] if shared_blocks else [[] for _ in range(groups)])

    def _ensure_blocks(self, req: _Request, num_tokens: int) -> None:
        for group, table in zip(self.kv_cache_config.kv_cache_groups, req.block_ids):
            spec = group.kv_cache_spec
            needed = -(-num_tokens // self.block_size)
            if isinstance(spec, CircularBufferSpec):
                needed = min(needed, spec.blocks_per_request)
            while len(table) < needed:
                table.append(self.new_block())

    def reserve(self, req_id: str, num_tokens: int) -> list[list[int]]:
        """Allocate blocks for the first `num_tokens` of a request now; return its tables."""
        self._ensure_blocks(self.requests[req_id], num_tokens)
        return self.requests[req_id].block_ids

    def _release_out_of_window(self, req: _Request) -> None:
        for group, table in zip(self.kv_cache_config.kv_cache_groups, req.block_ids):
            spec = group.kv_cache_spec
            if not isinstance(spec, SlidingWindowSpec):
                continue
            first_needed = max(req.num_computed - spec.sliding_window + 1, 0) // self.block_size
            for i in range(first_needed):
                block, table[i] = table[i], 0
                if block != 0 and not self._still_used(block):
                    for name in group.layer_names:
                        self.kv_caches[name][:, :, block] = 1e4  # garbage: must never be read

    def _still_used(self, block: int) -> bool:
        return any(block in table for req in self.requests.values() for table in req.block_ids)

    def step(self, schedule: dict[str, int], every_token: bool = False,
             num_draft_tokens: int = 0, head_mask=None) -> dict[str, torch.Tensor]:
        """Run `schedule[req_id]` tokens of each request; return logits of each request's last token
        (with `every_token`: of all its scheduled tokens, [n, vocab]). `num_draft_tokens` of the
        step's tokens are speculative drafts (for the model's kernel choice); `head_mask` goes to
        `forward_logits`."""
        input_ids, positions, query_lens, seq_lens = [], [], [], []
        for req_id, n in schedule.items():
            req = self.requests[req_id]
            self._release_out_of_window(req)
            start = req.num_computed
            input_ids += req.tokens[start:start + n]
            positions += list(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            self._ensure_blocks(req, start + n)
        metadata = []
        for g, group in enumerate(self.kv_cache_config.kv_cache_groups):
            tables = [self.requests[r].block_ids[g] for r in schedule]
            width = max(len(t) for t in tables)
            block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
            metadata.append(AttentionMetadata.build(group.kv_cache_spec, query_lens, seq_lens, block_table,
                                                    self.device))
            metadata[-1].num_draft_tokens = num_draft_tokens
        # The rows the model runner asks for (each request's last token), or every row.
        rows = (torch.arange(len(input_ids)) if every_token else torch.tensor(query_lens).cumsum(0) - 1)
        with torch.inference_mode():
            logits = self.model.forward_logits(torch.tensor(input_ids, device=self.device),
                                               torch.tensor(positions, device=self.device), metadata,
                                               self.kv_caches, rows.to(self.device),
                                               head_mask=head_mask).cpu()
        if every_token:
            logits = logits.split(query_lens)
        for req_id, n in schedule.items():
            self.requests[req_id].num_computed += n
        return {req_id: logits[i] for i, req_id in enumerate(schedule)}

    def append(self, req_id: str, token: int) -> None:
        self.requests[req_id].tokens.append(token)

    def copy_blocks(self, copies: list[KVCacheBlockCopy]) -> None:
        copy_kv_blocks(self.kv_caches, self.kv_cache_config, copies)


def run_greedy(runner: PagedRunner, prompts: dict[str, list[int]], max_new_tokens: int, chunk: int,
               follow: dict[str, list[int]] | None = None) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    """A minimal continuous batch: every step gives each prefilling request up to
    `chunk` prompt tokens and each decoding request one token; greedy throughout, or, with
    `follow` (another path's tokens), teacher forced: each request is fed those tokens
    whatever its own logits say, so that two paths that differ in float order are compared
    on the same sequences (a near-tie between them is no failure)."""
    for req_id, prompt in prompts.items():
        if req_id not in runner.requests:
            runner.add(req_id, prompt)
    tokens = {r: [] for r in prompts}
    logits = {r: [] for r in prompts}
    while any(len(t) < max_new_tokens for t in tokens.values()):
        schedule = {}
        for req_id in prompts:
            req = runner.requests[req_id]
            if len(tokens[req_id]) < max_new_tokens:
                schedule[req_id] = min(chunk, len(req.tokens) - req.num_computed)
        out = runner.step(schedule)
        for req_id in schedule:
            req = runner.requests[req_id]
            if req.num_computed == len(req.tokens):
                token = int(out[req_id].argmax()) if follow is None else follow[req_id][len(tokens[req_id])]
                tokens[req_id].append(token)
                logits[req_id].append(out[req_id])
                runner.append(req_id, token)
    return tokens, logits


def run_teacher_forced(runner: PagedRunner, sequences: dict[str, list[int]], prompt_lens: dict[str, int],
                       chunk: int) -> dict[str, torch.Tensor]:
    """Feed each sequence whole, the same tokens whatever the logits say (teacher forcing):
    its first `prompt_lens[r]` tokens in steps of up to `chunk`, then one token a step, all
    requests batched. Returns each request's logits after every step from its prompt's end
    on, [len - prompt_len + 1, vocab]: row i is the prediction after token prompt_len - 1 + i."""
    for req_id, tokens in sequences.items():
        if req_id in runner.requests:  # added before, e.g. on shared blocks
            runner.requests[req_id].tokens = list(tokens)
        else:
            runner.add(req_id, tokens)
    logits: dict[str, list[torch.Tensor]] = {r: [] for r in sequences}
    while any(runner.requests[r].num_computed < len(t) for r, t in sequences.items()):
        schedule = {}
        for req_id, tokens in sequences.items():
            done = runner.requests[req_id].num_computed
            if done < len(tokens):
                schedule[req_id] = min(chunk, prompt_lens[req_id] - done) if done < prompt_lens[req_id] else 1
        out = runner.step(schedule)
        for req_id in schedule:
            if runner.requests[req_id].num_computed >= prompt_lens[req_id]:
                logits[req_id].append(out[req_id])
    return {r: torch.stack(rows) for r, rows in logits.items()}


def every_token_logits(model, sequences: dict[str, list[int]], prompt_lens: dict[str, int]) -> dict[str, torch.Tensor]:
    """The rows `run_teacher_forced` returns, each sequence in one step of all its tokens."""
    runner = PagedRunner(model)
    out = {}
    for req_id, tokens in sequences.items():
        runner.add(req_id, tokens)
        out[req_id] = runner.step({req_id: len(tokens)}, every_token=True)[req_id][prompt_lens[req_id] - 1:]
    return out


def tiny_models_with_reference(tmp_path_factory):
    """A getter family -> (transformers model, `ModelConfig`) of its tiny model, saved once
    under `tmp_path_factory` (for a module-scoped fixture)."""
    cache = {}

    def get(family: str):
        if family not in cache:
            path = save_tiny_model(family, tmp_path_factory.mktemp(family))
            cache[family] = (load_hf(path), ModelConfig.from_path(path))
        return cache[family]
    return get


def held_weights(held, plain) -> dict:
    """The quantized weights of `held` by module name, each checked to be held once and to
    hold the same values as `plain`'s (the same file dequantized: Q/K rows un-permuted
    alike, fused parts in order)."""
    plain_modules = dict(plain.named_modules())
    weights = {}
    for name, module in held.named_modules():
        weight = getattr(module, "quant_weight", None)
        if weight is None:
            continue
        assert module.weight is None  # held once
        torch.testing.assert_close(weight.dequantize(), plain_modules[name].weight, rtol=1e-6, atol=1e-7)
        weights[name] = weight
    return weights


def assert_within_activation_rounding(held, plain) -> None:
    """Teacher-forced logits of `held` (quantized weights; prefill chunks of 8, then one-token
    steps) within the activation-rounding bound (tests/helpers/activation_rounding.py) of
    `plain`'s, a bound that still tells wrong weights apart."""
    from helpers.activation_rounding import max_deviation, quantized_half_steps, rounding_bound
    generator = torch.Generator().manual_seed(1)
    sequences = {f"r{i}": torch.randint(3, VOCAB, (n,), generator=generator).tolist() for i, n in enumerate([11, 29])}
    prompt_lens = {"r0": 5, "r1": 23}  # then 6 one-token steps each
    reference, bound = rounding_bound(plain, quantized_half_steps(plain, held),
                                      lambda model: every_token_logits(model, sequences, prompt_lens))
    logits = run_teacher_forced(PagedRunner(held), sequences, prompt_lens, chunk=8)
    assert max_deviation(logits, reference) <= bound
    # The bound is a small part of the logits' range.
    assert bound < 0.1 * min((ref.amax(-1) - ref.amin(-1)).min().item() for ref in reference.values())
