"""The native kernels' switches: `KernelConfig`, read once from the KVSERVE_* environment
variables (`KernelConfig.from_env`) and handed down to the runner, the loader and the
grammar mask. Importing this module needs no torch and builds nothing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from kvserve.errors import ConfigError
from kvserve.native.isa import ISAS

# Kernel switches (environment variable -> KernelConfig field), documented in docs/kernels.md.
CPU_KERNELS_ENV = "KVSERVE_CPU_KERNELS"
SMALL_BATCH_MATMUL_ENV = "KVSERVE_SMALL_BATCH_MATMUL"
CPU_PACKED_WEIGHTS_ENV = "KVSERVE_CPU_PACKED_WEIGHTS"
QUANT_ISA_ENV = "KVSERVE_QUANT_ISA"
QUANT_ACT_BITS_ENV = "KVSERVE_QUANT_ACT_BITS"
QUANT_GEMM_ROWS_ENV = "KVSERVE_QUANT_GEMM_ROWS"
QUANT_GEMM_DTYPE_ENV = "KVSERVE_QUANT_GEMM_DTYPE"
QUANT_PANEL_ROWS_ENV = "KVSERVE_QUANT_PANEL_ROWS"
NATIVE_DECODER_ENV = "KVSERVE_NATIVE_DECODER"
SHM_ALL_REDUCE_ENV = "KVSERVE_SHM_ALL_REDUCE"
GRAMMAR_MASK_ISA_ENV = "KVSERVE_GRAMMAR_MASK_ISA"
REPACK_CACHE_ENV = "KVSERVE_REPACK_CACHE"
PREFILL_ATTENTION_ENV = "KVSERVE_PREFILL_ATTENTION"
EXPERT_HUGE_FOLIOS_ENV = "KVSERVE_EXPERT_HUGE_FOLIOS"
# The quantized matmul's kernel paths, narrowest first (every kernel's: `isa.ISAS`).
QUANT_ISAS = ISAS
# KVSERVE_GRAMMAR_MASK_ISA: one of QUANT_ISAS (the grammar-mask kernel's paths), or this.
GRAMMAR_MASK_TORCH = "torch"


@dataclass(frozen=True)
class KernelConfig:
    """Which native CPU kernels the model may use, read once at start-up
    (`KernelConfig.from_env`) and handed down to the runner and the loader.

    `cpu_kernels`: the native kernels at all (attention, norms, RoPE, SiLU, the
    quantized and small-batch matmuls); off, every op takes the torch path.
    `small_batch_matmul`: keep plain weight copies next to the packed ones for
    the small-batch kernel. `packed_weights`: pack linear weights for oneDNN.
    `quant_isa`: cap the quantized matmul's path (None: the widest the CPU runs).
    `quant_act_bits`: 8 (as llama.cpp; the default: faster) or 16, how finely that kernel
    rounds activations.
    `quant_gemm_rows`: steps of at least this many rows (0: never) dequantize quantized
    weights and run a dense GEMM in `quant_gemm_dtype` ("bfloat16", "float32"; None:
    bfloat16 on CPUs with native bfloat16, else float32).
    `quant_panel_rows`: steps of at least this many rows (and fewer than `quant_gemm_rows`;
    0: never) run the panel GEMM (csrc/linear/quant_gemm.c) instead of the integer kernel.
    `native_decoder`: steps of a few tokens run the whole decoder stack in one native call.
    `shm_all_reduce`: tensor-parallel CPU ranks on one host all-reduce inside that call
    through shared memory (model/shm_all_reduce.py) rather than through gloo.
    `grammar_mask_isa`: cap the grammar-mask kernel's path (None: the widest the CPU
    runs; "torch": no kernel, torch's masked_fill_).
    `repack_cache`: write a GGUF's weights, repacked for the quantized kernels, once to the
    cache and map them on later loads (model/repack_cache.py); off, every load repacks.
    `prefill_attention`: prompt chunks of more than a few tokens attend through the tiled
    prefill kernel (csrc/attention/prefill_attention.c); off, through torch's SDPA and matmuls.
    `expert_huge_folios` (off by default): a GGUF's experts, read when a token first picks them,
    come in as whole 2 MiB folios (one TLB entry each; loader._populate_stored_views), which
    pages in the parts of neighbouring experts that share a picked one's windows.
    """

    cpu_kernels: bool = True
    small_batch_matmul: bool = True
    packed_weights: bool = True
    quant_isa: str | None = None
    quant_act_bits: int = 8
    quant_gemm_rows: int = 320
    quant_gemm_dtype: str | None = None
    quant_panel_rows: int = 4
    native_decoder: bool = True
    shm_all_reduce: bool = True
    grammar_mask_isa: str | None = None
    repack_cache: bool = True
    prefill_attention: bool = True
    expert_huge_folios: bool = False

    def __post_init__(self) -> None:
        if self.quant_isa is not None and self.quant_isa not in QUANT_ISAS:
            raise ConfigError(f"{QUANT_ISA_ENV} must be one of {', '.join(QUANT_ISAS)}, got {self.quant_isa!r}")
        if self.quant_act_bits not in (8, 16):
            raise ConfigError(f"{QUANT_ACT_BITS_ENV} must be 8 or 16, got {self.quant_act_bits!r}")
        if not isinstance(self.quant_gemm_rows, int) or self.quant_gemm_rows < 0:
            raise ConfigError(f"{QUANT_GEMM_ROWS_ENV} must be a non-negative integer, got {self.quant_gemm_rows!r}")
        if self.quant_gemm_dtype not in (None, "bfloat16", "float32"):
            raise ConfigError(f"{QUANT_GEMM_DTYPE_ENV} must be bfloat16 or float32, got {self.quant_gemm_dtype!r}")
        if not isinstance(self.quant_panel_rows, int) or self.quant_panel_rows < 0:
            raise ConfigError(f"{QUANT_PANEL_ROWS_ENV} must be a non-negative integer, got {self.quant_panel_rows!r}")
        if self.grammar_mask_isa not in (None, GRAMMAR_MASK_TORCH, *QUANT_ISAS):
            raise ConfigError(f"{GRAMMAR_MASK_ISA_ENV} must be one of {GRAMMAR_MASK_TORCH}, {', '.join(QUANT_ISAS)}, "
                              f"got {self.grammar_mask_isa!r}")

    @classmethod
    def from_env(cls, environ: "os._Environ[str] | dict[str, str] | None" = None) -> "KernelConfig":
        """The switches as the environment sets them (the one place that reads them)."""
        env = os.environ if environ is None else environ
        bits = env.get(QUANT_ACT_BITS_ENV, "8").strip()
        if bits not in ("8", "16"):
            raise ConfigError(f"{QUANT_ACT_BITS_ENV} must be 8 or 16, got {bits!r}")
        gemm_rows = env.get(QUANT_GEMM_ROWS_ENV, "320").strip()
        if not gemm_rows.isdigit():
            raise ConfigError(f"{QUANT_GEMM_ROWS_ENV} must be a non-negative integer, got {gemm_rows!r}")
        panel_rows = env.get(QUANT_PANEL_ROWS_ENV, "4").strip()
        if not panel_rows.isdigit():
            raise ConfigError(f"{QUANT_PANEL_ROWS_ENV} must be a non-negative integer, got {panel_rows!r}")
        return cls(cpu_kernels=_switched_on(env, CPU_KERNELS_ENV),
                   small_batch_matmul=_switched_on(env, SMALL_BATCH_MATMUL_ENV),
                   packed_weights=_switched_on(env, CPU_PACKED_WEIGHTS_ENV),
                   quant_isa=env.get(QUANT_ISA_ENV, "").strip().lower() or None,
                   quant_act_bits=int(bits), quant_gemm_rows=int(gemm_rows),
                   quant_gemm_dtype=env.get(QUANT_GEMM_DTYPE_ENV, "").strip().lower() or None,
                   quant_panel_rows=int(panel_rows),
                   native_decoder=_switched_on(env, NATIVE_DECODER_ENV),
                   shm_all_reduce=_switched_on(env, SHM_ALL_REDUCE_ENV),
                   grammar_mask_isa=env.get(GRAMMAR_MASK_ISA_ENV, "").strip().lower() or None,
                   repack_cache=_switched_on(env, REPACK_CACHE_ENV),
                   prefill_attention=_switched_on(env, PREFILL_ATTENTION_ENV),
                   expert_huge_folios=_switched_on(env, EXPERT_HUGE_FOLIOS_ENV, default="0"))


def _switched_on(env, name: str, default: str = "1") -> bool:
    """A switch, on by default unless `default` is "0": off when set to 0, false, no or off."""
    return env.get(name, default).strip().lower() not in ("0", "false", "no", "off")
