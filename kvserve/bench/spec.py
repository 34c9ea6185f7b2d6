"""`kvserve bench spec`: speculative decoding on against off, side by side.

Two engines with the same settings are loaded, one with `speculative_config`.
Each round runs, on both (the order alternates round by round):
- `grounded`: the input-grounded chats (copy, edit, quote), one at a time;
- `unrelated`: the unrelated chats, one at a time;
- `unrelated batch`: all the unrelated chats at once.
Tokens/s of a scenario is its generated tokens over its wall time; the
speed-up is the median over rounds of the per-round ratio on / off. Greedy
outputs of the two engines must be token-identical (reported, per chat).

With `control`, a third engine without speculation runs too (an A/A control):
the median of its per-round ratio to the first one, reported next to the
speed-up, is what the measurement resolves (1.00x on a quiet machine); the
engines' order rotates round by round, so none always runs first.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from typing import Any

from kvserve.bench.report import format_table
from kvserve.bench.spec_chats import GROUNDED_CHATS, UNRELATED_CHATS, as_conversation

DEFAULT_SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4,
                              "prompt_lookup_min": 2, "prompt_lookup_max": 5}
SCENARIOS = ("grounded", "unrelated", "unrelated batch")


def _scenario_chats(scenario: str) -> tuple[list[str], list[list[dict]], bool]:
    """(names, conversations, sent as one batch)."""
    if scenario == "grounded":
        return list(GROUNDED_CHATS), [as_conversation(t) for t in GROUNDED_CHATS.values()], False
    names = [f"unrelated {i}" for i in range(len(UNRELATED_CHATS))]
    return names, [as_conversation(t) for t in UNRELATED_CHATS], scenario == "unrelated batch"


def _run_scenario(llm, scenario: str, params) -> dict[str, Any]:
    names, conversations, batched = _scenario_chats(scenario)
    started = time.perf_counter()
    if batched:
        outputs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outputs = [llm.chat(conversation, params, use_tqdm=False)[0] for conversation in conversations]
    elapsed_s = time.perf_counter() - started
    completions = [output.outputs[0] for output in outputs]
    num_tokens = sum(len(c.token_ids) for c in completions)
    drafts = [c.spec_decode for c in completions if c.spec_decode is not None]
    return {
        "tokens": {name: list(c.token_ids) for name, c in zip(names, completions)},
        "num_tokens": num_tokens,
        "elapsed_s": elapsed_s,
        "tokens_per_s": num_tokens / elapsed_s,
        "num_drafts": sum(d.num_drafts for d in drafts),
        "num_draft_tokens": sum(d.num_draft_tokens for d in drafts),
        "num_accepted_tokens": sum(d.num_accepted_tokens for d in drafts),
    }


def run(*, rounds: int = 3, max_tokens: int = 128, scenarios: tuple[str, ...] = SCENARIOS,
        speculative_config: dict | str | None = None, draft_layers: int | None = None, control: bool = False,
        **engine_kwargs: Any) -> dict[str, Any]:
    """Tokens/s with speculation on and off per scenario, per-round ratios and their medians
    (with `control`, also an A/A ratio between two engines without speculation).

    With `draft_layers` the method is draft_model, the draft the target cut to that many
    layers (`draft_export`); `speculative_config` may then set its other keys."""
    if draft_layers is None:
        return _run_engines(rounds, max_tokens, scenarios, speculative_config or DEFAULT_SPECULATIVE_CONFIG,
                            engine_kwargs, control)
    with tempfile.TemporaryDirectory(prefix="kvserve-draft-") as draft_dir:
        config = _draft_config(speculative_config, engine_kwargs.get("model"), draft_layers, draft_dir)
        result = _run_engines(rounds, max_tokens, scenarios, config, engine_kwargs, control)
    result["draft_layers"] = draft_layers
    return result


def _draft_config(speculative_config: dict | str | None, model: str | None, draft_layers: int,
                  draft_dir: str) -> dict[str, Any]:
    """`speculative_config` (JSON text or dict) with method draft_model and the cut draft's path."""
    from kvserve.bench.draft_export import write_truncated_gguf
    from kvserve.engine.model_path import resolve_model_path

    config = json.loads(speculative_config) if isinstance(speculative_config, str) else dict(speculative_config or {})
    config.setdefault("num_speculative_tokens", DEFAULT_SPECULATIVE_CONFIG["num_speculative_tokens"])
    config["method"] = "draft_model"
    config["model"] = write_truncated_gguf(resolve_model_path(model), draft_layers, draft_dir)
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        config.pop(key, None)
    return config


def engine_order(round_index: int, names: list[str]) -> list[str]:
    """The engines' order in a round: rotated by one each round (two engines alternate)."""
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def _run_engines(rounds: int, max_tokens: int, scenarios: tuple[str, ...], speculative_config,
                 engine_kwargs: dict[str, Any], control: bool = False) -> dict[str, Any]:
    from kvserve import LLM, SamplingParams
    from kvserve.spec_decode.config import SpeculativeConfig

    spec_config = SpeculativeConfig.from_value(speculative_config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    engines = {"off": LLM(**engine_kwargs), "on": LLM(speculative_config=spec_config, **engine_kwargs)}
    if control:
        engines["control"] = LLM(**engine_kwargs)
    try:
        for llm in engines.values():  # warm-up: kernels, caches, first-call costs
            llm.chat(as_conversation("Say hello."), SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        per_round = []
        for round_index in range(rounds):
            order = engine_order(round_index, list(engines))
            measured = {scenario: {name: _run_scenario(engines[name], scenario, params) for name in order}
                        for scenario in scenarios}
            per_round.append(measured)
    finally:
        for llm in engines.values():
            llm.shutdown()
    return _summarize(per_round, scenarios, spec_config, engine_kwargs, max_tokens)


def _summarize(per_round: list[dict], scenarios: tuple[str, ...], spec_config, engine_kwargs: dict,
               max_tokens: int) -> dict[str, Any]:
    rows = []
    for scenario in scenarios:
        runs = [measured[scenario] for measured in per_round]
        ratios = [run["on"]["tokens_per_s"] / run["off"]["tokens_per_s"] for run in runs]
        mismatched = sorted({name for run in runs for name, tokens in run["on"]["tokens"].items()
                             if tokens != run["off"]["tokens"][name]})
        draft_tokens = sum(run["on"]["num_draft_tokens"] for run in runs)
        drafts = sum(run["on"]["num_drafts"] for run in runs)
        accepted = sum(run["on"]["num_accepted_tokens"] for run in runs)
        rows.append({
            "scenario": scenario,
            "off_tokens_per_s": [run["off"]["tokens_per_s"] for run in runs],
            "on_tokens_per_s": [run["on"]["tokens_per_s"] for run in runs],
            "per_round_ratio": ratios,
            "median_ratio": statistics.median(ratios),
            "greedy_outputs_identical": not mismatched,
            "mismatched_chats": mismatched,
            "num_drafts": drafts,
            "num_draft_tokens": draft_tokens,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
            "tokens_per_round": runs[0]["on"]["num_tokens"],
            **_control_summary(runs),
        })
    return {"speculative_config": vars(spec_config), "engine_kwargs": engine_kwargs, "max_tokens": max_tokens,
            "rounds": len(per_round), "scenarios": rows,
            "outputs_last_round": {s: per_round[-1][s]["off"]["tokens"] for s in scenarios}}


def _control_summary(runs: list[dict]) -> dict[str, Any]:
    """The A/A control of a scenario's runs (none without a control engine): its per-round
    ratio to the engine without speculation, their median, and whether the two emitted the
    same tokens (they must: the same engine twice)."""
    if "control" not in runs[0]:
        return {}
    ratios = [run["control"]["tokens_per_s"] / run["off"]["tokens_per_s"] for run in runs]
    return {"control_tokens_per_s": [run["control"]["tokens_per_s"] for run in runs],
            "control_per_round_ratio": ratios, "control_median_ratio": statistics.median(ratios),
            "control_outputs_identical": all(run["control"]["tokens"] == run["off"]["tokens"] for run in runs)}


def format_result(result: dict[str, Any]) -> str:
    control = "control_median_ratio" in result["scenarios"][0]
    return format_table(
        ["scenario", "off tok/s", "on tok/s", "median on/off", *(["A/A off/off"] if control else []), "identical",
         "accept rate", "mean acc. len"],
        [[r["scenario"], statistics.median(r["off_tokens_per_s"]), statistics.median(r["on_tokens_per_s"]),
          f"{r['median_ratio']:.3f}x", *([f"{r['control_median_ratio']:.3f}x"] if control else []),
          "yes" if r["greedy_outputs_identical"] else "NO",
          r["acceptance_rate"], r["mean_accepted_length"]] for r in result["scenarios"]],
        title=(f"spec: {result['speculative_config']['method']}"
               f"{' (target cut to %d layers)' % result['draft_layers'] if result.get('draft_layers') else ''} "
               f"k={result['speculative_config']['num_speculative_tokens']}, "
               f"{result['rounds']} rounds, max_tokens {result['max_tokens']}"))
