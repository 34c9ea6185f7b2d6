"""Grammar-constrained decoding on llguidance: compile a constraint, mask the logits.

A `StructuredOutputsParams` becomes an llguidance grammar text
(`grammar_source`); `GrammarCompiler` turns that text into a matcher for
the model's vocabulary and keeps one compiled template per text (copies of
it are cheap), so the same schema is compiled once per process. Each request
that samples under a constraint owns a matcher; before sampling,
`fill_bitmasks` writes the allowed-token bitmask of every constrained row
(llguidance's thread pool) and `kvserve.sample.structured.grammar_mask` sets the other
logits to -inf; after sampling the runner feeds the sampled token to the matcher.

Why llguidance rather than xgrammar: it measured about as fast per token on
this model's 49k vocabulary and compiles JSON schemas in a few ms (see
docs/structured_output.md and `kvserve bench structured`), and its wheel has
no dependencies, while xgrammar's pulls torch and triton.

JSON is compiled compact (", " and ": " separators, no free whitespace): a
small model left free to emit whitespace can fill its whole budget with it.
"""
from __future__ import annotations

import copy

import json
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import TYPE_CHECKING, Any, Callable

from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.sample.structured.json_grammar import json_schema_lark

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_ENV = "KVSERVE_GRAMMAR_COMPILE_TIMEOUT_S"
DEFAULT_COMPILE_TIMEOUT_S = 10.0
# Compiled templates kept per process (least recently used dropped first).
MAX_CACHED_GRAMMARS = 256
JSON_COMPILE_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class StructuredOutputError(InvalidRequestError):
    """A constraint cannot be compiled or enforced; `kind` says which one
    ("json", "regex", "choice", "grammar", "json_object"), `param` the request field."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"invalid {kind} constraint: {reason}", f"structured_outputs.{kind}")
        self.kind = kind
        self.reason = reason


def compile_timeout_s() -> float:
    """Seconds a front-end waits for a grammar to compile ($KVSERVE_GRAMMAR_COMPILE_TIMEOUT_S, default 10)."""
    try:
        return float(os.environ.get(COMPILE_TIMEOUT_ENV, DEFAULT_COMPILE_TIMEOUT_S))
    except ValueError:
        return DEFAULT_COMPILE_TIMEOUT_S


def grammar_source(params: StructuredOutputsParams) -> str:
    """The llguidance grammar text of a constraint (deterministic: it is the cache key)."""
    import llguidance

    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            # Keys keep their order: properties are emitted in the schema's order.
            schema = params.json if kind == "json" else {"type": "object"}
            text = schema if isinstance(schema, str) else json.dumps(schema)
            lark = json_schema_lark(json.loads(text))
            if lark is not None:
                return llguidance.LLMatcher.grammar_from_lark(lark)
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_COMPILE_OPTIONS)
        if kind == "regex":
            # \d means an ASCII digit here, as users of Python's re on digits expect.
            return llguidance.LLMatcher.grammar_from_lark(
                f"start: /{llguidance.regex_to_lark(params.regex, 'd')}/")
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(choice) for choice in params.choice))
        return llguidance.grammar_from("grammar", params.grammar)
    except (ValueError, TypeError) as exc:
        raise StructuredOutputError(kind, str(exc).strip().splitlines()[0] if str(exc).strip() else
                                    type(exc).__name__) from exc


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """llguidance's view of a fast tokenizer (transformers' or kvserve's `FastTokenizer`), built
    from the serialized Rust tokenizer as `llguidance.hf.from_tokenizer` builds it, without
    importing transformers (which that module does)."""
    import llguidance
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("structured output needs a fast tokenizer (a tokenizer.json)")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                  eos_token=eos_token_ids or tokenizer.eos_token_id)


class GrammarCompiler:
    """Compiles constraints for one vocabulary; thread-safe; caches by grammar text."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance

        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.ll_tokenizer = _ll_tokenizer(hf_tokenizer, vocab_size, self.eos_token_ids)
        self._templates: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvserve-grammar")
        self._executor = llguidance.LLExecutor(num_threads=max(1, min(4, os.cpu_count() or 1)))

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled template of `params` (from the cache when seen before)."""
        source = grammar_source(params)
        with self._lock:
            template = self._templates.get(source)
            if template is not None:
                self._templates.move_to_end(source)
                return template
        template = self._build(params.kind, source)
        with self._lock:
            self._templates[source] = template
            while len(self._templates) > MAX_CACHED_GRAMMARS:
                self._templates.popitem(last=False)
        return template

    def compile_async(self, params: StructuredOutputsParams) -> "Future[Any]":
        """`compile` on the compiler's thread pool (llguidance releases the GIL while it builds)."""
        return self._pool.submit(self.compile, params)

    def check(self, params: StructuredOutputsParams, timeout_s: float | None = None) -> None:
        """Compile now (waiting at most `timeout_s`), raising StructuredOutputError when it fails or is too slow."""
        future = self.compile_async(params)
        timeout_s = compile_timeout_s() if timeout_s is None else timeout_s
        try:
            future.result(timeout=timeout_s)
        except FutureTimeoutError:
            raise StructuredOutputError(params.kind, f"the grammar did not compile within {timeout_s:g} s") from None

    def new_matcher(self, params: StructuredOutputsParams, consumed_token_ids: list[int] = ()) -> Any:
        """A fresh matcher for one request, advanced over the tokens it already produced."""
        matcher = self.compile(params).deep_copy()
        for token_id in consumed_token_ids:
            if not matcher.consume_token(token_id):
                logger.warning("a resumed request's token %d does not fit its grammar: %s",
                               token_id, matcher.get_error())
                break
        return matcher

    def _build(self, kind: str, source: str) -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(self.ll_tokenizer, source, log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(kind, _first_line(matcher.get_error()))
        return matcher

    def fill_bitmasks(self, matchers: list[Any], out: "torch.Tensor | None" = None) -> "torch.Tensor":
        """[len(matchers), ceil(vocab/32)] int32 allowed-token bits (written into `out`, a
        contiguous tensor of that shape, when given); a matcher in an error state, or one that
        allows no token, allows only the EOS tokens (the request then ends; logged)."""
        import torch

        words = (self.vocab_size + 31) // 32
        if out is None:
            bitmask = torch.zeros((len(matchers), words), dtype=torch.int32)
        elif out.shape != (len(matchers), words) or out.dtype != torch.int32 or not out.is_contiguous():
            raise ValueError(f"the bitmask must be a contiguous int32 tensor of {(len(matchers), words)}")
        else:
            bitmask = out
        healthy = [(m, row) for row, m in enumerate(matchers) if not m.is_error()]
        if len(healthy) == 1:  # on this thread: handing one row to the pool costs more than it does
            matcher, row = healthy[0]
            matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), words * 4)
        elif healthy:
            self._executor.unsafe_compute_mask_ptr(healthy, bitmask.data_ptr(), words * 4, len(matchers))
        empty_rows = set()
        # One check for all rows (the fill runs every constrained step); an empty row would make
        # the sampler take token 0, often a hidden special token.
        allows_some = bitmask.any(dim=1).tolist() if healthy else []
        for matcher, row in healthy:
            if matcher.is_error():  # computing this mask failed (e.g. a parser limit): never silent
                logger.warning("a grammar failed while computing its mask; its request can only end: %s",
                               matcher.get_error())
            elif not allows_some[row]:
                logger.warning("a grammar allows no token at all; its request can only end")
                empty_rows.add(row)
        for row, matcher in enumerate(matchers):
            if matcher.is_error() or row in empty_rows:
                bitmask[row].zero_()
                for eos in self.eos_token_ids:
                    bitmask[row, eos // 32] |= _bit(eos % 32)
        return bitmask

    def fill_bitmasks_along(self, matcher: Any, draft_token_ids: list[int]) -> "torch.Tensor":
        """1 + len(drafts) bitmask rows: row j is the mask after the first j draft tokens
        (rows past a draft token the grammar rejects repeat the last mask: the verifier
        rejects that token anyway). The matcher is left as it was."""
        import torch

        rows = [self.fill_bitmasks([matcher])[0]]
        consumed = 0
        for token_id in draft_token_ids:
            if consumed == len(rows) - 1 and not matcher.is_error() and matcher.try_consume_tokens([token_id]) == 1:
                consumed += 1
                rows.append(self.fill_bitmasks([matcher])[0])
            else:
                rows.append(rows[-1])
        if consumed:
            matcher.rollback(consumed)
        return torch.stack(rows)


def _bit(position: int) -> int:
    # Bit 31 of an int32 is its sign bit.
    return -(1 << 31) if position == 31 else 1 << position


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " ".join(lines[:3]) if lines else "the grammar is invalid"


class FailedGrammar:
    """Stands in for the matcher of a constraint that did not compile in the runner:
    it allows only EOS, so the request ends instead of failing the whole step."""

    def __init__(self, error: str) -> None:
        self.error = error

    def is_error(self) -> bool:
        return True

    def get_error(self) -> str:
        return self.error

    def consume_token(self, token_id: int) -> bool:
        return False


_compilers: dict[str, GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def compiler_for_model(model_config: Any, load_tokenizer: Callable[[Any], Any]) -> GrammarCompiler:
    """The process-wide compiler of a model's vocabulary (built once, ~1 s, from the tokenizer
    that `load_tokenizer(model_config)` returns)."""
    key = str(model_config.path)
    with _compilers_lock:
        compiler = _compilers.get(key)
        if compiler is None:
            compiler = GrammarCompiler(load_tokenizer(model_config), model_config.vocab_size,
                                       list(model_config.eos_token_ids or []))
            _compilers[key] = compiler
    return compiler
