/* The run-time probe: which instruction sets this CPU has (CPUID) and which of them
 * the OS has enabled (XCR0, and for AMX the per-process permission), and the one
 * answer every kernel and the Python side take: kvserve_isa_available(kernel, path).
 *
 * An instruction set whose registers the OS does not save on a context switch
 * (XCR0 bit clear) faults or silently corrupts state even where CPUID advertises
 * it: a hypervisor or a kernel booted with AVX-512 off does exactly that. AMX also
 * needs the process to ask Linux for the tile data state (arch_prctl
 * ARCH_REQ_XCOMP_PERM) before the first tile instruction.
 *
 * This file is also built alone, with no instruction-set flags, as the probe the
 * build runs first to choose the flags the kernels are compiled with.
 */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include "kvserve.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define KV_X86 1
#else
#define KV_X86 0
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

#define AVX_STATE (KV_XCR0_SSE | KV_XCR0_AVX)
#define AVX512_STATE (KV_XCR0_OPMASK | KV_XCR0_ZMM_HI256 | KV_XCR0_HI16_ZMM)
#define AMX_STATE (KV_XCR0_XTILECFG | KV_XCR0_XTILEDATA)

#define AVX_FAMILY (KV_FEATURE_AVX | KV_FEATURE_AVX2 | KV_FEATURE_FMA | KV_FEATURE_F16C)
#define AVX512_FAMILY                                                                                    \
    (KV_FEATURE_AVX512F | KV_FEATURE_AVX512BW | KV_FEATURE_AVX512VL | KV_FEATURE_AVX512VNNI |           \
     KV_FEATURE_AVX512BF16 | KV_FEATURE_AVX512DQ | KV_FEATURE_AVX512FP16)
#define AMX_FAMILY (KV_FEATURE_AMX_TILE | KV_FEATURE_AMX_INT8 | KV_FEATURE_AMX_BF16)

static uint64_t bit(uint32_t reg, int n, uint64_t feature) { return (reg >> n) & 1 ? feature : 0; }

uint64_t kvserve_cpuid_features(void) {
#if KV_X86
    unsigned a, b, c, d;
    uint64_t f = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    f |= bit(c, 12, KV_FEATURE_FMA) | bit(c, 28, KV_FEATURE_AVX) | bit(c, 29, KV_FEATURE_F16C);
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        f |= bit(b, 5, KV_FEATURE_AVX2) | bit(b, 16, KV_FEATURE_AVX512F) | bit(b, 17, KV_FEATURE_AVX512DQ) |
             bit(b, 30, KV_FEATURE_AVX512BW) | bit(b, 31, KV_FEATURE_AVX512VL);
        f |= bit(c, 11, KV_FEATURE_AVX512VNNI);
        f |= bit(d, 22, KV_FEATURE_AMX_BF16) | bit(d, 23, KV_FEATURE_AVX512FP16) | bit(d, 24, KV_FEATURE_AMX_TILE) |
             bit(d, 25, KV_FEATURE_AMX_INT8);
        unsigned max_subleaf = a;
        if (max_subleaf >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d))
            f |= bit(a, 5, KV_FEATURE_AVX512BF16) | bit(d, 21, KV_FEATURE_APX);
    }
    return f;
#else
    return 0;
#endif
}

/* XCR0 (the state components the OS saves), 0 where the OS has not enabled XSAVE. */
uint64_t kvserve_xcr0(void) {
#if KV_X86
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return 0; /* OSXSAVE */
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
#else
    return 0;
#endif
}

/* Asks Linux for permission to use the AMX tile data state: 1 when granted. */
int kvserve_request_amx_permission(void) {
#if KV_X86 && defined(__linux__) && defined(SYS_arch_prctl)
    unsigned long granted = 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &granted) != 0) return 0;
    return (granted >> XFEATURE_XTILEDATA) & 1;
#else
    return 0;
#endif
}

/* The decision: of the CPUID features, those the OS state in `xcr0` (and the AMX
 * permission) lets this process use. Pure, so that a test can feed it a masked XCR0. */
uint64_t kvserve_os_enabled_features(uint64_t cpuid_features, uint64_t xcr0, int amx_permitted) {
    uint64_t usable = cpuid_features;
    int avx_state = (xcr0 & AVX_STATE) == AVX_STATE;
    if (!avx_state) usable &= ~(uint64_t)AVX_FAMILY;
    if (!avx_state || (xcr0 & AVX512_STATE) != AVX512_STATE) usable &= ~(uint64_t)AVX512_FAMILY;
    if ((xcr0 & AMX_STATE) != AMX_STATE || !amx_permitted) usable &= ~(uint64_t)AMX_FAMILY;
    if (!(xcr0 & KV_XCR0_APX)) usable &= ~(uint64_t)KV_FEATURE_APX;
    return usable;
}

static uint64_t probe(void) {
    uint64_t cpuid = kvserve_cpuid_features(), xcr0 = kvserve_xcr0();
    int amx = (cpuid & AMX_FAMILY) && (xcr0 & AMX_STATE) == AMX_STATE && kvserve_request_amx_permission();
    return kvserve_os_enabled_features(cpuid, xcr0, amx);
}

/* What this process may use (probed once; the probe is idempotent, so a race only
 * repeats it). Bit 63 marks the cached value as set. */
uint64_t kvserve_usable_features(void) {
    static uint64_t cached;
    uint64_t value = __atomic_load_n(&cached, __ATOMIC_ACQUIRE);
    if (!(value >> 63)) {
        value = probe() | (1ull << 63);
        __atomic_store_n(&cached, value, __ATOMIC_RELEASE);
    }
    return value & ~(1ull << 63);
}

/* The features a kernel's path needs, and whether this build compiled it. */
static const uint64_t NEEDS[KV_KERNEL_COUNT][ISA_COUNT] = {
    [KV_KERNEL_ATTENTION] = {0, KV_FEATURE_AVX2 | KV_FEATURE_FMA | KV_FEATURE_F16C, KV_FEATURE_AVX512F},
    [KV_KERNEL_QUANT] = {0, KV_FEATURE_AVX2 | KV_FEATURE_FMA,
                         KV_FEATURE_AVX512F | KV_FEATURE_AVX512BW | KV_FEATURE_AVX512VL | KV_FEATURE_AVX512VNNI},
    [KV_KERNEL_QUANT_GEMM] = {0, KV_FEATURE_AVX2 | KV_FEATURE_FMA,
                              KV_FEATURE_AVX512F | KV_FEATURE_AVX512BW | KV_FEATURE_AVX512BF16},
    [KV_KERNEL_BF16] = {0, KV_FEATURE_AVX2 | KV_FEATURE_FMA,
                        KV_FEATURE_AVX512F | KV_FEATURE_AVX512BW | KV_FEATURE_AVX512BF16},
    [KV_KERNEL_F32_GEMM] = {0, KV_FEATURE_AVX2 | KV_FEATURE_FMA, KV_FEATURE_AVX512F},
    [KV_KERNEL_MASK] = {0, KV_FEATURE_AVX2, KV_FEATURE_AVX512F},
    [KV_KERNEL_MAMBA2] = {0, KV_FEATURE_AVX2 | KV_FEATURE_FMA, KV_FEATURE_AVX512F},
    [KV_KERNEL_GATED_DELTA] = {0, KV_FEATURE_AVX2 | KV_FEATURE_FMA, KV_FEATURE_AVX512F},
};
static const int BUILT[KV_KERNEL_COUNT][ISA_COUNT] = {
    [KV_KERNEL_ATTENTION] = {1, KV_HAVE_AVX2_FMA_F16C, KV_HAVE_AVX512F},
    [KV_KERNEL_QUANT] = {1, KV_HAVE_AVX2_FMA, KV_HAVE_AVX512_VNNI},
    [KV_KERNEL_QUANT_GEMM] = {1, KV_HAVE_AVX2_FMA, KV_HAVE_AVX512_BF16},
    [KV_KERNEL_BF16] = {1, KV_HAVE_AVX2_FMA, KV_HAVE_AVX512_BF16},
    [KV_KERNEL_F32_GEMM] = {1, KV_HAVE_AVX2_FMA, KV_HAVE_AVX512F},
    [KV_KERNEL_MASK] = {1, KV_HAVE_AVX2, KV_HAVE_AVX512F},
    [KV_KERNEL_MAMBA2] = {1, KV_HAVE_AVX2_FMA, KV_HAVE_AVX512F},
    [KV_KERNEL_GATED_DELTA] = {1, KV_HAVE_AVX2_FMA, KV_HAVE_AVX512F},
};

/* The features path `isa` of `kernel` needs, or -1 where this build has no such path. */
int64_t kvserve_isa_requirement(int kernel, int isa) {
    if (kernel < 0 || kernel >= KV_KERNEL_COUNT || isa < 0 || isa >= ISA_COUNT || !BUILT[kernel][isa]) return -1;
    return (int64_t)NEEDS[kernel][isa];
}

/* Whether path `isa` of `kernel` runs here: built, and every feature it needs usable. */
int kvserve_isa_available(int kernel, int isa) {
    int64_t needs = kvserve_isa_requirement(kernel, isa);
    return needs >= 0 && ((uint64_t)needs & kvserve_usable_features()) == (uint64_t)needs;
}
