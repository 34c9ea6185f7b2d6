/* The sixteen values IQ4_NL and IQ4_XS indices stand for (ggml's non-linear 4-bit grid). */
#ifndef KVSERVE_GGUF_IQ4_VALUES_H
#define KVSERVE_GGUF_IQ4_VALUES_H
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
#endif
