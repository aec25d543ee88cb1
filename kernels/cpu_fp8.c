/* The CPU FP8 GEMM's native side (kernels/fp8.py): e4m3 weight codes -> float32 values, and a fused GEMM.
 *
 * Code s.eeee.mmm placed in a float32 as sign s, exponent field 0000eeee and mantissa mmm000... reads
 * value * 2**-120 exactly (subnormal codes too: fp8_to_float_scaled_down's torch trick); one multiply by
 * 2**120 (exact) gives the value itself. Both functions return exact values, not the scaled-down ones:
 * products of activations with values near 2**-120 are float32 subnormals, and on the CPUs measured
 * (Intel Xeon) every FMA that produces one takes a microcode assist (2.4x slower GEMMs on the built-in
 * model's real activations). NaN codes (s.1111.111) become +-480, as in the torch trick. The caller
 * applies the row scales once.
 */
#include <stdint.h>
#include <string.h>

void pagoda_fp8_to_f32(const uint8_t *restrict src, int64_t n, float *restrict dst) {
    for (int64_t i = 0; i < n; i++) { /* the plain loop the compiler vectorizes (-O3 -march=native) */
        const uint32_t b = src[i], bits = ((b & 0x80u) << 24) | ((b & 0x7fu) << 20);
        float f;
        memcpy(&f, &bits, sizeof f);
        dst[i] = f * 0x1p120f;
    }
}

/* y[M, N] = x[M, K] @ dec(w)[N, K]^T for few activation rows (decode, small prefill chunks), where dec reads
 * each e4m3 code as its value (the caller applies the row scales). Threads split the weight rows in blocks
 * of 4; each 16-wide step of K feeds R activation rows times C = 4 weight rows of FMAs into R x C float32
 * vector accumulators, reduced across lanes once per output and K chunk (KC values of K).
 * With at most 4 activation rows (decode) the codes decode in registers (sign-extend, shift by 20, mask,
 * scale: 4 operations per 16 weights) and no float32 copy of the weight is written. With more (prefill
 * chunks), decoding in registers would repeat for every tile of rows and take as many vector operations as
 * the FMAs; so each block's chunk of codes is decoded once into a 32 KB stack buffer (it stays in L1) that
 * every tile of 6 rows then reads. Both ways run the same FMAs in the same order: a row's outputs do not
 * depend on how many rows ride with it. The codes read as their values (not scaled down): see the top of
 * this file.
 * Returns 0 ok; 1 bad shape (m, n < 1, k % 16); 5 built without AVX-512 F (the caller decodes, then
 * multiplies in torch).
 */
#ifdef __AVX512F__
#include <immintrin.h>

#define KC 2048   /* values of K per chunk: 4 decoded weight rows of a chunk fill 32 KB */
#define REG_ROWS 4 /* up to this many activation rows, codes decode in registers */

static inline __m512 dec16(const uint8_t *p) {
    const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i bits = _mm512_and_si512(_mm512_slli_epi32(v, 20), _mm512_set1_epi32((int)0x87F00000u));
    return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
}

/* R activation rows x C weight rows over K values [k0, k1): weight rows from the codes w (row stride k) or,
 * with wd, from the decoded chunk (row stride KC, index kk - k0); add: accumulate into y (a later chunk). */
static inline __attribute__((always_inline)) void fp8_tile(const float *x, int64_t k, int64_t k0, int64_t k1,
                                                       const uint8_t *w, const float *wd, float *y, int64_t n,
                                                       const int R, const int C, const int add) {
    __m512 acc[6][4];
#pragma GCC unroll 6
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int j = 0; j < C; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t kk = k0; kk < k1; kk += 16) {
        __m512 wv[4];
#pragma GCC unroll 4
        for (int j = 0; j < C; j++) wv[j] = wd ? _mm512_load_ps(wd + j * KC + (kk - k0)) : dec16(w + j * k + kk);
#pragma GCC unroll 6
        for (int i = 0; i < R; i++) {
            const __m512 xv = _mm512_loadu_ps(x + i * k + kk);
#pragma GCC unroll 4
            for (int j = 0; j < C; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int j = 0; j < C; j++) {
            const float s = _mm512_reduce_add_ps(acc[i][j]);
            y[i * n + j] = add ? y[i * n + j] + s : s;
        }
}

/* every activation row against 4 weight rows (wb, row stride k) over one K chunk; wd: decoded or NULL */
static inline __attribute__((always_inline)) void fp8_rows_x4(const float *x, int64_t m, int64_t k, int64_t k0, int64_t k1, const uint8_t *wb,
                        const float *wd, float *y, int64_t n, int add) {
    int64_t r0 = 0;
    for (; r0 + 6 <= m; r0 += 6) fp8_tile(x + r0 * k, k, k0, k1, wb, wd, y + r0 * n, n, 6, 4, add);
    const float *xr = x + r0 * k;
    float *yr = y + r0 * n;
    switch (m - r0) { /* the last rows: a tile of their own count, so each is unrolled */
    case 5: fp8_tile(xr, k, k0, k1, wb, wd, yr, n, 5, 4, add); break;
    case 4: fp8_tile(xr, k, k0, k1, wb, wd, yr, n, 4, 4, add); break;
    case 3: fp8_tile(xr, k, k0, k1, wb, wd, yr, n, 3, 4, add); break;
    case 2: fp8_tile(xr, k, k0, k1, wb, wd, yr, n, 2, 4, add); break;
    case 1: fp8_tile(xr, k, k0, k1, wb, wd, yr, n, 1, 4, add); break;
    default: break;
    }
}

/* one block of up to 4 weight rows against every activation row */
static void fp8_rows_block(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, int64_t c0, float *y) {
    const int c = n - c0 < 4 ? (int)(n - c0) : 4;
    const uint8_t *wb = w + c0 * k;
    float wbuf[4 * KC] __attribute__((aligned(64)));
    for (int64_t k0 = 0; k0 < k; k0 += KC) {
        const int64_t k1 = k - k0 < KC ? k : k0 + KC;
        const int add = k0 > 0;
        const float *wd = NULL;
        if (m > REG_ROWS) { /* decode this chunk of the block's rows once */
            for (int j = 0; j < c; j++)
                for (int64_t kk = k0; kk < k1; kk += 16) _mm512_store_ps(wbuf + j * KC + (kk - k0), dec16(wb + j * k + kk));
            wd = wbuf;
        }
        if (c == 4) { /* two instances, so that neither tests wd in its inner loop */
            if (wd) fp8_rows_x4(x, m, k, k0, k1, wb, wbuf, y + c0, n, add);
            else fp8_rows_x4(x, m, k, k0, k1, wb, NULL, y + c0, n, add);
            continue;
        }
        for (int64_t r = 0; r < m; r++)
            for (int j = 0; j < c; j++)
                fp8_tile(x + r * k, k, k0, k1, wb + j * k, wd ? wd + j * KC : NULL, y + r * n + c0 + j, n, 1, 1, add);
    }
}
#endif

int pagoda_fp8_gemm_f32(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *y) {
    if (m < 1 || n < 1 || k < 16 || k % 16) return 1;
#ifdef __AVX512F__
    const int64_t blocks = (n + 3) / 4;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) fp8_rows_block(x, m, k, w, n, b * 4, y);
    return 0;
#else
    (void)x; (void)w; (void)y;
    return 5;
#endif
}
