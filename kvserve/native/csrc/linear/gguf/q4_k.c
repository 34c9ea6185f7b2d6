/* Q4_K (ggml type 12): super-blocks of 256 columns, 144 bytes: f16 d, f16 dmin, 12
 * bytes of 6-bit sub-block scales and minimums (gguf_k_scales), then 128 bytes of
 * nibbles: per 64 columns 32 bytes, the low nibbles columns 0-31 and the high nibbles
 * columns 32-63. Sub-block j (32 columns): w = (d sc_j) q - (dmin m_j). */
#include "gguf_type.h"
#include "kvserve.h"

#define COLS 256
#define BYTES 144

GGUF_EXACT static void dequantize_q4_k(const uint8_t *blocks, int64_t n, float *out) {
    for (int64_t b = 0; b < n; b++) {
        const uint8_t *blk = blocks + b * BYTES;
        const float d = gguf_f16(blk), dmin = gguf_f16(blk + 2);
        uint8_t sc[8], mn[8];
        gguf_k_scales(blk + 4, sc, mn);
        for (int j = 0; j < 8; j++) {
            const float scale = d * (float)sc[j], low = dmin * (float)mn[j];
            const uint8_t *q = blk + 16 + (j / 2) * 32;
            const int shift = (j & 1) * 4;
            float *o = out + b * COLS + j * 32;
            for (int i = 0; i < 32; i++) o[i] = scale * (float)((q[i] >> shift) & 15) - low;
        }
    }
}

/* d sum_j dx_j (sc_j isum_j) - dmin sum_j m_j sx_j: integer sums per sub-block times
 * their 6-bit scale stay exact (at most 63 * 15 * 127 * 32 < 2^22). */
GGUF_PORTABLE static float dot_q4_k(const uint8_t *blk, const int8_t *qx, const float *dx, const float *sx) {
    uint8_t sc[8], mn[8];
    gguf_k_scales(blk + 4, sc, mn);
    float scaled = 0.0f, mins = 0.0f;
    for (int j = 0; j < 8; j++) {
        const uint8_t *q = blk + 16 + (j / 2) * 32;
        const int shift = (j & 1) * 4;
        int sum = 0;
        for (int i = 0; i < 32; i++) sum += ((q[i] >> shift) & 15) * qx[j * 32 + i];
        scaled += dx[j] * (float)(sc[j] * sum);
        mins += sx[j] * (float)mn[j];
    }
    return gguf_f16(blk) * scaled - gguf_f16(blk + 2) * mins;
}

const GgufType gguf_q4_k = {12, COLS, BYTES, dequantize_q4_k, dot_q4_k, {NULL, NULL, NULL}};
