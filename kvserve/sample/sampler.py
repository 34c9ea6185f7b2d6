"""Sampling the next token of each request from its logits.

Order of processing (HF/vLLM semantics): min-token stop blocking, penalties
(repetition over prompt + output as HF; presence/frequency over the output as
OpenAI), then greedy argmax or temperature -> top-k -> top-p -> min-p ->
draw. Logprobs are those of the raw model distribution (before penalties and
temperature), as vLLM reports by default.

Reproducible seeded sampling: a request with a seed draws its noise from its
own torch.Generator (one draw of vocab-size exponentials per step), so its
tokens do not depend on which other requests share the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.sampling_params import SamplingParams
from kvserve.messages import TokenLogprobs


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator for `SamplingParams.seed`; keep it across steps."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _padded(token_lists: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max((len(t) for t in token_lists), default=0)
    out = torch.full((len(token_lists), max(width, 1)), pad, dtype=torch.int64)
    for row, tokens in enumerate(token_lists):
        if tokens:
            out[row, :len(tokens)] = torch.as_tensor(tokens, dtype=torch.int64)
    return out.to(device)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one batch, as tensors (built once per step)."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    repetition_penalty: torch.Tensor
    output_tokens: torch.Tensor | None  # [B, L] padded with -1, only when penalties are used
    prompt_tokens: torch.Tensor | None  # [B, L] padded with -1, only for repetition penalty
    blocked_tokens: torch.Tensor | None  # [B, L] stop tokens banned until min_tokens, -1 pads
    generators: list[torch.Generator | None]
    num_logprobs: list[int | None]
    all_greedy: bool
    do_top_k: bool
    do_top_p: bool
    do_min_p: bool
    do_penalties: bool
    do_repetition: bool

    @classmethod
    def from_params(cls, params: list[SamplingParams], output_token_ids: list[list[int]],
                    prompt_token_ids: list[list[int]] | None = None,
                    generators: list[torch.Generator | None] | None = None,
                    device: torch.device | str = "cpu",
                    eos_token_ids: list[int | None] | None = None) -> "SamplingTensors":
        """Gather the batch's parameters; `eos_token_ids[i]` (with stop_token_ids) is
        blocked while request i has fewer than `min_tokens` outputs."""
        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        do_penalties = any(p.needs_penalties for p in params)
        do_repetition = any(p.repetition_penalty != 1.0 for p in params)
        if do_repetition and prompt_token_ids is None:
            raise ValueError("repetition_penalty needs prompt_token_ids")
        return cls(
            temperature=column([p.temperature for p in params], torch.float32),
            top_k=column([max(p.top_k or 0, 0) for p in params], torch.int64),
            top_p=column([p.top_p for p in params], torch.float32),
            min_p=column([p.min_p for p in params], torch.float32),
            presence_penalty=column([p.presence_penalty for p in params], torch.float32),
            frequency_penalty=column([p.frequency_penalty for p in params], torch.float32),
            repetition_penalty=column([p.repetition_penalty for p in params], torch.float32),
            output_tokens=_padded(output_token_ids, -1, device) if do_penalties else None,
            prompt_tokens=_padded(prompt_token_ids, -1, device) if do_repetition else None,
            blocked_tokens=_blocked_tokens(params, output_token_ids, eos_token_ids, device),
            generators=list(generators) if generators is not None else [None] * len(params),
            num_logprobs=[p.logprobs for p in params],
            all_greedy=all(p.is_greedy for p in params),
            do_top_k=any((p.top_k or 0) > 0 and not p.is_greedy for p in params),
            do_top_p=any(p.top_p < 1.0 and not p.is_greedy for p in params),
            do_min_p=any(p.min_p > 0.0 and not p.is_greedy for p in params),
            do_penalties=do_penalties, do_repetition=do_repetition,
        )


def _blocked_tokens(params: list[SamplingParams], output_token_ids: list[list[int]],
                    eos_token_ids: list[int | None] | None, device) -> torch.Tensor | None:
    rows = []
    for i, p in enumerate(params):
        blocked: list[int] = []
        if len(output_token_ids[i]) < p.min_tokens:
            eos = eos_token_ids[i] if eos_token_ids is not None else None
            blocked = list(p.stop_token_ids) + ([eos] if eos is not None and not p.ignore_eos else [])
        rows.append(blocked)
    return _padded(rows, -1, device) if any(rows) else None


@dataclass
class SamplerOutput:
    """One sampled token per row; logprobs per row (None where not requested)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None


def token_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] ids padded with -1 -> [B, vocab] occurrence counts."""
    counts = torch.zeros(tokens.shape[0], vocab_size + 1, dtype=torch.float32, device=tokens.device)
    index = torch.where(tokens < 0, vocab_size, tokens)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Repetition (HF: divide positive / multiply negative logits of prompt+output tokens),
    then frequency (x count) and presence (once) subtracted for output tokens."""
    vocab = logits.shape[-1]
    output_counts = token_counts(st.output_tokens, vocab)
    if st.do_repetition:
        seen = (output_counts > 0) | (token_counts(st.prompt_tokens, vocab) > 0)
        penalty = st.repetition_penalty[:, None]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    logits = logits - st.frequency_penalty[:, None] * output_counts
    return logits - st.presence_penalty[:, None] * (output_counts > 0).float()


def filter_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Set to -inf every token outside the top-k / top-p / min-p set of its row."""
    if st.do_top_k:
        k = torch.where(st.top_k > 0, st.top_k.clamp(max=logits.shape[-1]), logits.shape[-1])
        sorted_desc = logits.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if st.do_top_p:
        probs_desc, order = logits.softmax(-1).sort(dim=-1, descending=True)
        mass_before = probs_desc.cumsum(-1) - probs_desc
        drop_sorted = mass_before >= st.top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if st.do_min_p:
        probs = logits.softmax(-1)
        threshold = st.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def seeded_noise(generator: torch.Generator, width: int) -> torch.Tensor:
    """The exponential noise E [width] a seeded request's draw divides by: each sampled token
    takes the next one from its generator, so a seed fixes the whole sequence of them."""
    return torch.empty(width, device=generator.device).exponential_(generator=generator)


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row, P(token) = probs (exponential race: argmax p / E, E ~ Exp(1))."""
    noise = torch.empty_like(probs).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row] = seeded_noise(generator, probs.shape[1]).to(probs.device)
    return (probs / noise).argmax(dim=-1)


def argmax_token_ids(logits: torch.Tensor) -> list[int]:
    """The greedy token of each row of logits [B, vocab]: its first maximal entry (NaN counting
    as maximal), as `torch.argmax` picks it. On the CPU numpy's argmax, a few microseconds
    for a row of a 50k vocabulary, where torch's starts a parallel region for it."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(axis=1).tolist()
    return logits.argmax(dim=-1).tolist()


class Sampler:
    """Turns float32 logits [B, vocab] into one token per row (see module docstring)."""

    def sample(self, logits: torch.Tensor, st: SamplingTensors) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = (torch.log_softmax(logits, dim=-1)
                        if any(n is not None for n in st.num_logprobs) else None)
        logits = self.process_logits(logits, st)
        if st.all_greedy:
            token_list = argmax_token_ids(logits)
        else:
            tokens = torch.where(st.temperature == 0, logits.argmax(dim=-1), self._random_sample(logits, st))
            token_list = tokens.tolist()
        logprobs = gather_logprobs(raw_logprobs, token_list, st.num_logprobs) if raw_logprobs is not None else None
        return SamplerOutput(token_ids=token_list, logprobs=logprobs)

    @staticmethod
    def process_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """Float32 logits with the banned tokens and the penalties applied: greedy
        takes their argmax, random sampling their `target_probs`."""
        if st.blocked_tokens is not None:
            blocked = token_counts(st.blocked_tokens, logits.shape[-1]) > 0
            blocked_logits = logits.masked_fill(blocked, float("-inf"))
            # A grammar that allows nothing but a stop token wins over min_tokens.
            nothing_left = torch.isneginf(blocked_logits).all(dim=-1, keepdim=True)
            logits = torch.where(nothing_left, logits, blocked_logits)
        if st.do_penalties:
            logits = apply_penalties(logits, st)
        return logits

    @staticmethod
    def target_probs(processed_logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """The distribution random sampling draws from (temperature, top-k/p, min-p)."""
        temperature = torch.where(st.temperature == 0, 1.0, st.temperature)
        return filter_logits(processed_logits / temperature[:, None], st).softmax(dim=-1)

    @classmethod
    def _random_sample(cls, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        return _draw(cls.target_probs(logits, st), st.generators)


def gather_logprobs(logprobs: torch.Tensor, tokens: list[int], num_logprobs: list[int | None]) -> list[TokenLogprobs | None]:
    max_top = max((n for n in num_logprobs if n is not None), default=0)
    top_values, top_ids = logprobs.topk(max_top, dim=-1) if max_top else (None, None)
    token_index = torch.tensor(tokens, device=logprobs.device)[:, None]
    sampled = logprobs.gather(1, token_index)
    ranks = (logprobs > sampled).sum(dim=-1) + 1
    sampled_list, rank_list = sampled.flatten().tolist(), ranks.tolist()
    out: list[TokenLogprobs | None] = []
    for row, n in enumerate(num_logprobs):
        if n is None:
            out.append(None)
            continue
        out.append(TokenLogprobs(
            sampled_token_id=tokens[row], sampled_logprob=sampled_list[row], sampled_rank=rank_list[row],
            top_token_ids=top_ids[row, :n].tolist() if n else [],
            top_logprobs=top_values[row, :n].tolist() if n else []))
    return out
