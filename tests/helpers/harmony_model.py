"""A tiny random gpt-oss directory that speaks harmony: byte-level tokenizer with gpt-oss's
special tokens, `GptOssForCausalLM` from `tiny_moe_config`, and gpt-oss's stop tokens
(`<|return|>`, `<|endoftext|>`, `<|call|>`) as the generation config's EOS list."""
from __future__ import annotations

import json
import os

import torch
import transformers
from helpers.tiny_models import tiny_moe_config

from kvserve.server.harmony import SPECIAL_TOKENS

ENDOFTEXT = "<|endoftext|>"


def harmony_tokenizer(merges: tuple[tuple[str, str], ...] = ()):
    """A byte-level tokenizer (one token per byte, plus one per pair of `merges`, none by
    default) plus the harmony special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: index for index, char in enumerate([*sorted(alphabet), *("".join(pair) for pair in merges)])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|return|>", pad_token=ENDOFTEXT)
    fast.add_special_tokens({"additional_special_tokens": [t for t in SPECIAL_TOKENS if t != "<|return|>"]})
    return fast


def save_tiny_gpt_oss(path: str, seed: int = 1234, merges: tuple[tuple[str, str], ...] = ()) -> str:
    """Write the model (float32, random weights) and its tokenizer (`harmony_tokenizer(merges)`)
    to `path`; returns `path`."""
    tokenizer = harmony_tokenizer(merges)
    torch.manual_seed(seed)
    config = tiny_moe_config("gpt_oss", len(tokenizer))
    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|return|>", ENDOFTEXT, "<|call|>")]
    config.eos_token_id, config.pad_token_id, config.bos_token_id = stop_ids[0], stop_ids[1], stop_ids[1]
    model = transformers.GptOssForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": stop_ids, "pad_token_id": stop_ids[1], "bos_token_id": stop_ids[1]}, f)
    return path
