/* Float32-accurate INT8 GEMM with AVX-512 VNNI integer dot products: y[M, N] = x[M, K] @ (q * scale)^T.
 *
 * W: int8 q [N, K] (-128..127) stored biased, u = q + 128 as uint8 (the unsigned operand of
 * _mm512_dpbusd_epi32), interleaved 16 rows at a time: N padded with rows of 128 (q = 0) to N16 (a
 * multiple of 16), viewed as [N16/16, 16, K/4, 4] and permuted to [N16/16, K/4, 16, 4], so dword column
 * j of 16 rows (k = 4j .. 4j + 3) is one 64-byte vector, the 16 rows in the 16 int32 lanes. Scales keep
 * their canonical float16 [N, K/group] form, decoded once per 16-row block.
 *
 * x is split per block of 32 k as in cpu_vnni.h (step e, 3 signed int8 limbs: 24 bits relative to the
 * block's max|x|). Per block and row sum_k u * X = sum_k q * X + 128 * sum_k X: the accumulators start at
 * the block's correction (chi before the hi limbs' sum is shifted by 8 bits, clo beside the lo limbs),
 * so top = 256 * (u . hi + chi) + u . mid and bottom = u . lo + clo are int32 with 256 * top + bottom =
 * q . X exactly; top rounds once to float32 (relative 2^-24 of |q . X| + 2^21), bottom (< 2^21) is exact,
 * one FMA joins them and y += scale * e * dot. The error is the float32 kernel's level (~5e-7 of max|y|).
 *
 * Returns 0 ok; 1 bad shape (m, n < 1, k % 32, group % 32, k % group); 2 allocation failure; 5 built
 * without AVX-512 F/BW/VNNI and F16C (the caller runs the float32 kernel); 6 x holds a NaN or an infinity
 * (the caller runs the float32 kernel, so results keep float semantics).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vnni.h" /* xblock, prepare_block; PAGODA_VNNI where AVX-512 F/BW/VNNI and F16C are built in */

#ifdef PAGODA_VNNI
/* float16 scales of rows r0 .. r0 + rows - 1 as float32 d[groups][16], zeros past `rows` */
static void block_scales(const uint16_t *s, int64_t groups, int64_t r0, int rows, float *d) {
    if (rows < 16)
        for (int64_t g = 0; g < groups; g++)
            for (int r = rows; r < 16; r++) d[g * 16 + r] = 0.0f;
    for (int r = 0; r < rows; r++) {
        const uint16_t *rs = s + (r0 + r) * groups;
        for (int64_t g = 0; g < groups; g++) d[g * 16 + r] = _cvtsh_ss(rs[g]);
    }
}

/* R rows of x (xq, `blocks` xblocks per row) against one block of 16 rows of W (w: its K/4 x 64 bytes;
 * d: [groups][16]); `per` x blocks per W group; stores the `mask` columns of y. */
static inline __attribute__((always_inline)) void tile(const uint8_t *w, const float *d, int64_t groups,
                                                       int64_t per, const xblock *xq, int64_t blocks, float *y,
                                                       int64_t n, __mmask16 mask, const int R) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    const __m512 c256 = _mm512_set1_ps(256.0f);
    for (int64_t g = 0; g < groups; g++) {
        const __m512 dg = _mm512_loadu_ps(d + g * 16);
        for (int64_t b = g * per; b < (g + 1) * per; b++) {
            __m512i u[8]; /* u[j]: dword column 8b + j (k = 32b + 4j .. 32b + 4j + 3) of the 16 rows */
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) u[j] = _mm512_loadu_si512((const void *)(w + (b * 8 + j) * 64));
#pragma GCC unroll 16
            for (int i = 0; i < R; i++) {
                const xblock *xb = xq + i * blocks + b;
                /* |u . hi + chi| < 2^21 before the shift, |top| < 2^29 after: no int32 overflow */
                __m512i t0 = _mm512_set1_epi32(xb->chi), t1 = _mm512_setzero_si512();
                __m512i v0 = _mm512_set1_epi32(xb->clo), v1 = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    t0 = _mm512_dpbusd_epi32(t0, u[2 * j], _mm512_set1_epi32(xb->hi[2 * j]));
                    t1 = _mm512_dpbusd_epi32(t1, u[2 * j + 1], _mm512_set1_epi32(xb->hi[2 * j + 1]));
                }
                t0 = _mm512_slli_epi32(t0, 8);
                t1 = _mm512_slli_epi32(t1, 8);
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    t0 = _mm512_dpbusd_epi32(t0, u[2 * j], _mm512_set1_epi32(xb->mid[2 * j]));
                    t1 = _mm512_dpbusd_epi32(t1, u[2 * j + 1], _mm512_set1_epi32(xb->mid[2 * j + 1]));
                    v0 = _mm512_dpbusd_epi32(v0, u[2 * j], _mm512_set1_epi32(xb->lo[2 * j]));
                    v1 = _mm512_dpbusd_epi32(v1, u[2 * j + 1], _mm512_set1_epi32(xb->lo[2 * j + 1]));
                }
                const __m512 top = _mm512_cvtepi32_ps(_mm512_add_epi32(t0, t1));
                const __m512 bottom = _mm512_cvtepi32_ps(_mm512_add_epi32(v0, v1));
                const __m512 dot = _mm512_mul_ps(_mm512_fmadd_ps(top, c256, bottom), _mm512_set1_ps(xb->e));
                acc[i] = _mm512_fmadd_ps(dg, dot, acc[i]);
            }
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; i++) _mm512_mask_storeu_ps(y + i * n, mask, acc[i]);
}

typedef void (*tile_fn)(const uint8_t *, const float *, int64_t, int64_t, const xblock *, int64_t, float *,
                        int64_t, __mmask16);
#define DEFINE_TILE(R)                                                                                        \
    static void tile_##R(const uint8_t *w, const float *d, int64_t groups, int64_t per, const xblock *xq,      \
                         int64_t blocks, float *y, int64_t n, __mmask16 mask) {                                \
        tile(w, d, groups, per, xq, blocks, y, n, mask, R);                                                   \
    }
DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(4)
DEFINE_TILE(8)
DEFINE_TILE(16)
#endif

int pagoda_int8_vnni_gemm_f32(const float *x, int64_t m, int64_t k, const uint8_t *q16, const uint16_t *scales,
                              int64_t n, int64_t group, float *y, int threads) {
#ifndef PAGODA_VNNI
    (void)x, (void)m, (void)k, (void)q16, (void)scales, (void)n, (void)group, (void)y, (void)threads;
    return 5;
#else
    if (m < 1 || n < 1 || k < 32 || group < 32 || k % 32 || group % 32 || k % group) return 1;
    if (threads < 1) threads = 1;
    const int64_t blocks = k / 32, groups = k / group, per = group / 32, nblocks = (n + 15) / 16;
    xblock *xq = (xblock *)aligned_alloc(64, sizeof(xblock) * (size_t)(m * blocks));
    if (!xq) return 2;
    int failed = 0;
    const int serial = m * blocks <= PREP_SERIAL_BLOCKS;
    int bad = prepare_x_serial(x, m, k, xq, 0, serial);
    if (bad) {
        free(xq);
        return 6;
    }
#pragma omp parallel num_threads(threads)
    {
        /* per thread: d [groups][16], 64-byte aligned (groups * 64 bytes) */
        float *d = (float *)aligned_alloc(64, sizeof(float) * 16 * (size_t)groups);
        if (!d) {
#pragma omp atomic write
            failed = 2;
        }
        if (!serial) prepare_x_team(x, m, k, xq, 0, &bad);
        int skip;
#pragma omp atomic read
        skip = bad;
        /* every thread reaches this loop; one without its buffer, or any when x is not finite, skips */
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < nblocks; nb++) {
            if (!d || skip) continue;
            const int64_t r0 = nb * 16;
            const int rows = n - r0 < 16 ? (int)(n - r0) : 16;
            block_scales(scales, groups, r0, rows, d);
            const uint8_t *w = q16 + nb * (k / 4) * 64;
            const __mmask16 mask = (__mmask16)((1u << rows) - 1);
            static const tile_fn TILES[17] = {[1] = tile_1, [2] = tile_2, [4] = tile_4, [8] = tile_8,
                                              [16] = tile_16};
            for (int64_t i = 0; i < m;) {
                const int R = m - i >= 16 ? 16 : m - i >= 8 ? 8 : m - i >= 4 ? 4 : m - i >= 2 ? 2 : 1;
                TILES[R](w, d, groups, per, xq + i * blocks, blocks, y + i * n + r0, n, mask);
                i += R;
            }
        }
        free(d);
    }
    free(xq);
    return bad ? 6 : failed;
#endif
}
