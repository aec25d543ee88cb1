/* Float32-accurate INT8 GEMM with AVX-512 VNNI integer dot products (in progress). */
#include <stdint.h>

int pagoda_int8_vnni_gemm_f32(const float *x, int64_t m, int64_t k, const uint8_t *q16, const uint16_t *scales,
                              int64_t n, int64_t group, float *y, int threads) {
    (void)x, (void)m, (void)k, (void)q16, (void)scales, (void)n, (void)group, (void)y, (void)threads;
    return 5; /* not built with VNNI */
}
