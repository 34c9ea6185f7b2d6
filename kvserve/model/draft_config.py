"""The draft model's `ModelConfig`, checked against the target's before any weight loads."""
from __future__ import annotations

import json
import os
from kvserve.model.config import ModelConfig
from kvserve.spec_decode.config import SpeculativeConfig, SpeculativeConfigError


def load_draft_model_config(spec: SpeculativeConfig, target: ModelConfig, model_path: str,
                            tensor_parallel_size: int) -> ModelConfig:
    """The config of `spec.model` (already resolved to `model_path`), in the target's
    dtype and context length. Raises SpeculativeConfigError when the draft cannot
    propose for this target: another vocabulary, another tokenizer, a shorter
    context, or tensor parallelism (the draft runs on one rank only)."""
    if tensor_parallel_size != 1:
        raise SpeculativeConfigError(
            "speculative_config: method \"draft_model\" needs tensor_parallel_size 1")
    try:
        draft = ModelConfig.from_path(model_path, dtype=target.dtype, max_model_len=target.max_model_len)
    except (OSError, ValueError) as exc:
        raise SpeculativeConfigError(f"speculative_config: draft model {spec.model!r}: {exc}") from None
    if draft.vocab_size != target.vocab_size:
        raise SpeculativeConfigError(
            f"speculative_config: draft model {spec.model!r} has a vocabulary of {draft.vocab_size} tokens, "
            f"the target {target.vocab_size}; a draft must share the target's tokenizer")
    if draft.max_position_embeddings < target.max_model_len:
        raise SpeculativeConfigError(
            f"speculative_config: draft model {spec.model!r} handles {draft.max_position_embeddings} positions, "
            f"fewer than max_model_len {target.max_model_len}; lower --max-model-len")
    mismatch = _tokenizer_mismatch(target.path, draft.path)
    if mismatch:
        raise SpeculativeConfigError(
            f"speculative_config: draft model {spec.model!r} does not share the target's tokenizer ({mismatch})")
    return draft


def _tokenizer_mismatch(target_path: str, draft_path: str) -> str | None:
    """Where both models ship a tokenizer.json: the first difference in their
    vocabularies (token -> id), else None."""
    target_vocab, draft_vocab = _tokenizer_vocab(target_path), _tokenizer_vocab(draft_path)
    if target_vocab is None or draft_vocab is None or target_vocab == draft_vocab:
        return None
    for token in sorted(set(target_vocab) | set(draft_vocab)):
        if target_vocab.get(token) != draft_vocab.get(token):
            return f"token {token!r}: id {target_vocab.get(token)} in the target, {draft_vocab.get(token)} in the draft"
    return None


def _tokenizer_vocab(model_path: str) -> dict[str, int] | None:
    path = os.path.join(model_path, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tokenizer = json.load(f)
    vocab = tokenizer.get("model", {}).get("vocab") or {}
    # BPE stores token -> id, unigram a list of [token, score] in id order.
    vocab = dict(vocab) if isinstance(vocab, dict) else {entry[0]: i for i, entry in enumerate(vocab)}
    for added in tokenizer.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    return vocab
