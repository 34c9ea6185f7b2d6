/* The gated delta rule's decode step (Gated DeltaNet: Qwen3-Next, Qwen3.5): one token for
 * each of B requests, reading and writing the delta-rule state in its cache slots.
 *
 * Per request and value head h (key head h / (Hv / Hk)), with the state S [Dk, Dv] of slot
 * read_slot[r] (-1: zeros), the L2-normalized key k, the scaled query q, the value v, the log
 * decay g and the write strength beta (kvserve/model/linear_attention/gated_delta.py has the
 * same math in torch, `gated_delta_step`):
 *   predicted = exp(g) S^T k,  delta = beta (v - predicted),
 *   S' = exp(g) S + k delta^T  (written to slot write_slot[r]),  out = S'^T q.
 * Two passes over S: the first forms `predicted` (S read), the second the new rows and the
 * output (S read, S' written). read_slot and write_slot may be the same slot (in place); no
 * other request of the call touches either.
 *
 * Paths: portable C, AVX2+FMA and AVX-512F, vectorized over Dv (a state row); chosen by the
 * caller (`isa`) among those kvserve_isa_available grants. Every path sums over Dk in the same
 * order (row by row); the lanes only split Dv, so the paths differ in rounding only where
 * they fuse a multiply and an add.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvserve.h"

/* One head: s [dk, dv] in place (already the request's state), k, q [dk], v [dv]; out [dv]. */
static void head_portable(float *s, const float *k, const float *q, const float *v, float decay, float beta,
                          int64_t dk, int64_t dv, float *delta, float *out) {
    for (int64_t j = 0; j < dv; j++) delta[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        const float *row = s + i * dv;
        for (int64_t j = 0; j < dv; j++) delta[j] += k[i] * row[j];
    }
    for (int64_t j = 0; j < dv; j++) {
        delta[j] = beta * (v[j] - decay * delta[j]);
        out[j] = 0.0f;
    }
    for (int64_t i = 0; i < dk; i++) {
        float *row = s + i * dv;
        for (int64_t j = 0; j < dv; j++) {
            row[j] = decay * row[j] + k[i] * delta[j];
            out[j] += q[i] * row[j];
        }
    }
}

#if KV_HAVE_AVX2_FMA
__attribute__((target("avx2,fma"))) static void head_avx2(float *s, const float *k, const float *q, const float *v,
                                                          float decay, float beta, int64_t dk, int64_t dv,
                                                          float *delta, float *out) {
    const int64_t body = dv / 8 * 8;
    if (body != dv) { head_portable(s, k, q, v, decay, beta, dk, dv, delta, out); return; }
    const __m256 vdecay = _mm256_set1_ps(decay), vbeta = _mm256_set1_ps(beta);
    for (int64_t j = 0; j < dv; j += 8) _mm256_storeu_ps(delta + j, _mm256_setzero_ps());
    for (int64_t i = 0; i < dk; i++) {
        const __m256 ki = _mm256_set1_ps(k[i]);
        const float *row = s + i * dv;
        for (int64_t j = 0; j < dv; j += 8)
            _mm256_storeu_ps(delta + j, _mm256_fmadd_ps(ki, _mm256_loadu_ps(row + j), _mm256_loadu_ps(delta + j)));
    }
    for (int64_t j = 0; j < dv; j += 8) {
        __m256 predicted = _mm256_mul_ps(vdecay, _mm256_loadu_ps(delta + j));
        _mm256_storeu_ps(delta + j, _mm256_mul_ps(vbeta, _mm256_sub_ps(_mm256_loadu_ps(v + j), predicted)));
        _mm256_storeu_ps(out + j, _mm256_setzero_ps());
    }
    for (int64_t i = 0; i < dk; i++) {
        const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
        float *row = s + i * dv;
        for (int64_t j = 0; j < dv; j += 8) {
            __m256 updated = _mm256_fmadd_ps(ki, _mm256_loadu_ps(delta + j),
                                             _mm256_mul_ps(vdecay, _mm256_loadu_ps(row + j)));
            _mm256_storeu_ps(row + j, updated);
            _mm256_storeu_ps(out + j, _mm256_fmadd_ps(qi, updated, _mm256_loadu_ps(out + j)));
        }
    }
}
#endif

#if KV_HAVE_AVX512F
__attribute__((target("avx512f"))) static void head_avx512(float *s, const float *k, const float *q, const float *v,
                                                           float decay, float beta, int64_t dk, int64_t dv,
                                                           float *delta, float *out) {
    const int64_t body = dv / 16 * 16;
    if (body != dv) { head_portable(s, k, q, v, decay, beta, dk, dv, delta, out); return; }
    const __m512 vdecay = _mm512_set1_ps(decay), vbeta = _mm512_set1_ps(beta);
    for (int64_t j = 0; j < dv; j += 16) _mm512_storeu_ps(delta + j, _mm512_setzero_ps());
    for (int64_t i = 0; i < dk; i++) {
        const __m512 ki = _mm512_set1_ps(k[i]);
        const float *row = s + i * dv;
        for (int64_t j = 0; j < dv; j += 16)
            _mm512_storeu_ps(delta + j, _mm512_fmadd_ps(ki, _mm512_loadu_ps(row + j), _mm512_loadu_ps(delta + j)));
    }
    for (int64_t j = 0; j < dv; j += 16) {
        __m512 predicted = _mm512_mul_ps(vdecay, _mm512_loadu_ps(delta + j));
        _mm512_storeu_ps(delta + j, _mm512_mul_ps(vbeta, _mm512_sub_ps(_mm512_loadu_ps(v + j), predicted)));
        _mm512_storeu_ps(out + j, _mm512_setzero_ps());
    }
    for (int64_t i = 0; i < dk; i++) {
        const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
        float *row = s + i * dv;
        for (int64_t j = 0; j < dv; j += 16) {
            __m512 updated = _mm512_fmadd_ps(ki, _mm512_loadu_ps(delta + j),
                                             _mm512_mul_ps(vdecay, _mm512_loadu_ps(row + j)));
            _mm512_storeu_ps(row + j, updated);
            _mm512_storeu_ps(out + j, _mm512_fmadd_ps(qi, updated, _mm512_loadu_ps(out + j)));
        }
    }
}
#endif

/* One head of one token: s [dk, dv] in place, k and q [dk] (q scaled), v [dv], decay exp(g);
 * scratch: dv floats; out [dv]. The caller checked `isa` (the fused decoder's Gated DeltaNet
 * layers call it per head, their threads splitting the heads). */
void kvserve_gated_delta_head(float *s, const float *k, const float *q, const float *v, float decay, float beta,
                              int64_t dk, int64_t dv, float *delta, float *out, int isa) {
#if KV_HAVE_AVX512F
    if (isa == ISA_AVX512) { head_avx512(s, k, q, v, decay, beta, dk, dv, delta, out); return; }
#endif
#if KV_HAVE_AVX2_FMA
    if (isa == ISA_AVX2) { head_avx2(s, k, q, v, decay, beta, dk, dv, delta, out); return; }
#endif
    (void)isa;
    head_portable(s, k, q, v, decay, beta, dk, dv, delta, out);
}

/* q, k rows [Hk * Dk] (q already scaled), v rows [Hv * Dv], g and beta rows [Hv]; states
 * [slots, Hv, Dk, Dv]; out rows [Hv * Dv]; scratch: Dv floats.
 * Returns 0, 1 for bad sizes, 2 for a missing scratch buffer, 3 where path `isa` does not run here. */
int kvserve_gated_delta_step(const float *q, const float *k, int64_t qk_stride, const float *v, int64_t v_stride,
                             const float *g, const float *beta, int64_t gate_stride, float *states,
                             const int64_t *read_slot, const int64_t *write_slot, int64_t batch,
                             int64_t num_k_heads, int64_t num_v_heads, int64_t dk, int64_t dv, float *scratch,
                             float *out, int64_t out_stride, int isa) {
    if (batch < 0 || num_k_heads <= 0 || num_v_heads <= 0 || dk <= 0 || dv <= 0 || num_v_heads % num_k_heads)
        return 1;
    if (!scratch) return 2;
    if (!kvserve_isa_available(KV_KERNEL_GATED_DELTA, isa)) return 3;
    const int64_t head_size = dk * dv, slot_size = num_v_heads * head_size, group = num_v_heads / num_k_heads;
    for (int64_t r = 0; r < batch; r++) {
        float *state = states + write_slot[r] * slot_size;
        if (read_slot[r] < 0) memset(state, 0, (size_t)slot_size * sizeof(float));
        else if (read_slot[r] != write_slot[r])
            memcpy(state, states + read_slot[r] * slot_size, (size_t)slot_size * sizeof(float));
        for (int64_t h = 0; h < num_v_heads; h++) {
            const int64_t kh = h / group;
            kvserve_gated_delta_head(state + h * head_size, k + r * qk_stride + kh * dk,
                                     q + r * qk_stride + kh * dk, v + r * v_stride + h * dv,
                                     expf(g[r * gate_stride + h]), beta[r * gate_stride + h], dk, dv, scratch,
                                     out + r * out_stride + h * dv, isa);
        }
    }
    return 0;
}
