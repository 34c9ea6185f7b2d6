"""The native decoder on a Qwen3.5 dense hybrid (Gated DeltaNet layers + full attention with a
gated output and partial RoPE): its decode steps against the per-op path, teacher forced on
the same tokens, with states read from a cached snapshot (a prefix hit), from zeros (a fresh
one-token prompt; a recompute after preemption) and snapshots written at block boundaries
inside decode steps; its 1- and 2-thread results bit for bit; the steps it declines.

Bound on |native logit - per-op logit|, relative to the logits' scale (at least 1): both paths
run the same float32 operations on the same inputs, the delta rule through the same C kernel;
they differ only in the order of reductions, each moving its sum by at most gamma_128 of the
logits' scale (tests/helpers/float_order.py: no reduction here has more than 128 terms). A
Gated DeltaNet layer chains 11 reductions (two RMSNorms, the in-projections, the convolution,
the L2 norm, the delta rule's two (k.S and q.S), the gated norm, the out-projection, gate/up,
down), an attention layer fewer (float_order's 9 and the Q/K norm), the head 2: for 4 layers
(11 * 4 + 2) * 128 * 2**-24 = 3.5e-4.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from helpers.float_order import FLOAT32_UNIT_ROUNDOFF, REDUCTIONS_IN_HEAD, WIDEST_REDUCTION
from helpers.native_steps import count_native_steps
from helpers.tiny_models import tiny_gated_deltanet_config
from hybrid_runner import HybridRunner
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from kvserve.native import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no native kernels")

DELTANET_REDUCTIONS_PER_LAYER = 11
MAX_RELATIVE_DIFF = (DELTANET_REDUCTIONS_PER_LAYER * 4 + REDUCTIONS_IN_HEAD) * WIDEST_REDUCTION * FLOAT32_UNIT_ROUNDOFF
VOCAB = 256


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    cache = {}

    def get(family: str) -> ModelConfig:
        if family not in cache:
            torch.manual_seed(0)
            path = str(tmp_path_factory.mktemp(family))
            hf = transformers.AutoModelForCausalLM.from_config(tiny_gated_deltanet_config(family, VOCAB),
                                                               attn_implementation="eager")
            hf.eval().save_pretrained(path)
            cache[family] = ModelConfig.from_path(path)
        return cache[family]
    return get


class _Script:
    """One fixed schedule of steps over a HybridRunner, the same tokens whatever the logits
    (teacher forcing): the logits of every step, and which steps were decode steps."""

    def __init__(self, model, threads: int | None = None) -> None:
        self.model, self.threads = model, threads
        self.runner = HybridRunner(model)
        self.generator = torch.Generator().manual_seed(5)
        self.logits: list[dict[str, torch.Tensor]] = []
        self.decode_steps = 0

    def token(self) -> int:
        return int(torch.randint(3, VOCAB, (1,), generator=self.generator))

    def prompt(self, n: int) -> list[int]:
        return [self.token() for _ in range(n)]

    def step(self, schedule: dict[str, int]) -> None:
        self.logits.append(self.runner.step(schedule))
        self.decode_steps += all(n == 1 for n in schedule.values())
        if self.threads is not None:  # the decoder is built by the first step
            self.model.native_decoder.num_threads = self.threads

    def decode(self, req_ids: list[str], num_steps: int) -> None:
        """Each request one token a step (a new teacher token once its prompt is computed)."""
        for _ in range(num_steps):
            for req_id in req_ids:
                req = self.runner.requests[req_id]
                if req.num_computed == len(req.tokens):
                    self.runner.append(req_id, self.token())
            self.step({req_id: 1 for req_id in req_ids})

    def run(self) -> "_Script":
        runner = self.runner
        runner.add("a", self.prompt(9))
        runner.add("b", self.prompt(6))
        self.step({"a": 9, "b": 6})  # prefill: the per-op path
        runner.add("e", self.prompt(1))  # its one prompt token: a decode step from zeros
        self.decode(["a", "b", "e"], 9)  # a crosses the block boundaries at 12 and 16
        snapshot_slot = runner.requests["a"].snapshots[16]
        self.snapshot = self._slot(snapshot_slot)
        # A prefix hit on a's snapshot after 16 tokens, the prompt's last token a decode step
        # reading that cached snapshot.
        runner.add("c", runner.requests["a"].tokens[:16] + self.prompt(1), hit_from="a", hit_tokens=16)
        self.decode(["c", "b"], 5)
        self.snapshot_after = self._slot(snapshot_slot)
        # c preempted: its tokens recomputed from zeros (prefill), then decoded on.
        recomputed = list(runner.requests["c"].tokens)
        runner.add("d", recomputed)
        self.step({"d": len(recomputed)})
        self.decode(["d"], 4)
        return self

    def _slot(self, slot: int) -> list[torch.Tensor]:
        return [t[slot].clone() for name in self.runner.state_layers for t in self.runner.kv_caches[name]]


def _per_op(config: ModelConfig):
    model = load_model(config)
    model._native = None  # decided: this model never takes the native call
    return model


def test_native_decode_steps_match_the_per_op_path(configs, monkeypatch):
    config = configs("qwen3_5")
    per_op = _Script(_per_op(config)).run()
    native_steps = count_native_steps(monkeypatch)
    native = _Script(load_model(config)).run()
    assert native.model.native_decoder is not None
    assert native_steps[0] == native.decode_steps == 18  # every decode step, no prefill step
    assert len(native.logits) == len(per_op.logits)
    for ours, theirs in zip(native.logits, per_op.logits):
        assert ours.keys() == theirs.keys()
        for req_id in ours:
            scale = max(1.0, theirs[req_id].abs().max().item())
            assert (ours[req_id] - theirs[req_id]).abs().max().item() <= MAX_RELATIVE_DIFF * scale, req_id
    # The cached snapshot c's first step read is left as it was (c wrote its own slots).
    assert all(torch.equal(x, y) for x, y in zip(native.snapshot, native.snapshot_after))
    assert all(t.abs().max() > 0 for t in native.snapshot)


def test_one_and_two_threads_give_the_same_bits(configs, monkeypatch):
    """The threads split the projections' rows, the convolution's channels and the value heads;
    every value is computed as on one thread."""
    config = configs("qwen3_5")
    native_steps = count_native_steps(monkeypatch)
    one, two = _Script(load_model(config), threads=1).run(), _Script(load_model(config), threads=2).run()
    assert native_steps[0] == one.decode_steps + two.decode_steps
    for a, b in zip(one.logits, two.logits):
        assert all(torch.equal(a[r], b[r]) for r in a)
    for name in one.runner.state_layers:
        assert all(torch.equal(x, y) for x, y in zip(one.runner.kv_caches[name], two.runner.kv_caches[name]))


def test_declines_what_it_does_not_run(configs, monkeypatch):
    """Qwen3-Next's mixture-of-experts layers keep the per-op path (no decoder is built); a
    Qwen3.5 step with a request of several tokens (prefill) is declined step by step."""
    model = load_model(configs("qwen3_next"))
    runner = HybridRunner(model)
    runner.add("a", [5, 6, 7])
    runner.step({"a": 3})
    assert model.native_decoder is None
    native_steps = count_native_steps(monkeypatch)
    model = load_model(configs("qwen3_5"))
    runner = HybridRunner(model)
    runner.add("a", [5, 6, 7])
    runner.add("b", [8])
    runner.step({"a": 2, "b": 1})
    assert model.native_decoder is not None and native_steps[0] == 0
    runner.step({"a": 1})
    assert native_steps[0] == 1
