/* Q8_0 (ggml type 8): blocks of 32 columns, 34 bytes: f16 d, then 32 int8 quants;
 * w = d * q. */
#include "gguf_type.h"
#include "kvserve.h"

#define COLS 32
#define BYTES 34

GGUF_EXACT static void dequantize_q8_0(const uint8_t *blocks, int64_t n, float *out) {
    for (int64_t b = 0; b < n; b++) {
        const uint8_t *blk = blocks + b * BYTES;
        const float d = gguf_f16(blk);
        for (int i = 0; i < COLS; i++) out[b * COLS + i] = (float)(int8_t)blk[2 + i] * d;
    }
}

GGUF_PORTABLE static float dot_q8_0(const uint8_t *blk, const int8_t *qx, const float *dx, const float *sx) {
    (void)sx;
    int sum = 0;
    for (int i = 0; i < COLS; i++) sum += (int8_t)blk[2 + i] * qx[i];
    return gguf_f16(blk) * dx[0] * (float)sum;
}

const GgufType gguf_q8_0 = {8, COLS, BYTES, dequantize_q8_0, dot_q8_0, {NULL, NULL, NULL}};
