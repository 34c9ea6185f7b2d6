"""How each `kvserve bench` sub-command's result is shown: its table and, where a picture
helps, the bars of its PNG (labels, values, title, y label)."""

from __future__ import annotations

import json
from typing import Any, Callable


def _format_scheduler(result: dict[str, Any]) -> str:
    from kvserve.bench.report import format_table

    ratios = result.get("ratio_kvserve_over_vllm") or {}
    vllm = result.get("vllm") or {}
    rows = []
    for key, entry in result["kvserve"].items():
        vllm_us = (vllm.get(key) or {}).get("us_per_step") if isinstance(vllm, dict) else None
        ratio = ratios.get(key) if isinstance(ratios, dict) else None
        rows.append([entry["num_running"], entry["us_per_step"], entry["us_per_request_step"],
                     "-" if vllm_us is None else vllm_us, "-" if ratio is None else f"{ratio:.2f}"])
    return format_table(["running requests", "kvserve us/step", "us/request/step", "vLLM us/step",
                         "kvserve / vLLM"], rows,
                        title="scheduler: schedule() + update_from_output() in steady decode")


def _format_kv(result: dict[str, Any]) -> str:
    from kvserve.bench.report import format_table

    rows = [[phase, result[phase]["requests_per_s"], result[phase]["ops_per_s"], result[phase]["hit_rate"]]
            for phase in ("allocate_free", "prefix_hit") if phase in result]
    text = format_table(["phase", "requests/s", "ops/s", "hit rate"], rows,
                        title=f"kv: {result['trace']['num_requests']:,} requests, synthetic trace")
    if result.get("vllm"):
        text += "\nvLLM: " + json.dumps(result["vllm"], default=str)
    return text


def _roofline_plot(result):
    from kvserve.bench import roofline
    labels, values = roofline.plot_values(result)
    return labels, values, "tokens/s ceilings of this machine for the model", "tokens/s"


def _throughput_plot(result):
    labels = [f"{r['engine']}\n{r['workload']}" for r in result["results"]]
    return labels, [r["output_tokens_per_s"] for r in result["results"]], "offline throughput", "output tokens/s"


def _compare_plot(result):
    from kvserve.bench import compare
    labels, values = compare.plot_values(result)
    return labels, values, f"kvserve vs references ({result['dtype']})", "output tokens/s"


def _serve_compare_plot(result):
    from kvserve.bench import serve_compare
    labels, values = serve_compare.plot_values(result)
    return labels, values, "serving: output tokens/s at fixed concurrency", "output tokens/s"


def _prefix_plot(result):
    from kvserve.bench import prefix
    labels, values = prefix.plot_values(result)
    return labels, values, "TTFT with a shared prefix", "mean TTFT ms"


def _profile_plot(result):
    from kvserve.bench import profile
    labels, values = profile.plot_values(result)
    return labels, values, "one decode step (profiled)", "ms per step"


def _host_plot(result):
    from kvserve.bench import host
    labels, values = host.plot_values(result)
    return labels, values, "host work per step (wall - native call)", "ms per step"


def _serve_plot(result):
    labels, values = [], []
    for metric in ("ttft", "tpot", "itl"):
        for pct in ("p50", "p90", "p99"):
            labels.append(f"{metric.upper()} {pct}")
            values.append(result[metric][f"{pct}_ms"])
    return labels, values, "serving latency", "ms"


def _lazy_formatter(module: str) -> Callable[[dict], str]:
    def format_result(result: dict[str, Any]) -> str:
        import importlib
        return importlib.import_module(f"kvserve.bench.{module}").format_result(result)
    return format_result


FORMATTERS = {
    # name: (result -> table text, result -> bar-plot values or None)
    "roofline": (_lazy_formatter("roofline"), _roofline_plot),
    "throughput": (_lazy_formatter("throughput"), _throughput_plot),
    "serve": (_lazy_formatter("serve"), _serve_plot),
    "serve-compare": (_lazy_formatter("serve_compare"), _serve_compare_plot),
    "prefix": (_lazy_formatter("prefix"), _prefix_plot),
    "compare": (_lazy_formatter("compare"), _compare_plot),
    "profile": (_lazy_formatter("profile"), _profile_plot),
    "host": (_lazy_formatter("host"), _host_plot),
    "scheduler": (_format_scheduler, None),
    "kv": (_format_kv, None),
    "attention": (_lazy_formatter("attention"), None),
    "gguf": (_lazy_formatter("gguf_kernels"), None),
    "structured": (_lazy_formatter("structured"), None),
    "spec": (_lazy_formatter("spec"), None),
    "route": (_lazy_formatter("route"), None),
    "plan-check": (_lazy_formatter("plan_check"), None),
    "allreduce": (_lazy_formatter("interconnect"), None),
    "startup": (_lazy_formatter("startup"), None),
}
