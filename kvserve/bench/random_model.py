"""A random-weight model shaped like the default one, with a head count TP can split.

SmolLM2-135M has 9 attention heads and 3 KV heads, so it runs at `-tp 3` but
not at `-tp 2`. Timing tensor parallelism on a 2-core machine needs a model of
the same size that splits two ways: this writes a Llama with the default
model's hidden size, MLP width, layer count and vocabulary, `--num-heads`
query heads and `--num-kv-heads` KV heads of `--head-dim` (default 8, 2, 64),
random float32 weights, and the default model's tokenizer and chat template.
The weights are meaningless; step times are what a trained model of these
shapes costs. With `--hybrid` it writes a Qwen3.5 (dense) hybrid of the same
sizes instead: Gated DeltaNet layers (`--num-heads` value heads and half as many
key heads of `--head-dim`) with every fourth layer full attention, for the
benchmarks of recurrent-state KV groups (`kvserve bench prefix`).

    python3 -m kvserve.bench.random_model --output-dir /tmp/smollm2-h8
    python3 -m kvserve.bench.random_model --hybrid --num-layers 8 --output-dir /tmp/hybrid-8
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace


def write_random_model(output_dir: str, *, num_heads: int = 8, num_kv_heads: int = 2, head_dim: int = 64,
                       num_layers: int | None = None, seed: int = 0, hybrid: bool = False) -> str:
    """Write the model to `output_dir` (safetensors + tokenizer); return the directory."""
    import torch
    import transformers

    from kvserve.bench.model_info import model_shapes, resolve_model_path
    from kvserve.engine.model_path import default_model_path
    from kvserve.engine.tokenizer import load_tokenizer

    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    shapes = model_shapes(resolve_model_path(None))
    shapes = replace(shapes, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     num_layers=num_layers or shapes.num_layers)
    tokenizer = load_tokenizer(default_model_path())
    common = dict(vocab_size=shapes.vocab_size, hidden_size=shapes.hidden_size,
                  intermediate_size=shapes.intermediate_size, num_hidden_layers=shapes.num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                  max_position_embeddings=8192, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    if hybrid:
        config = transformers.Qwen3_5TextConfig(
            **common, linear_num_key_heads=max(num_heads // 2, 1), linear_num_value_heads=num_heads,
            linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_conv_kernel_dim=4)
        config.architectures = ["Qwen3_5ForCausalLM"]
        model_class = transformers.Qwen3_5ForCausalLM
    else:
        config = transformers.LlamaConfig(**common)
        model_class = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model_class(config).eval().save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m kvserve.bench.random_model", description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=None, help="default: the default model's")
    parser.add_argument("--hybrid", action="store_true",
                        help="a Qwen3.5 hybrid (Gated DeltaNet, every fourth layer full attention) instead of a Llama")
    args = parser.parse_args(argv)
    try:
        path = write_random_model(args.output_dir, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                                  head_dim=args.head_dim, num_layers=args.num_layers, hybrid=args.hybrid)
    except (ValueError, OSError) as exc:
        print(f"random_model: error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
