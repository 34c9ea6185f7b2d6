"""`kvserve bench structured`: grammar back-ends and the cost of constrained decoding.

Part 1 (`backends`): for llguidance and, when importable, xgrammar, on the
model's vocabulary: tokenizer set-up time, compile time of a JSON schema, a
regex and an EBNF grammar, and the time to fill one token mask while walking
a fixed valid output, for 1 and for `batch` matchers at once.

Part 2 (`engine_single`, `engine`): `kvserve.LLM` throughput on 1 and on
`batch` chat prompts with and without a JSON-schema constraint (same prompts,
greedy, `max_tokens` new tokens each), as output tokens per second and their
ratio, and the runner's mask cost per constrained token: filled on the mask
thread while the forward runs, and what stayed on the critical path (see
`MaskStats`; where the native decoder runs the LM head, the head masks the
logits itself and skips the vocabulary no request may pick).
"""
from __future__ import annotations

import copy
import json
import statistics
import time
from typing import Any, Callable

from kvserve.bench.report import format_table

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
SCHEMA_TEXT = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"]}'
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"
REGEX_TEXT = "555-123-4567"
GRAMMAR = ('root ::= "(" expr ")"\nexpr ::= term (("+" | "-") term)*\n'
           'term ::= [0-9]+ | "(" expr ")"')
GRAMMAR_TEXT = "(12+(3-4)+56)"
# A list with no length bound, so a constrained request runs until max_tokens.
LONG_SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"], "additionalProperties": False}}


def _time_s(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


class _Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        self.vocab_size = vocab_size
        self.setup_s, self.tokenizer = _time_s(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size))
        self.executor = llguidance.LLExecutor()

    def compile(self, kind: str, source: str) -> Any:
        LLMatcher = self.ll.LLMatcher
        grammar = {"json": lambda: LLMatcher.grammar_from_json_schema(source),
                   "regex": lambda: LLMatcher.grammar_from_regex(source),
                   "grammar": lambda: self.ll.grammar_from("grammar", source)}[kind]()
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def matchers(self, compiled: Any, count: int) -> list:
        return [compiled.deep_copy() for _ in range(count)]

    def fill(self, matchers: list, bitmask: Any) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                              bitmask.data_ptr(), bitmask.shape[1] * 4, len(matchers))

    def accept(self, matchers: list, token_id: int) -> None:
        for matcher in matchers:
            assert matcher.consume_token(token_id), matcher.get_error()


class _Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.vocab_size = vocab_size
        self.setup_s, self.compiler = _time_s(lambda: xgrammar.GrammarCompiler(
            xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size), cache_enabled=False))

    def compile(self, kind: str, source: str) -> Any:
        return {"json": self.compiler.compile_json_schema, "regex": self.compiler.compile_regex,
                "grammar": self.compiler.compile_grammar}[kind](source)

    def matchers(self, compiled: Any, count: int) -> list:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(count)]

    def fill(self, matchers: list, bitmask: Any) -> None:
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)

    def accept(self, matchers: list, token_id: int) -> None:
        for matcher in matchers:
            assert matcher.accept_token(token_id)


def _backend_figures(backend: Any, tokenizer: Any, batch: int, rounds: int) -> dict[str, Any]:
    import torch

    cases = {"json": (json.dumps(SCHEMA), SCHEMA_TEXT), "regex": (REGEX, REGEX_TEXT),
             "grammar": (GRAMMAR, GRAMMAR_TEXT)}
    words = backend.vocab_size + 31
    figures: dict[str, Any] = {"backend": backend.name, "tokenizer_setup_s": backend.setup_s, "batch": batch,
                               "cases": {}}
    for kind, (source, text) in cases.items():
        compile_times = []
        for _ in range(rounds):
            seconds, compiled = _time_s(lambda: backend.compile(kind, source))
            compile_times.append(seconds)
        token_ids = list(tokenizer.encode(text, add_special_tokens=False))
        case = {"compile_ms_median": 1e3 * statistics.median(compile_times),
                "compile_ms_first": 1e3 * compile_times[0], "num_tokens": len(token_ids)}
        for label, num_rows in (("single", 1), ("batch", batch)):
            per_token = []
            for _ in range(rounds):
                matchers = backend.matchers(compiled, num_rows)
                bitmask = torch.zeros((num_rows, words // 32), dtype=torch.int32)
                for token_id in token_ids:
                    seconds, _ = _time_s(lambda: backend.fill(matchers, bitmask))
                    per_token.append(seconds)
                    backend.accept(matchers, token_id)
            case[f"mask_us_per_token_{label}"] = 1e6 * statistics.median(per_token) / num_rows
            case[f"mask_us_per_step_{label}"] = 1e6 * statistics.median(per_token)
        figures["cases"][kind] = case
    return figures


def run_backends(model: str | None = None, batch: int = 32, rounds: int = 5) -> list[dict[str, Any]]:
    """Compile and mask timings of each importable grammar back-end on the model's vocabulary."""
    from kvserve.engine.model_path import resolve_model_path
    from kvserve.model.config import ModelConfig
    from kvserve.model.tokenizer_files import load_tokenizer

    path = resolve_model_path(model)
    tokenizer = load_tokenizer(path)
    vocab_size = ModelConfig.from_path(path).vocab_size
    results = []
    for backend_class in (_Llguidance, _Xgrammar):
        try:
            backend = backend_class(tokenizer, vocab_size)
        except ImportError as exc:
            results.append({"backend": backend_class.name, "error": f"not importable: {exc}"})
            continue
        results.append(_backend_figures(backend, tokenizer, batch, rounds))
    return results


def _mask_stats(llm: Any) -> Any:
    """The in-process runner's MaskStats (None when the runner is in other processes)."""
    runner = getattr(llm.engine_core.executor, "model_runner", None)
    return None if runner is None else runner.logits_constraints.stats


def _mask_path(llm: Any) -> str | None:
    """How the in-process runner sets banned logits: the kernel path ("avx512"...) or "torch"."""
    runner = getattr(llm.engine_core.executor, "model_runner", None)
    return None if runner is None else runner.logits_constraints.mask_isa or "torch"


def _mask_figures(before: Any, after: Any) -> dict[str, Any] | None:
    """Per constrained token: fill cost (mask thread, alongside the forward) and what stayed
    on the critical path (handing the fill over before the forward, waiting for it inside
    the LM head or after the forward, masking the logits, advancing the matchers), and the
    share of rows the native LM head masked itself."""
    if before is None or after.rows == before.rows:
        return None
    rows = after.rows - before.rows
    per_token = {name: 1e6 * (getattr(after, name) - getattr(before, name)) / rows
                 for name in ("fill_s", "start_s", "wait_s", "apply_s", "advance_s")}
    fill_s, wait_s = after.fill_s - before.fill_s, after.wait_s - before.wait_s
    return {"tokens": rows, **{f"{name[:-2]}_us_per_token": value for name, value in per_token.items()},
            "critical_path_us_per_token": 1e6 * (after.critical_path_s - before.critical_path_s) / rows,
            "masked_in_lm_head_fraction": (after.head_rows - before.head_rows) / rows,
            "hidden_fraction_of_fill": max(0.0, 1.0 - wait_s / fill_s) if fill_s > 0 else 1.0}


def run_engine(batch: int = 32, max_tokens: int = 64, rounds: int = 3, **engine_kwargs: Any) -> dict[str, Any]:
    """Output tokens/s of `batch` greedy chat requests, unconstrained and under LONG_SCHEMA,
    alternating, and the grammar-mask cost per constrained token inside the engine."""
    from kvserve import LLM, SamplingParams
    from kvserve.sampling_params import StructuredOutputsParams

    llm = LLM(**engine_kwargs)
    try:
        conversations = [[{"role": "user", "content": f"List {i + 3} cities with their population as JSON."}]
                         for i in range(batch)]
        modes = {"unconstrained": SamplingParams(temperature=0.0, max_tokens=max_tokens),
                 "json_schema": SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                               structured_outputs=StructuredOutputsParams(json=LONG_SCHEMA))}
        llm.chat(conversations[:2], modes["json_schema"], use_tqdm=False)  # warm-up, compiles the schema
        per_mode: dict[str, list[float]] = {name: [] for name in modes}
        ratios = []
        stats = _mask_stats(llm)
        mask_before = copy.copy(stats)
        mask_path = _mask_path(llm)
        for _ in range(rounds):
            for name, params in modes.items():
                seconds, outputs = _time_s(lambda: llm.chat(conversations, params, use_tqdm=False))
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                per_mode[name].append(tokens / seconds)
            ratios.append(per_mode["json_schema"][-1] / per_mode["unconstrained"][-1])
    finally:
        llm.shutdown()
    return {"batch": batch, "max_tokens": max_tokens, "rounds": rounds,
            "output_tokens_per_s": {name: statistics.median(v) for name, v in per_mode.items()},
            "per_round_tokens_per_s": per_mode, "ratio_per_round": ratios,
            "ratio_constrained_over_unconstrained_median": statistics.median(ratios),
            "mask_in_engine": _mask_figures(mask_before, stats), "mask_path": mask_path}


def run(model: str | None = None, batch: int = 32, rounds: int = 5, max_tokens: int = 64,
        skip_engine: bool = False, **engine_kwargs: Any) -> dict[str, Any]:
    """Both parts (see the module docstring); the engine part at batch 1 and, when larger, at `batch`."""
    result: dict[str, Any] = {"backends": run_backends(model, batch, rounds)}
    if not skip_engine:
        result["engine_single"] = run_engine(1, max_tokens, rounds, model=model, **engine_kwargs)
        if batch > 1:
            result["engine"] = run_engine(batch, max_tokens, rounds, model=model, **engine_kwargs)
    return result


def format_result(result: dict[str, Any]) -> str:
    rows = []
    for backend in result["backends"]:
        if "error" in backend:
            rows.append([backend["backend"], "-", backend["error"], "", "", "", ""])
            continue
        for kind, case in backend["cases"].items():
            rows.append([backend["backend"], kind, f"{case['compile_ms_median']:.2f}",
                         f"{case['mask_us_per_token_single']:.1f}", f"{case['mask_us_per_step_batch']:.1f}",
                         f"{case['mask_us_per_token_batch']:.1f}", f"{backend['tokenizer_setup_s']:.2f}"])
    batch = next((b["batch"] for b in result["backends"] if "batch" in b), "")
    text = format_table(["backend", "constraint", "compile ms", "mask us (batch 1)", f"mask us/step (batch {batch})",
                         "us/token in batch", "tokenizer setup s"], rows, title="grammar back-ends (median)")
    for engine in (result.get("engine_single"), result.get("engine")):
        if not engine:
            continue
        tps = engine["output_tokens_per_s"]
        text += (f"\n\nengine, batch {engine['batch']}: unconstrained {tps['unconstrained']:.1f} tok/s, "
                 f"json_schema {tps['json_schema']:.1f} tok/s, ratio "
                 f"{engine['ratio_constrained_over_unconstrained_median']:.2f} (median of per-round ratios)")
        mask = engine.get("mask_in_engine")
        if mask:
            text += (f"\n  mask per token: fill {mask['fill_us_per_token']:.1f} us on the mask thread "
                     f"({100 * mask['hidden_fraction_of_fill']:.0f}% hidden behind the forward); critical path: "
                     f"start {mask['start_us_per_token']:.1f} + wait {mask['wait_us_per_token']:.1f} + apply "
                     f"{mask['apply_us_per_token']:.1f} + advance {mask['advance_us_per_token']:.1f} "
                     f"= {mask['critical_path_us_per_token']:.1f} us ({100 * mask['masked_in_lm_head_fraction']:.0f}% "
                     f"of rows masked in the LM head; kernel path: {engine.get('mask_path')})")
    return text
