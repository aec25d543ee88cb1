/* Float32-accurate INT4 GEMM with AVX-512 VNNI integer dot products: y[M, N] = x[M, K] @ dequant(W)^T.
 *
 * W: the canonical nibbles of kernels/cpu_int4.c (packed uint8 [N, K/2], k = 2j low nibble of byte j,
 * 2j + 1 high), interleaved 16 rows at a time: N padded with zero rows to N16 (a multiple of 16), viewed
 * as [N16/16, 16, K/8, 4] and permuted to [N16/16, K/8, 16, 4], so dword column j of 16 rows (k = 8j ..
 * 8j + 7 of each, as in its canonical row) is one 64-byte vector: the 16 rows sit in the 16 int32 lanes
 * of _mm512_dpbusd_epi32. Scales and offsets keep their canonical [N, K/group] forms and `mode` (0
 * float32, 1 float16, 2 codes into a float16 table, see kernels/int4_codes.py); w = q * scale + offset.
 *
 * x is split once per call into blocks of 32 k. A block gets a power-of-two step e and X = round(x / e)
 * with |X| <= 127 * 2^16 (24 bits relative to the block's max|x|), held as 3 balanced signed int8 limbs
 * X = hi * 2^16 + mid * 2^8 + lo: 2 limbs (16 bits) cost 1e-4 of max|y|, 3 limbs bring the error to the
 * float32 kernel's level (~5e-7). Per block and row the integer sums q . (hi * 256 + mid) < 2^24 and
 * q . lo are exact in float32 and joined by one FMA, then y += scale * e * dot + offset * e * sum(X).
 *
 * Returns 0 ok; 1 bad shape (m, n < 1, k % 32, group % 32, k % group); 2 allocation failure; 4 bad
 * mode; 5 built without AVX-512 F/BW/VNNI and F16C (the caller runs the float32 kernel); 6 x holds a
 * NaN or an infinity (the caller runs the float32 kernel, so results keep float semantics).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_int4_params.h"
#include "cpu_vnni.h" /* xblock, prepare_block; PAGODA_VNNI where AVX-512 F/BW/VNNI and F16C are built in */

#ifdef PAGODA_VNNI
/* The parameters of rows r0 .. r0 + rows - 1, whatever the mode (the decoding of kernels/cpu_int4.c), as
 * float32 d[groups][16] and of[groups][16], zeros past `rows`: decoded once per block of 16 rows. */
static void block_params(const void *s, const void *o, int mode, int64_t groups, int64_t r0, int rows, float *d,
                         float *of) {
    if (rows < 16)
        for (int64_t g = 0; g < groups; g++)
            for (int r = rows; r < 16; r++) d[g * 16 + r] = of[g * 16 + r] = 0.0f;
    for (int r = 0; r < rows; r++) int4_row_params(s, o, mode, groups, r0 + r, d + r, of + r, 16);
}

/* R rows of x (xq, `blocks` xblocks per row) against one block of 16 rows of W (w: its K/8 x 64 bytes;
 * d, o: [groups][16]); `per` x blocks per W group; stores the `mask` columns of y. */
static inline __attribute__((always_inline)) void tile(const uint8_t *w, const float *d, const float *o,
                                                       int64_t groups, int64_t per, const xblock *xq,
                                                       int64_t blocks, float *y, int64_t n, __mmask16 mask,
                                                       const int R) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512 c256 = _mm512_set1_ps(256.0f);
    for (int64_t g = 0; g < groups; g++) {
        const __m512 dg = _mm512_loadu_ps(d + g * 16), og = _mm512_loadu_ps(o + g * 16);
        for (int64_t b = g * per; b < (g + 1) * per; b++) {
            __m512i q[8]; /* q[2j]: low nibbles of dword column j (k 0, 2, 4, 6), q[2j + 1]: high ones */
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512((const void *)(w + (b * 4 + j) * 64));
                q[2 * j] = _mm512_and_si512(v, low4);
                q[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi32(v, 4), low4);
            }
#pragma GCC unroll 16
            for (int i = 0; i < R; i++) {
                const xblock *xb = xq + i * blocks + b;
                __m512i t0 = _mm512_setzero_si512(), t1 = _mm512_setzero_si512();
                __m512i u0 = _mm512_setzero_si512(), u1 = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    t0 = _mm512_dpbusd_epi32(t0, q[2 * j], _mm512_set1_epi32(xb->hi[2 * j]));
                    t1 = _mm512_dpbusd_epi32(t1, q[2 * j + 1], _mm512_set1_epi32(xb->hi[2 * j + 1]));
                }
                t0 = _mm512_slli_epi32(t0, 8);
                t1 = _mm512_slli_epi32(t1, 8);
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    t0 = _mm512_dpbusd_epi32(t0, q[2 * j], _mm512_set1_epi32(xb->mid[2 * j]));
                    t1 = _mm512_dpbusd_epi32(t1, q[2 * j + 1], _mm512_set1_epi32(xb->mid[2 * j + 1]));
                    u0 = _mm512_dpbusd_epi32(u0, q[2 * j], _mm512_set1_epi32(xb->lo[2 * j]));
                    u1 = _mm512_dpbusd_epi32(u1, q[2 * j + 1], _mm512_set1_epi32(xb->lo[2 * j + 1]));
                }
                /* |q . (256 hi + mid)| < 2^24 and |q . lo| < 2^16: exact; one rounding joins them */
                const __m512 top = _mm512_cvtepi32_ps(_mm512_add_epi32(t0, t1));
                const __m512 bottom = _mm512_cvtepi32_ps(_mm512_add_epi32(u0, u1));
                const __m512 dot = _mm512_mul_ps(_mm512_fmadd_ps(top, c256, bottom), _mm512_set1_ps(xb->e));
                acc[i] = _mm512_fmadd_ps(dg, dot, acc[i]);
                acc[i] = _mm512_fmadd_ps(og, _mm512_set1_ps(xb->sx), acc[i]);
            }
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; i++) _mm512_mask_storeu_ps(y + i * n, mask, acc[i]);
}

typedef void (*tile_fn)(const uint8_t *, const float *, const float *, int64_t, int64_t, const xblock *, int64_t,
                        float *, int64_t, __mmask16);
#define DEFINE_TILE(R)                                                                                        \
    static void tile_##R(const uint8_t *w, const float *d, const float *o, int64_t groups, int64_t per,        \
                         const xblock *xq, int64_t blocks, float *y, int64_t n, __mmask16 mask) {              \
        tile(w, d, o, groups, per, xq, blocks, y, n, mask, R);                                                \
    }
DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(4)
DEFINE_TILE(8)
DEFINE_TILE(16)
#endif

int pagoda_int4_vnni_gemm_f32(const float *x, int64_t m, int64_t k, const uint8_t *packed16, const void *scales,
                              const void *offsets, int mode, int64_t n, int64_t group, float *y, int threads) {
#ifndef PAGODA_VNNI
    (void)x, (void)m, (void)k, (void)packed16, (void)scales, (void)offsets, (void)mode, (void)n, (void)group;
    (void)y, (void)threads;
    return 5;
#else
    if (m < 1 || n < 1 || k < 32 || group < 32 || k % 32 || group % 32 || k % group) return 1;
    if (mode < 0 || mode > 2) return 4;
    if (threads < 1) threads = 1;
    const int64_t blocks = k / 32, groups = k / group, per = group / 32, nblocks = (n + 15) / 16;
    xblock *xq = (xblock *)aligned_alloc(64, sizeof(xblock) * (size_t)(m * blocks));
    if (!xq) return 2;
    int failed = 0;
    const int serial = m * blocks <= PREP_SERIAL_BLOCKS;
    int bad = prepare_x_serial(x, m, k, xq, 1, serial);
    if (bad) {
        free(xq);
        return 6;
    }
#pragma omp parallel num_threads(threads)
    {
        /* per thread: d and o [groups][16] */
        float *buf = (float *)aligned_alloc(64, sizeof(float) * 32 * (size_t)groups);
        if (!buf) {
#pragma omp atomic write
            failed = 2;
        }
        if (!serial) prepare_x_team(x, m, k, xq, 1, &bad);
        int skip;
#pragma omp atomic read
        skip = bad;
        /* every thread reaches this loop; one without its buffer, or any when x is not finite, skips */
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < nblocks; nb++) {
            if (!buf || skip) continue;
            const int64_t r0 = nb * 16;
            const int rows = n - r0 < 16 ? (int)(n - r0) : 16;
            float *d = buf, *o = buf + 16 * groups;
            block_params(scales, offsets, mode, groups, r0, rows, d, o);
            const uint8_t *w = packed16 + nb * (k / 8) * 64;
            const __mmask16 mask = (__mmask16)((1u << rows) - 1);
            static const tile_fn TILES[17] = {[1] = tile_1, [2] = tile_2, [4] = tile_4, [8] = tile_8,
                                              [16] = tile_16};
            for (int64_t i = 0; i < m;) {
                const int R = m - i >= 16 ? 16 : m - i >= 8 ? 8 : m - i >= 4 ? 4 : m - i >= 2 ? 2 : 1;
                TILES[R](w, d, o, groups, per, xq + i * blocks, blocks, y + i * n + r0, n, mask);
                i += R;
            }
        }
        free(buf);
    }
    free(xq);
    return bad ? 6 : failed;
#endif
}
