/* The Mamba-2 decode step: one token for each of B requests, from and to state slots.
 *
 * Per request (kvserve/model/linear_attention/mamba2.py has the same math in torch):
 *   conv: window = [conv state (K-1 rows) ; xbc], out = silu(sum_k window[k] * w[:, k] + b),
 *         the new conv state the window's last K-1 rows;
 *   SSM:  x, B, C split from out (heads h read group h / (H / G));
 *         dt = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max), decay = exp(dt * A);
 *         s[h, p, n] = s[h, p, n] * decay + dt * x[h, p] * B[n];  y[h, p] = sum_n s * C[n] + D[h] x[h, p].
 * A request reads slot read_slot[r] (-1: zero states) and writes slot write_slot[r]; the two
 * may be the same slot (updated in place), and no other request of the call touches either.
 *
 * Paths: portable C, AVX2+FMA and AVX-512F, over the state dimension N (the SSM) and the
 * conv channels; chosen by the caller (`isa`) among those kvserve_isa_available grants.
 * Each path adds the N products of y in its own order (lanes, then the lanes' sum).
 *
 * Threads: the convs run first, one request after another (K-1 + 1 rows of conv_dim each);
 * then the (request, head) pairs split over `num_threads` OpenMP threads where the states
 * they update are large enough to pay for it. Each pair is one thread's whole, so the
 * results do not depend on the thread count.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvserve.h"

static float silu(float v) { return v / (1.0f + expf(-v)); }

/* torch's softplus (threshold 20: above it, the input itself). */
static float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

/* One head's state rows: s[p, :] = s[p, :] * decay + (dt x[p]) B, y[p] = s[p, :] . C. */
static void ssm_head_portable(float *s, const float *x, const float *b, const float *c, float decay, float dt,
                              int64_t head_dim, int64_t n_state, float *y) {
    for (int64_t p = 0; p < head_dim; p++) {
        float *row = s + p * n_state;
        const float dtx = dt * x[p];
        float acc = 0.0f;
        for (int64_t n = 0; n < n_state; n++) {
            row[n] = row[n] * decay + dtx * b[n];
            acc += row[n] * c[n];
        }
        y[p] = acc;
    }
}

#if KV_HAVE_AVX2_FMA
__attribute__((target("avx2,fma"))) static float hsum256(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

__attribute__((target("avx2,fma"))) static void ssm_head_avx2(float *s, const float *x, const float *b,
                                                              const float *c, float decay, float dt,
                                                              int64_t head_dim, int64_t n_state, float *y) {
    const __m256 vdecay = _mm256_set1_ps(decay);
    const int64_t body = n_state / 8 * 8;
    for (int64_t p = 0; p < head_dim; p++) {
        float *row = s + p * n_state;
        const float dtx = dt * x[p];
        const __m256 vdtx = _mm256_set1_ps(dtx);
        __m256 acc = _mm256_setzero_ps();
        for (int64_t n = 0; n < body; n += 8) {
            __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(row + n), vdecay, _mm256_mul_ps(vdtx, _mm256_loadu_ps(b + n)));
            _mm256_storeu_ps(row + n, v);
            acc = _mm256_fmadd_ps(v, _mm256_loadu_ps(c + n), acc);
        }
        float tail = 0.0f;
        for (int64_t n = body; n < n_state; n++) {
            row[n] = row[n] * decay + dtx * b[n];
            tail += row[n] * c[n];
        }
        y[p] = hsum256(acc) + tail;
    }
}
#endif

#if KV_HAVE_AVX512F
__attribute__((target("avx512f"))) static void ssm_head_avx512(float *s, const float *x, const float *b,
                                                               const float *c, float decay, float dt,
                                                               int64_t head_dim, int64_t n_state, float *y) {
    const __m512 vdecay = _mm512_set1_ps(decay);
    const int64_t body = n_state / 16 * 16;
    const __mmask16 tail_mask = (__mmask16)((1u << (n_state - body)) - 1u);
    for (int64_t p = 0; p < head_dim; p++) {
        float *row = s + p * n_state;
        const __m512 vdtx = _mm512_set1_ps(dt * x[p]);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t n = 0; n < body; n += 16) {
            __m512 v = _mm512_fmadd_ps(_mm512_loadu_ps(row + n), vdecay, _mm512_mul_ps(vdtx, _mm512_loadu_ps(b + n)));
            _mm512_storeu_ps(row + n, v);
            acc = _mm512_fmadd_ps(v, _mm512_loadu_ps(c + n), acc);
        }
        if (tail_mask) {
            __m512 v = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail_mask, row + body), vdecay,
                                       _mm512_mul_ps(vdtx, _mm512_maskz_loadu_ps(tail_mask, b + body)));
            _mm512_mask_storeu_ps(row + body, tail_mask, v);
            acc = _mm512_fmadd_ps(v, _mm512_maskz_loadu_ps(tail_mask, c + body), acc);
        }
        y[p] = _mm512_reduce_add_ps(acc);
    }
}
#endif

static void ssm_head(float *s, const float *x, const float *b, const float *c, float decay, float dt,
                     int64_t head_dim, int64_t n_state, float *y, int isa) {
#if KV_HAVE_AVX512F
    if (isa == ISA_AVX512) { ssm_head_avx512(s, x, b, c, decay, dt, head_dim, n_state, y); return; }
#endif
#if KV_HAVE_AVX2_FMA
    if (isa == ISA_AVX2) { ssm_head_avx2(s, x, b, c, decay, dt, head_dim, n_state, y); return; }
#endif
    (void)isa;
    ssm_head_portable(s, x, b, c, decay, dt, head_dim, n_state, y);
}

/* conv_out[c] = silu(sum_k window_k[c] w[c, k] + bias[c]) with window rows state[0..K-2], xbc;
 * then the state shifts by one row, xbc entering last. Channel by channel: the taps of a
 * channel are one weight row, and the compiler vectorizes the channel loop of each path. */
static void conv_step(float *state, const float *xbc, const float *weight, const float *bias, int64_t channels,
                      int64_t kernel, float *conv_out) {
    for (int64_t ch = 0; ch < channels; ch++) {
        const float *w = weight + ch * kernel;
        float acc = bias ? bias[ch] : 0.0f;
        for (int64_t k = 0; k < kernel - 1; k++) acc += state[k * channels + ch] * w[k];
        acc += xbc[ch] * w[kernel - 1];
        conv_out[ch] = silu(acc);
    }
    if (kernel > 2) memmove(state, state + channels, (size_t)((kernel - 2) * channels) * sizeof(float));
    memcpy(state + (kernel - 2) * channels, xbc, (size_t)channels * sizeof(float));
}

/* State elements (over all pairs) below which the step stays on one thread. */
#define PARALLEL_MIN_STATE (1 << 16)

/* Returns 0, 1 for bad sizes, 2 for a missing scratch buffer ([batch, conv_dim] floats: the
 * conv outputs), 3 where path `isa` does not run here. */
int kvserve_mamba2_decode_step(const float *xbc, int64_t xbc_stride, const float *dt_raw, int64_t dt_stride,
                               float *conv_states, float *ssm_states, const int64_t *read_slot,
                               const int64_t *write_slot, const float *conv_weight, const float *conv_bias,
                               const float *dt_bias, const float *a, const float *d, float dt_min, float dt_max,
                               int64_t batch, int64_t num_heads, int64_t head_dim, int64_t n_state,
                               int64_t n_groups, int64_t kernel, float *scratch, float *y, int64_t y_stride,
                               int isa, int num_threads) {
    if (batch < 0 || num_heads <= 0 || head_dim <= 0 || n_state <= 0 || n_groups <= 0 || kernel < 2 ||
        num_heads % n_groups)
        return 1;
    if (!scratch) return 2;
    if (!kvserve_isa_available(KV_KERNEL_MAMBA2, isa)) return 3;
    const int64_t inner = num_heads * head_dim, channels = inner + 2 * n_groups * n_state;
    const int64_t conv_slot = (kernel - 1) * channels, ssm_slot = num_heads * head_dim * n_state;
    const int64_t heads_per_group = num_heads / n_groups;
    for (int64_t r = 0; r < batch; r++) {
        float *conv = conv_states + write_slot[r] * conv_slot;
        float *ssm = ssm_states + write_slot[r] * ssm_slot;
        if (read_slot[r] < 0) {
            memset(conv, 0, (size_t)conv_slot * sizeof(float));
            memset(ssm, 0, (size_t)ssm_slot * sizeof(float));
        } else if (read_slot[r] != write_slot[r]) {
            memcpy(conv, conv_states + read_slot[r] * conv_slot, (size_t)conv_slot * sizeof(float));
            memcpy(ssm, ssm_states + read_slot[r] * ssm_slot, (size_t)ssm_slot * sizeof(float));
        }
        conv_step(conv, xbc + r * xbc_stride, conv_weight, conv_bias, channels, kernel, scratch + r * channels);
    }
    const int64_t pairs = batch * num_heads;
    const int threads = pairs * head_dim * n_state >= PARALLEL_MIN_STATE ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t pair = 0; pair < pairs; pair++) {
        const int64_t r = pair / num_heads, h = pair % num_heads, g = h / heads_per_group;
        const float *x = scratch + r * channels + h * head_dim;
        const float *b = scratch + r * channels + inner + g * n_state;
        const float *c = scratch + r * channels + inner + (n_groups + g) * n_state;
        float *out = y + r * y_stride + h * head_dim;
        float dt = softplus(dt_raw[r * dt_stride + h] + dt_bias[h]);
        dt = dt < dt_min ? dt_min : (dt > dt_max ? dt_max : dt);
        ssm_head(ssm_states + write_slot[r] * ssm_slot + h * head_dim * n_state, x, b, c, expf(dt * a[h]), dt,
                 head_dim, n_state, out, isa);
        for (int64_t p = 0; p < head_dim; p++) out[p] += d[h] * x[p];
    }
    return 0;
}
