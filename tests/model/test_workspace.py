"""Reused buffers for a many-token step's intermediates (model/workspace.py): a GGUF model held
as stored, its Q/K/V and gate/up parts multiplied apart into reused buffers (no concatenated
copy) and SiLU-gated from them (the product written over gate), with the norms', O and down projections' outputs in reused buffers
too, gives the same logits bit for bit as the concatenating path with fresh tensors, step after
step (a stale buffer would show), for the tiny llama and qwen (Q/K/V biases) shapes."""
from __future__ import annotations

import pytest
import torch

from kvserve.bench import zoo
from kvserve.model import workspace
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from kvserve.model.quantized import kernel_isa
from kvserve.model.stored_parts import StoredParts
from kvserve.native import cpu_kernels
from helpers.kernel_switches import env_kernels
from paged_kv_helper import PagedRunner, run_teacher_forced

pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(kernel_isa() is None, reason="needs the native kernels")


def _logits(model, monkeypatch, min_rows: int) -> dict[str, torch.Tensor]:
    monkeypatch.setattr(workspace, "MIN_ROWS", min_rows)
    generator = torch.Generator().manual_seed(5)
    lengths = {"a": 150, "b": 97, "c": 70}
    sequences = {r: torch.randint(3, 256, (n + 3,), generator=generator).tolist() for r, n in lengths.items()}
    return run_teacher_forced(PagedRunner(model, block_size=16), sequences, lengths, chunk=80)


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen"])
def test_parts_in_reused_buffers_give_the_concatenating_paths_logits(tmp_path, monkeypatch, shape):
    path = zoo.write_random_gguf(zoo.SHAPES[shape], str(tmp_path / "tiny.q8_0.gguf"), "q8_0")
    model = load_model(ModelConfig.from_path(path), kernel_config=env_kernels(native_decoder=False))
    layer = model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.quant_weight, StoredParts)
    assert isinstance(layer.mlp.gate_up_proj.quant_weight, StoredParts)
    scratch = workspace.scratch
    requests = []
    monkeypatch.setattr(workspace, "scratch", lambda role, *a: requests.append(role) or scratch(role, *a))
    reused = _logits(model, monkeypatch, 64)
    assert {"q", "k", "v", "gate", "up", "normed", "o_proj", "mlp_out"} <= set(requests)
    requests.clear()
    concatenated = _logits(model, monkeypatch, 10 ** 9)
    assert not requests
    for req_id, rows in concatenated.items():
        assert torch.equal(reused[req_id], rows), req_id


def test_silu_mul_parts_equals_the_fused_layout():
    gate_up = torch.randn(7, 2 * 1100, generator=torch.Generator().manual_seed(0)) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.full((7, 1100), float("nan"))
    assert cpu_kernels.silu_mul_parts(gate.contiguous(), up.contiguous(), out) is out
    assert torch.equal(out, cpu_kernels.silu_mul(gate_up))
    in_place = gate.contiguous()
    assert cpu_kernels.silu_mul_parts(in_place, up.contiguous(), in_place) is in_place  # out over gate
    assert torch.equal(in_place, out)
    with pytest.raises(cpu_kernels.KernelArgumentError):
        cpu_kernels.silu_mul_parts(gate, up)  # views with the fused row stride
