"""Test tokenizers built in memory (no downloads)."""
from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers

_WORDS = ["hello", "world", "stop", "here", "the", "end", "tok", "en", "izer"]


def make_byte_fallback_tokenizer():
    """Llama-2-style BPE with byte fallback: "▁" marks a word start, and any
    character outside the vocabulary is spelled as UTF-8 byte tokens <0xNN>."""
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    merges: list[tuple[str, str]] = []
    for char in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-":
        vocab.setdefault(char, len(vocab))
    for word in _WORDS:
        _add_word_merges("▁" + word, vocab, merges)
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def _add_word_merges(word: str, vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
    current = word[0]
    for char in word[1:]:
        if (current, char) not in merges:
            merges.append((current, char))
        current += char
        vocab.setdefault(current, len(vocab))
