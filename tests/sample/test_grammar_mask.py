"""The grammar-mask kernel (csrc/grammar/grammar_mask.c) against the torch reference path and a
per-token decoder of the bitmask, on every kernel path this machine runs."""
from __future__ import annotations

import pytest
import torch

from kvserve.config import ConfigError
from kvserve.native import cpu_kernels
from kvserve.native.config import GRAMMAR_MASK_ISA_ENV, QUANT_ISAS, KernelConfig
from kvserve.sample.structured.grammar_mask import apply_bitmask, apply_token_bitmask_, choose_mask_isa, isa_available

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no C compiler for the native kernels")
RUNNABLE_ISAS = [isa for isa in QUANT_ISAS if cpu_kernels.load_library() is not None and isa_available(isa)]


def random_bitmask(rows: int, words: int, generator: torch.Generator) -> torch.Tensor:
    """Random words, with whole words of zeros and of ones mixed in (the kernels' shortcuts)."""
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=generator)
    kind = torch.randint(0, 4, (rows, words), generator=generator)
    bitmask[kind == 0] = 0
    bitmask[kind == 1] = -1
    return bitmask


def expected_row(logits_row: torch.Tensor, bitmask_row: torch.Tensor) -> torch.Tensor:
    """Token by token: kept when its bit is set, -inf otherwise and past the bitmask."""
    words = [int(w) & 0xFFFFFFFF for w in bitmask_row.tolist()]
    out = logits_row.clone()
    for token in range(out.shape[0]):
        word = token // 32
        if word >= len(words) or not words[word] >> (token % 32) & 1:
            out[token] = float("-inf")
    return out


def test_the_machine_runs_the_portable_path_and_the_choice_is_the_widest():
    assert "portable" in RUNNABLE_ISAS
    assert choose_mask_isa(KernelConfig(), "cpu") == RUNNABLE_ISAS[-1]


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
@pytest.mark.parametrize("vocab,width", [(70, 70), (70, 100), (70, 50), (96, 96), (96, 130), (33, 31), (5, 64)])
@pytest.mark.parametrize("rows", [[0, 1, 2], [0, 2], [1]], ids=["every row", "rows 0 and 2", "row 1"])
def test_kernel_matches_the_reference_with_tails(isa, vocab, width, rows):
    """Vocabularies that are not a multiple of 32, logits wider and narrower than the grammar's
    vocabulary, some or every row."""
    generator = torch.Generator().manual_seed(vocab * 1000 + width + len(rows))
    logits = torch.randn(3, width, generator=generator)
    bitmask = random_bitmask(len(rows), (vocab + 31) // 32, generator)
    reference = apply_bitmask(logits, bitmask, rows)
    native = apply_token_bitmask_(logits.clone(), bitmask, rows, isa)
    assert torch.equal(native, reference)
    for mask_row, row in enumerate(rows):
        assert torch.equal(native[row], expected_row(logits[row], bitmask[mask_row]))
    untouched = [r for r in range(3) if r not in rows]
    assert torch.equal(native[untouched], logits[untouched])


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
def test_kernel_on_the_default_vocabulary_and_strided_rows(isa):
    """A 49152-token vocabulary (the default model's), 4 of 6 rows of a logits view whose rows
    are further apart than their width, bitmask rows taken from a wider tensor."""
    generator = torch.Generator().manual_seed(7)
    storage = torch.randn(6, 49152 + 40, generator=generator)
    logits = storage[:, :49152]
    wide = random_bitmask(4, 1536 + 3, generator)
    bitmask = wide[:, :1536]
    rows = [5, 0, 3, 2]
    reference = apply_bitmask(logits, bitmask, rows)
    padding = storage[:, 49152:].clone()
    apply_token_bitmask_(logits, bitmask, rows, isa)
    assert torch.equal(logits, reference)
    assert torch.equal(storage[:, 49152:], padding)


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
def test_allowed_values_keep_their_bits(isa):
    logits = torch.tensor([[float("nan"), float("inf"), -0.0, 3.5] + [1.0] * 28])
    bitmask = torch.tensor([[0b1111 - 2**31]], dtype=torch.int32)  # bits 0-3 and 31
    out = apply_token_bitmask_(logits.clone(), bitmask, [0], isa)
    assert torch.equal(out[0, :4].view(torch.int32), logits[0, :4].view(torch.int32))
    assert torch.isneginf(out[0, 4:31]).all() and out[0, 31] == 1.0


def test_bad_arguments_are_refused():
    logits = torch.zeros(2, 64)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="bitmask rows"):
        apply_token_bitmask_(logits, bitmask, [0], "portable")
    with pytest.raises(ValueError, match="out of range"):
        apply_token_bitmask_(logits, bitmask, [0, 2], "portable")
    assert torch.equal(apply_token_bitmask_(logits, bitmask[:0], [], "portable"), torch.zeros(2, 64))


def test_the_path_choice_follows_the_kernel_config():
    assert choose_mask_isa(KernelConfig(grammar_mask_isa="torch"), "cpu") is None
    assert choose_mask_isa(KernelConfig(cpu_kernels=False), "cpu") is None
    assert choose_mask_isa(KernelConfig(), "cuda") is None
    assert choose_mask_isa(KernelConfig(grammar_mask_isa="portable"), "cpu") == "portable"
    if "avx2" in RUNNABLE_ISAS:
        assert choose_mask_isa(KernelConfig(grammar_mask_isa="avx2"), "cpu") == "avx2"
    assert KernelConfig.from_env({GRAMMAR_MASK_ISA_ENV: " AVX2 "}).grammar_mask_isa == "avx2"
    with pytest.raises(ConfigError, match=GRAMMAR_MASK_ISA_ENV):
        KernelConfig.from_env({GRAMMAR_MASK_ISA_ENV: "sse"})
