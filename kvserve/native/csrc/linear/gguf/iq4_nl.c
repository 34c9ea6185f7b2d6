/* GGUF IQ4_NL (ggml type 20): blocks of 32 columns in 18 bytes: an f16 scale d and 16 bytes of
 * 4-bit indices (nibble_table.h) into a fixed non-linear table of int8 values. w_i = d t[k_i]. */
#define BLOCK_COLS 32
#define BLOCK_BYTES 18
#define QUANTS_SIGNED 1
#define SCALES_PER_16 0
#define MINS MINS_NONE
#include "group_kernels.h"
#include "iq4_values.h"
#include "nibble_table.h"

static void block_head(const uint8_t *block, BlockHead *h) {
    h->scale[0] = gguf_f16(block);
}

static void group_quants(const uint8_t *block, int g, int8_t q[GROUP]) {
    (void)g;
    table_quants(block + 2, IQ4_VALUES, q);
}

#if KV_HAVE_AVX2_FMA
static __m256i group_quants256(const uint8_t *block, int g) {
    (void)g;
    return table_quants256(block + 2, IQ4_VALUES);
}
#endif

GGUF_BLOCK_TYPE(gguf_iq4_nl, 20)
