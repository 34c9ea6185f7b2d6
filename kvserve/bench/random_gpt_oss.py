"""A random-weight gpt-oss-shaped GGUF for timing the gpt-oss paths (`kvserve bench host --model`).

gpt-oss-20b (hidden 2880, 24 layers of 32 experts) does not fit the quick A/B runs of a small
machine; this writes its layer scaled down: sliding (window 128) and full attention layers
alternating, query heads of 64 with attention sinks and biases, a biased router picking the top
4 of `--num-experts` experts as wide as the hidden size, biased clamped-SwiGLU experts, YaRN
RoPE. The experts are MXFP4 as OpenAI ships them (random codes, block exponents of about
1 / sqrt(hidden)), the checkpoint converted by llama.cpp's own convert_hf_to_gguf.py (from
llama-cpp-python's sdist), its other matrices written as `--outtype` (default q8_0); the
default model's tokenizer. The weights are meaningless; step times are what such a model costs.

    python3 -m kvserve.bench.random_gpt_oss --output /tmp/gpt-oss-shaped.gguf
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile


def _mxfp4_blocks(rows_first: tuple[int, ...], generator):
    """(blocks uint8 [..., in / 32, 16], scales uint8 [..., in / 32]) of random MXFP4 rows
    [..., out, in]: codes uniform, block exponents around 2**-log2(sqrt(in))."""
    import torch
    groups = rows_first[-1] // 32
    codes = torch.randint(0, 16, (*rows_first[:-1], groups, 32), generator=generator, dtype=torch.uint8)
    top = -max(int(rows_first[-1] ** 0.5).bit_length() - 1, 1)
    exponents = torch.randint(top - 2, top + 1, (*rows_first[:-1], groups), generator=generator)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponents + 127).to(torch.uint8)


def write_checkpoint(output_dir: str, *, hidden: int, num_layers: int, num_experts: int, seed: int = 0) -> str:
    """The MXFP4 checkpoint (OpenAI's layout) and the default model's tokenizer in `output_dir`."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from kvserve.engine.model_path import default_model_path
    from kvserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    config = transformers.GptOssConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=num_layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(hidden // 256, 1), head_dim=64,
        num_local_experts=num_experts, num_experts_per_tok=4, sliding_window=128, max_position_embeddings=8192,
        layer_types=["sliding_attention", "full_attention"] * (num_layers // 2) + ["sliding_attention"] * (num_layers % 2),
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config.architectures = ["GptOssForCausalLM"]
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in transformers.GptOssForCausalLM(config).state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in shapes.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out] as x @ W
            state[name + "_blocks"], state[name + "_scales"] = _mxfp4_blocks((shape[0], shape[2], shape[1]), generator)
        elif "norm" in name:
            state[name] = torch.ones(shape)
        elif len(shape) == 1:  # biases and sinks
            state[name] = 0.02 * torch.randn(shape, generator=generator)
        else:
            state[name] = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
    os.makedirs(output_dir, exist_ok=True)
    save_file(state, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    config_file = os.path.join(output_dir, "config.json")
    with open(config_file) as f:
        saved = json.load(f)
    saved["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(config_file, "w") as f:
        json.dump(saved, f)
    return output_dir


def main(argv: list[str] | None = None) -> int:
    from kvserve.bench.llama_build import LlamaBuildError, convert_hf_to_gguf

    parser = argparse.ArgumentParser(prog="python3 -m kvserve.bench.random_gpt_oss", description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True, help="the .gguf to write")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size = expert width (a multiple of 256)")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-experts", type=int, default=32)
    parser.add_argument("--outtype", default="q8_0", help="the converter's type for the matrices that are not experts")
    args = parser.parse_args(argv)
    if args.hidden % 256 or args.num_experts < 4:
        print("random_gpt_oss: error: --hidden must be a multiple of 256, --num-experts at least 4", file=sys.stderr)
        return 2
    try:
        with tempfile.TemporaryDirectory(prefix="kvserve-gpt-oss-") as work:
            write_checkpoint(work, hidden=args.hidden, num_layers=args.num_layers, num_experts=args.num_experts)
            print(convert_hf_to_gguf(work, args.output, pre="smollm", outtype=args.outtype))
    except (LlamaBuildError, OSError, ValueError) as exc:
        print(f"random_gpt_oss: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
