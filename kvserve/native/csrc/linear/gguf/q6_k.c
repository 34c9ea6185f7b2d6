/* Q6_K (ggml type 14): super-blocks of 256 columns, 210 bytes: 128 bytes of low nibbles
 * (ql), 64 bytes of high bit pairs (qh), 16 int8 scales (one per 16 columns), f16 d.
 * Column c = 128 h + p (h the half, p < 128): low nibble of ql[64 h + p % 64] (p < 64)
 * or its high nibble, high pair bits 2 (p / 32) of qh[32 h + p % 32];
 * w = (d sc_{c / 16}) (q - 32), q the 6-bit value. */
#include "gguf_type.h"
#include "kvserve.h"

#define COLS 256
#define BYTES 210

GGUF_INLINE int q6_value(const uint8_t *blk, int c) {
    const int h = c / 128, p = c % 128;
    const uint8_t low = blk[64 * h + p % 64], high = blk[128 + 32 * h + p % 32];
    return ((p < 64 ? low & 15 : low >> 4) | (((high >> (2 * (p / 32))) & 3) << 4)) - 32;
}

GGUF_EXACT static void dequantize_q6_k(const uint8_t *blocks, int64_t n, float *out) {
    for (int64_t b = 0; b < n; b++) {
        const uint8_t *blk = blocks + b * BYTES;
        const float d = gguf_f16(blk + 208);
        for (int k = 0; k < 16; k++) {
            const float scale = d * (float)(int8_t)blk[192 + k];
            for (int i = 0; i < 16; i++) out[b * COLS + k * 16 + i] = scale * (float)q6_value(blk, k * 16 + i);
        }
    }
}

/* d sum_j dx_j (sc_2j isum_2j + sc_2j+1 isum_2j+1) over the eight 32-column blocks: the
 * integer part is at most 32 * 128 * 32 * 127 < 2^24, exact in float. */
GGUF_PORTABLE static float dot_q6_k(const uint8_t *blk, const int8_t *qx, const float *dx, const float *sx) {
    (void)sx;
    float acc = 0.0f;
    for (int j = 0; j < 8; j++) {
        int sum = 0;
        for (int half = 0; half < 2; half++) {
            const int k = 2 * j + half;
            int part = 0;
            for (int i = 0; i < 16; i++) part += q6_value(blk, k * 16 + i) * qx[k * 16 + i];
            sum += (int8_t)blk[192 + k] * part;
        }
        acc += dx[j] * (float)sum;
    }
    return gguf_f16(blk + 208) * acc;
}

const GgufType gguf_q6_k = {14, COLS, BYTES, dequantize_q6_k, dot_q6_k, {NULL, NULL, NULL}};
