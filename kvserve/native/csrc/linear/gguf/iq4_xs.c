/* GGUF IQ4_XS (ggml type 23): super-blocks of 256 columns in 136 bytes: f16 d; the eight
 * groups' 6-bit scales (stored +32) as their top 2 bits in a little-endian uint16 (bits 2g,
 * 2g+1) and their low 4 bits in 4 bytes (group g: byte g / 2, low nibble for even g); then
 * 16 bytes of 4-bit indices per group (nibble_table.h). w_i = d (s_g - 32) t[k_i]. */
#define BLOCK_COLS 256
#define BLOCK_BYTES 136
#define QUANTS_SIGNED 1
#define SCALES_PER_16 0
#define MINS MINS_NONE
#include "group_kernels.h"
#include "iq4_values.h"
#include "nibble_table.h"

static void block_head(const uint8_t *block, BlockHead *h) {
    const float d = gguf_f16(block);
    const unsigned high = (unsigned)(block[2] | block[3] << 8);
    for (int g = 0; g < GROUPS; g++) {
        int s = ((block[4 + g / 2] >> (4 * (g % 2))) & 15) | ((high >> (2 * g)) & 3) << 4;
        h->scale[g] = d * (float)(s - 32);
    }
}

static void group_quants(const uint8_t *block, int g, int8_t q[GROUP]) {
    table_quants(block + 8 + 16 * g, IQ4_VALUES, q);
}

#if KV_HAVE_AVX2_FMA
static __m256i group_quants256(const uint8_t *block, int g) {
    return table_quants256(block + 8 + 16 * g, IQ4_VALUES);
}
#endif

GGUF_BLOCK_TYPE(gguf_iq4_xs, 23)
