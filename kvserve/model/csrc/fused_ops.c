/* Fused element-wise CPU ops of the decoder: residual add + RMSNorm, SiLU-gated
 * product, rotary embedding. Each replaces several torch ops (each a pass over
 * memory plus a dispatch) with one pass. Rounding follows the torch path step
 * by step (values are rounded to the storage type where torch would store an
 * intermediate tensor), so bfloat16 results match it bit for bit up to the
 * order of the float32 sum in the norm. Built with paged_attention.c by
 * kvserve/model/cpu_kernels.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { F32 = 0, BF16 = 1 };

static inline float bf16_value(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t bf16_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

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

/* Small inputs run on one thread: waking the pool costs more than the work. */
#define PARALLEL_MIN_ELEMENTS 65536

/* out = norm(h) * w (Llama: w * round(normed); Gemma, adds_one: round(normed * (1 + w))),
 * h = x, or h = round(x + residual) stored back into residual when residual is given.
 * Rows are `row_stride` elements apart in x, residual and out; weight is float32. */
void kvserve_rms_norm(const void *x, void *residual, const float *weight, void *out, int64_t rows, int64_t dim,
                      int64_t row_stride, float eps, int adds_one, int dtype, int num_threads) {
    int threads = rows * dim >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * row_stride;
        float h[8192];
        float sum = 0.f;
        for (int64_t i = 0; i < dim; i++) {
            float v = get(x, base + i, dtype);
            if (residual) {
                v = rounded(v + get(residual, base + i, dtype), dtype);
                put(residual, base + i, dtype, v);
            }
            h[i] = v;
            sum += v * v;
        }
        const float inv = 1.f / sqrtf(sum / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) {
            float normed = h[i] * inv;
            float v = adds_one ? normed * (1.f + weight[i]) : weight[i] * rounded(normed, dtype);
            put(out, base + i, dtype, v);
        }
    }
}

/* out[r] = round(silu(gate)) * up, where row r of gate_up is [gate (width), up (width)]. */
void kvserve_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int dtype, int num_threads) {
    int threads = rows * width >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t in_base = r * 2 * width, out_base = r * width;
        for (int64_t i = 0; i < width; i++) {
            float g = get(gate_up, in_base + i, dtype);
            float act = rounded(g / (1.f + expf(-g)), dtype);
            put(out, out_base + i, dtype, act * get(gate_up, in_base + width + i, dtype));
        }
    }
}

/* Rotates the two halves of each head of x [tokens, heads, dim] in place (HF layout):
 * x1' = round(x1*cos) - round(x2*sin), x2' = round(x2*cos) + round(x1*sin), each
 * rounded as stored. cos/sin: [tokens, dim] in the same dtype (halves equal). */
void kvserve_rotary(void *x, int64_t token_stride, int64_t head_stride, const void *cos, const void *sin,
                    int64_t tokens, int64_t heads, int64_t dim, int dtype, int num_threads) {
    const int64_t half = dim / 2;
    int threads = tokens * heads * dim >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t h = 0; h < heads; h++) {
            const int64_t base = t * token_stride + h * head_stride;
            for (int64_t i = 0; i < half; i++) {
                float x1 = get(x, base + i, dtype), x2 = get(x, base + half + i, dtype);
                float c1 = get(cos, t * dim + i, dtype), s1 = get(sin, t * dim + i, dtype);
                float c2 = get(cos, t * dim + half + i, dtype), s2 = get(sin, t * dim + half + i, dtype);
                put(x, base + i, dtype, rounded(x1 * c1, dtype) + rounded(-x2 * s1, dtype));
                put(x, base + half + i, dtype, rounded(x2 * c2, dtype) + rounded(x1 * s2, dtype));
            }
        }
    }
}
