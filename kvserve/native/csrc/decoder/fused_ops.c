/* Fused element-wise CPU ops of the decoder: residual add + RMSNorm, SiLU-gated
 * product, rotary embedding. Each replaces several torch ops (each a pass over
 * memory plus a dispatch) with one pass. Rounding follows the torch path step
 * by step (values are rounded to the storage type where torch would store an
 * intermediate tensor), so bfloat16 results match it bit for bit up to the
 * order of the float32 sum in the norm. Built with paged_attention.c by
 * kvserve/native/cpu_kernels.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kvserve.h"

static inline float get(const void *base, int64_t i, int dtype) {
    return dtype == F32 ? ((const float *)base)[i] : bf16_value(((const uint16_t *)base)[i]);
}

static inline void put(void *base, int64_t i, int dtype, float v) {
    if (dtype == F32)
        ((float *)base)[i] = v;
    else
        ((uint16_t *)base)[i] = bf16_bits(v);
}

/* The value as the storage type holds it (torch rounds each stored intermediate). */
static inline float rounded(float v, int dtype) { return dtype == F32 ? v : bf16_value(bf16_bits(v)); }

#define MAX_ROTARY_DIM 512
#define CHUNK 1024
#define MAX_NORM_DIM 8192

/* Small inputs run on one thread: waking the pool costs more than the work. */
#define PARALLEL_MIN_ELEMENTS 65536

/* out = norm(h) * w (Llama: w * round(normed); Gemma, adds_one: round(normed * (1 + w))),
 * h = x, or h = round(x + residual) stored back into residual when residual is given.
 * Rows are `row_stride` elements apart in x, residual and out; weight is float32. */
#define INLINE static inline __attribute__((always_inline))
/* Each op is written once with `dtype` a parameter and instantiated per storage type
 * (the dispatchers pass a constant), so the per-element type tests fold away. */
#define DISPATCH(dtype, call)     \
    do {                          \
        if ((dtype) == F32) {     \
            const int dtype_ = F32; \
            call;                 \
        } else {                  \
            const int dtype_ = BF16; \
            call;                 \
        }                         \
    } while (0)

INLINE void rms_norm(const void *x, void *residual, const float *weight, void *out, int64_t rows, int64_t dim,
                     int64_t row_stride, float eps, int adds_one, const int dtype, int num_threads) {
    int threads = rows * dim >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * row_stride;
        float h[MAX_NORM_DIM], o[MAX_NORM_DIM];
        for (int64_t i = 0; i < dim; i++) h[i] = get(x, base + i, dtype);
        if (residual) {
            for (int64_t i = 0; i < dim; i++) h[i] = rounded(h[i] + get(residual, base + i, dtype), dtype);
            for (int64_t i = 0; i < dim; i++) put(residual, base + i, dtype, h[i]);
        }
        float sum = 0.f;
        for (int64_t i = 0; i < dim; i++) sum += h[i] * h[i];
        const float inv = 1.f / sqrtf(sum / (float)dim + eps);
        if (adds_one)
            for (int64_t i = 0; i < dim; i++) o[i] = h[i] * inv * (1.f + weight[i]);
        else
            for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * rounded(h[i] * inv, dtype);
        for (int64_t i = 0; i < dim; i++) put(out, base + i, dtype, o[i]);
    }
}

void kvserve_rms_norm(const void *x, void *residual, const float *weight, void *out, int64_t rows, int64_t dim,
                      int64_t row_stride, float eps, int adds_one, int dtype, int num_threads) {
    DISPATCH(dtype, rms_norm(x, residual, weight, out, rows, dim, row_stride, eps, adds_one, dtype_, num_threads));
}

/* out[r] = round(silu(gate[r])) * up[r]: rows of `width` elements, `in_stride` apart in gate and up. */
INLINE void silu_mul(const void *gate, const void *up, int64_t in_stride, void *out, int64_t rows, int64_t width,
                     const int dtype, int num_threads) {
    int threads = rows * width >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t in_base = r * in_stride, out_base = r * width;
        float act[CHUNK];
        for (int64_t start = 0; start < width; start += CHUNK) {
            const int64_t n = width - start < CHUNK ? width - start : CHUNK;
            for (int64_t i = 0; i < n; i++) {
                float g = get(gate, in_base + start + i, dtype);
                act[i] = rounded(g / (1.f + expf(-g)), dtype);
            }
            for (int64_t i = 0; i < n; i++) act[i] *= get(up, in_base + start + i, dtype);
            for (int64_t i = 0; i < n; i++) put(out, out_base + start + i, dtype, act[i]);
        }
    }
}

/* Row r of gate_up is [gate (width), up (width)]. */
void kvserve_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int dtype, int num_threads) {
    const void *up = (const char *)gate_up + width * (dtype == F32 ? 4 : 2);
    DISPATCH(dtype, silu_mul(gate_up, up, 2 * width, out, rows, width, dtype_, num_threads));
}

/* gate and up apart, each [rows, width] contiguous (a fused projection's parts held as stored). */
void kvserve_silu_mul_parts(const void *gate, const void *up, void *out, int64_t rows, int64_t width, int dtype,
                            int num_threads) {
    DISPATCH(dtype, silu_mul(gate, up, width, out, rows, width, dtype_, num_threads));
}

/* gpt-oss's clamped SwiGLU: out[r] = (u + 1) * (g * sigmoid(alpha g)) with g = min(gate, limit)
 * and u = clamp(up, -limit, limit), row r of gate_up being [gate (width), up (width)]; each
 * step rounded to the storage type as torch's ops round theirs. */
INLINE void swiglu_clamped(const void *gate_up, void *out, int64_t rows, int64_t width, float limit, float alpha,
                           const int dtype, int num_threads) {
    int threads = rows * width >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t in_base = r * 2 * width, out_base = r * width;
        for (int64_t i = 0; i < width; i++) {
            float g = get(gate_up, in_base + i, dtype), u = get(gate_up, in_base + width + i, dtype);
            g = g < limit ? g : limit;
            u = u < -limit ? -limit : (u > limit ? limit : u);
            const float scaled = rounded(g * alpha, dtype);
            const float gated = rounded(g * rounded(1.f / (1.f + expf(-scaled)), dtype), dtype);
            put(out, out_base + i, dtype, rounded(u + 1.f, dtype) * gated);
        }
    }
}

void kvserve_swiglu_clamped(const void *gate_up, void *out, int64_t rows, int64_t width, float limit, float alpha,
                            int dtype, int num_threads) {
    DISPATCH(dtype, swiglu_clamped(gate_up, out, rows, width, limit, alpha, dtype_, num_threads));
}

/* Rotates the two halves of each head of x [tokens, heads, dim] in place (HF layout):
 * x1' = round(x1*cos) - round(x2*sin), x2' = round(x2*cos) + round(x1*sin), each
 * rounded as stored. cos/sin: [tokens, dim] in the same dtype (halves equal). */
INLINE void rotary(void *x, int64_t token_stride, int64_t head_stride, const void *cos, const void *sin,
                   int64_t tokens, int64_t heads, int64_t dim, const int dtype, int num_threads) {
    const int64_t half = dim / 2;
    int threads = tokens * heads * dim >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tokens; t++) {
        /* Local float copies: the compiler cannot prove x, cos and sin apart, and would not vectorize. */
        float c[MAX_ROTARY_DIM], s[MAX_ROTARY_DIM], v[MAX_ROTARY_DIM], r[MAX_ROTARY_DIM];
        for (int64_t i = 0; i < dim; i++) {
            c[i] = get(cos, t * dim + i, dtype);
            s[i] = get(sin, t * dim + i, dtype);
        }
        for (int64_t h = 0; h < heads; h++) {
            const int64_t base = t * token_stride + h * head_stride;
            for (int64_t i = 0; i < dim; i++) v[i] = get(x, base + i, dtype);
            for (int64_t i = 0; i < half; i++) {
                r[i] = rounded(v[i] * c[i], dtype) + rounded(-v[half + i] * s[i], dtype);
                r[half + i] = rounded(v[half + i] * c[half + i], dtype) + rounded(v[i] * s[half + i], dtype);
            }
            for (int64_t i = 0; i < dim; i++) put(x, base + i, dtype, r[i]);
        }
    }
}

void kvserve_rotary(void *x, int64_t token_stride, int64_t head_stride, const void *cos, const void *sin,
                    int64_t tokens, int64_t heads, int64_t dim, int dtype, int num_threads) {
    DISPATCH(dtype, rotary(x, token_stride, head_stride, cos, sin, tokens, heads, dim, dtype_, num_threads));
}
