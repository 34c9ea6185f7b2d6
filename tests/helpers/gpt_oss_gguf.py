"""A tiny random gpt-oss whose experts are MXFP4, as OpenAI ships gpt-oss: the checkpoint in
OpenAI's layout (`*_blocks` / `*_scales` and `quantization_config.quant_method: mxfp4`), the
same model in float32 with those experts dequantized (exact: every MXFP4 value is a float32),
for transformers, and the GGUF that llama.cpp's own convert_hf_to_gguf.py makes of the MXFP4
checkpoint (its MXFP4 experts repacked to ggml's blocks, everything else float32)."""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from helpers.harmony_model import save_tiny_gpt_oss

# E2M1: the 16 values of an MXFP4 code (sign, 2 exponent bits, 1 mantissa bit).
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# One merge, so that the GGUF carries `tokenizer.ggml.merges` (transformers cannot rebuild a
# byte-level vocabulary without them).
MERGES = (("a", "b"),)


def random_mxfp4(shape: tuple[int, ...], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks uint8 [*shape[:-1], shape[-1] / 32, 16], scales uint8 [*shape[:-1], shape[-1] / 32],
    the float32 values [*shape]) of random MXFP4 rows: codes uniform, the block exponents
    2**-6 to 2**-4 (values up to 0.375, the size of the tiny model's 0.2-std weights). Code 2k
    of a block is byte k's low nibble, 2k + 1 its high one (OpenAI's and transformers' order)."""
    groups = shape[-1] // 32
    codes = torch.randint(0, 16, (*shape[:-1], groups, 32), generator=generator, dtype=torch.uint8)
    exponents = torch.randint(-6, -3, (*shape[:-1], groups), generator=generator)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    values = FP4_VALUES[codes.long()] * torch.pow(2.0, exponents.float()).unsqueeze(-1)
    return blocks, (exponents + 127).to(torch.uint8), values.reshape(shape)


def save_mxfp4_gpt_oss(reference_dir: str, mxfp4_dir: str, seed: int = 1234) -> None:
    """Write the float32 model (experts dequantized) to `reference_dir` and the MXFP4 checkpoint
    to `mxfp4_dir`. gpt-oss keeps gate_up [E, hidden, 2I] (gate and up columns interleaved)
    and down [E, I, hidden] as x @ W; the MXFP4 blocks run along the input (hidden resp. I)."""
    save_tiny_gpt_oss(reference_dir, seed=seed, merges=MERGES)
    weights_file = os.path.join(reference_dir, "model.safetensors")
    state = load_file(weights_file)
    packed = dict(state)
    generator = torch.Generator().manual_seed(seed)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows_first = state[name].transpose(1, 2)  # [E, out, in]
        blocks, scales, values = random_mxfp4(tuple(rows_first.shape), generator)
        state[name] = values.transpose(1, 2).contiguous()
        del packed[name]
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
    save_file(state, weights_file, metadata={"format": "pt"})
    shutil.copytree(reference_dir, mxfp4_dir, dirs_exist_ok=True)
    save_file(packed, os.path.join(mxfp4_dir, "model.safetensors"), metadata={"format": "pt"})
    config_file = os.path.join(mxfp4_dir, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    with open(config_file, "w") as f:
        json.dump(config, f)


def converter_or_skip() -> str:
    """llama.cpp's convert_hf_to_gguf.py (`converter_script`), or the calling test skipped where
    neither the cached sdist nor a package index has it."""
    import pytest
    from kvserve.bench.llama_build import LlamaBuildError, converter_script
    try:
        return converter_script()
    except LlamaBuildError as exc:
        pytest.skip(f"llama.cpp's converter is not available: {exc}")


def convert_to_gguf(model_dir: str, out_path: str, converter: str, pre: str = "gpt-4o", outtype: str = "f32",
                    extra_args: tuple[str, ...] = ()) -> str:
    """Run llama.cpp's `converter` (convert_hf_to_gguf.py) on `model_dir`, tensors that are not
    MXFP4 written as `outtype`, the tokenizer's pre-tokenizer named `pre`; returns `out_path`."""
    from kvserve.bench.llama_build import convert_hf_to_gguf
    return convert_hf_to_gguf(model_dir, out_path, pre, outtype, extra_args, converter)
