/* Instruction sets: the kernels' path codes, the run-time feature bits, and what this
 * translation unit may use (KV_HAVE_*).
 *
 * The build (kvserve/native/build.py) compiles every unit with the instruction sets
 * the run-time probe approved (CPUID and what the OS enabled, csrc/cpu/features.c),
 * so a KV_HAVE_* macro is 1 only where this CPU and OS run that code. The kernels
 * still ask kvserve_isa_available() before taking a path a caller names.
 */
#ifndef KVSERVE_ISA_H
#define KVSERVE_ISA_H

#include <stdint.h>

/* The paths a kernel takes, narrowest first (kvserve/native/isa.py ISAS). */
enum KvIsa { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_COUNT = 3 };

/* The kernels that have paths, for kvserve_isa_available (isa.py KERNELS). */
enum KvKernel {
    KV_KERNEL_ATTENTION = 0,  /* paged_attention.c */
    KV_KERNEL_QUANT = 1,      /* quant_linear.c, quant_gemv.c */
    KV_KERNEL_QUANT_GEMM = 2, /* quant_gemm.c */
    KV_KERNEL_BF16 = 3,       /* bf16_rows.c */
    KV_KERNEL_F32_GEMM = 4,   /* f32_gemm.c */
    KV_KERNEL_MASK = 5,       /* grammar_mask.c */
    KV_KERNEL_MAMBA2 = 6,     /* ssm/mamba2_step.c */
    KV_KERNEL_GATED_DELTA = 7, /* ssm/gated_delta_step.c */
    KV_KERNEL_COUNT = 8
};

/* Run-time feature bits (isa.py FEATURES), as kvserve_cpuid_features and
 * kvserve_os_enabled_features report them. */
enum KvFeature {
    KV_FEATURE_AVX = 1 << 0,
    KV_FEATURE_AVX2 = 1 << 1,
    KV_FEATURE_FMA = 1 << 2,
    KV_FEATURE_F16C = 1 << 3,
    KV_FEATURE_AVX512F = 1 << 4,
    KV_FEATURE_AVX512BW = 1 << 5,
    KV_FEATURE_AVX512VL = 1 << 6,
    KV_FEATURE_AVX512VNNI = 1 << 7,
    KV_FEATURE_AVX512BF16 = 1 << 8,
    KV_FEATURE_AMX_TILE = 1 << 9,
    KV_FEATURE_AMX_INT8 = 1 << 10,
    KV_FEATURE_AMX_BF16 = 1 << 11,
    KV_FEATURE_AVX512DQ = 1 << 12,
    KV_FEATURE_AVX512FP16 = 1 << 13,
    KV_FEATURE_APX = 1 << 14,
};

/* XCR0 state components (Intel SDM vol. 1, 13.1). */
#define KV_XCR0_SSE (1ull << 1)
#define KV_XCR0_AVX (1ull << 2)
#define KV_XCR0_OPMASK (1ull << 5)
#define KV_XCR0_ZMM_HI256 (1ull << 6)
#define KV_XCR0_HI16_ZMM (1ull << 7)
#define KV_XCR0_XTILECFG (1ull << 17)
#define KV_XCR0_XTILEDATA (1ull << 18)
#define KV_XCR0_APX (1ull << 19)

/* What this translation unit was compiled to use. */
#if defined(__AVX2__) && defined(__FMA__)
#define KV_HAVE_AVX2_FMA 1
#else
#define KV_HAVE_AVX2_FMA 0
#endif
#if defined(__AVX2__)
#define KV_HAVE_AVX2 1
#else
#define KV_HAVE_AVX2 0
#endif
#if KV_HAVE_AVX2_FMA && defined(__F16C__)
#define KV_HAVE_AVX2_FMA_F16C 1
#else
#define KV_HAVE_AVX2_FMA_F16C 0
#endif
#if defined(__AVX512F__)
#define KV_HAVE_AVX512F 1
#else
#define KV_HAVE_AVX512F 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define KV_HAVE_AVX512_VNNI 1
#else
#define KV_HAVE_AVX512_VNNI 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define KV_HAVE_AVX512_BF16 1
#else
#define KV_HAVE_AVX512_BF16 0
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
#define KV_HAVE_AMX 1
#else
#define KV_HAVE_AMX 0
#endif

#if KV_HAVE_AVX2 || KV_HAVE_AVX512F
#include <immintrin.h>
#endif

#endif /* KVSERVE_ISA_H */
