/* FP8 e4m3 weight codes -> float32 for the CPU FP8 GEMM (kernels/fp8.py): one pass, no temporaries.
 *
 * Code s.eeee.mmm becomes the float32 with sign s, exponent field 0000eeee and mantissa mmm000...: it reads
 * value * 2**-120 exactly (subnormal codes too), the same bits as fp8_to_float_scaled_down's torch ops;
 * the caller multiplies the GEMM's output by 2**120 and the row scales once. The plain loop is what the
 * compiler vectorizes (-O3 -march=native); NaN codes (s.1111.111) become large finite values, as there.
 */
#include <stdint.h>

void pagoda_fp8_to_f32_scaled_down(const uint8_t *restrict src, int64_t n, uint32_t *restrict dst) {
    for (int64_t i = 0; i < n; i++) {
        const uint32_t b = src[i];
        dst[i] = ((b & 0x80u) << 24) | ((b & 0x7fu) << 20);
    }
}
