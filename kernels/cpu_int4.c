/* Float32 INT4 GEMM for CPUs: y[M, N] = x[M, K] @ dequant(W)^T, exact float32 arithmetic.
 *
 * W is the canonical layout of kernels/int4.py: packed uint8 [N, K/2] (weight k = 2j in the low
 * nibble of byte j, k = 2j + 1 in the high one) and per group a scale and an offset, with
 * w = q * scale + offset (every zero-point form reduces to this). `mode` says how the parameters are
 * held: 0, `scales` and `offsets` float32 [N, K/group]; 1, both float16, when that holds them
 * exactly (GGUF Q4_0/Q4_1); 2, codes (kernels/int4_codes.py): `scales` is uint8 [N, K/group, 3],
 * each group's 24 bits two 12-bit indices (scale low, offset high) into `offsets`, a float16
 * table. A thread decodes a row's parameters into float32 once, before its groups.
 *
 * x is split once per call into its even and odd k (the nibbles never need interleaving). Up to
 * FUSED_MAX_M rows of x (AVX-512): each group of W is dequantized straight into registers feeding
 * up to 8 accumulators, rows of W in pairs from 8 rows of x on. More rows: each thread dequantizes
 * one row of W at a time into a float32 buffer shared by blocks of 4 rows of x. Built at run time
 * by kernels/cpu_int4_native.py (gcc -O3 -march=native -fopenmp) and called through ctypes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_int4_params.h"
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#ifndef FUSED_MAX_M
#define FUSED_MAX_M 16
#endif

/* float buffers on 64-byte lines: malloc's 16-byte alignment left many x loads split across cache
 * lines, costing 5-27% of a GEMM depending on where the copies landed */
static float *alloc_floats(int64_t count) {
    const size_t bytes = ((size_t)(count > 0 ? count : 1) * sizeof(float) + 63) / 64 * 64;
    return (float *)aligned_alloc(64, bytes);
}

/* row r's scales and offsets as float32 sc[groups] and of[groups]: decoded once per row of W, then
 * every group and every row of x reads floats */
static inline void row_params(const void *s, const void *o, int mode, int64_t groups, int64_t r, float *sc,
                              float *of) {
    int4_row_params(s, o, mode, groups, r, sc, of, 1);
}

#ifdef __AVX512F__
/* group g's 16 possible weights, q * scale + offset (two roundings, as the reference), to be looked
 * up by nibble: one permute per 16 weights instead of a convert, a multiply and an add */
static inline __m512 group_table(const float *sc, const float *of, int64_t g) {
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    return _mm512_add_ps(_mm512_mul_ps(iota, _mm512_set1_ps(sc[g])), _mm512_set1_ps(of[g]));
}

/* 16 packed bytes -> the weights of their low nibbles (even k) and of their high nibbles (odd k) */
static inline void lookup16(const uint8_t *p, __m512 table, __m512 *we, __m512 *wo) {
    const __m128i low = _mm_set1_epi8(15), b = _mm_loadu_si128((const __m128i *)p);
    *we = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, low)), table);
    *wo = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low)), table);
}

/* 16 int8 weights times their block's scale (exact in float32) */
static inline __m512 scaled16_i8(const int8_t *q, __m512 scale) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), scale);
}
#endif

/* One row of W -> float32 weights of the even k (we) and of the odd k (wo), K/2 each. */
static void dequant_row(const uint8_t *p, const float *scs, const float *ofs, int64_t k, int64_t group, float *we,
                        float *wo) {
    for (int64_t g0 = 0; g0 < k; g0 += group) {
        const float sc = scs[g0 / group], of = ofs[g0 / group];
        const uint8_t *pb = p + g0 / 2;
        float *e = we + g0 / 2, *d = wo + g0 / 2;
        int64_t j = 0;
#ifdef __AVX512F__
        const __m512 table = group_table(scs, ofs, g0 / group);
        for (; j + 16 <= group / 2; j += 16) {
            __m512 ve, vo;
            lookup16(pb + j, table, &ve, &vo);
            _mm512_storeu_ps(e + j, ve);
            _mm512_storeu_ps(d + j, vo);
        }
#endif
        for (; j < group / 2; j++) {
            const uint8_t b = pb[j];
            e[j] = (float)(b & 15) * sc + of;
            d[j] = (float)(b >> 4) * sc + of;
        }
    }
}

/* out[i * stride] = sum_j we[j] * xe[i][j] + wo[j] * xo[i][j] for the rows i < rows (at most 4) of
 * x; four rows share each load of the weights. */
static void dot_rows(const float *we, const float *wo, const float *xe, const float *xo, int64_t h, int rows,
                     float *out, int64_t stride) {
    int64_t j = 0;
    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#ifdef __AVX512F__
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (; j + 16 <= h; j += 16) {
        const __m512 a = _mm512_loadu_ps(we + j), c = _mm512_loadu_ps(wo + j);
        for (int i = 0; i < rows; i++) {
            acc[i] = _mm512_fmadd_ps(a, _mm512_loadu_ps(xe + i * h + j), acc[i]);
            acc[i] = _mm512_fmadd_ps(c, _mm512_loadu_ps(xo + i * h + j), acc[i]);
        }
    }
    for (int i = 0; i < rows; i++) sum[i] = _mm512_reduce_add_ps(acc[i]);
#endif
    for (int i = 0; i < rows; i++) {
        for (int64_t t = j; t < h; t++) sum[i] += we[t] * xe[i * h + t] + wo[t] * xo[i * h + t];
        out[i * stride] = sum[i];
    }
}

#ifdef __AVX512F__
/* out[i * stride] = row r of W . x[i] for R rows of x (R <= 8), dequantizing as the reference does
 * (q * scale, then + offset: two roundings) straight into registers: each dequantized vector of 16
 * weights feeds R accumulators and is never stored. Needs group % 32 == 0. */
#define DEFINE_FUSED_ROWS(R)                                                                          \
    static void fused_rows_##R(const uint8_t *p, const float *sc, const float *of, int64_t k,           \
                               int64_t group, const float *xe, const float *xo, int64_t h, float *out, \
                               int64_t stride) {                                                     \
        __m512 acc[R];                                                                                \
        for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();                                   \
        for (int64_t g0 = 0; g0 < k; g0 += group) {                                                  \
            const __m512 table = group_table(sc, of, g0 / group);                                    \
            for (int64_t j = g0 / 2; j < (g0 + group) / 2; j += 16) {                                \
                __m512 we, wo;                                                                       \
                lookup16(p + j, table, &we, &wo);                                                    \
                for (int i = 0; i < R; i++) {                                                        \
                    acc[i] = _mm512_fmadd_ps(we, _mm512_loadu_ps(xe + i * h + j), acc[i]);           \
                    acc[i] = _mm512_fmadd_ps(wo, _mm512_loadu_ps(xo + i * h + j), acc[i]);           \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        for (int i = 0; i < R; i++) out[i * stride] = _mm512_reduce_add_ps(acc[i]);                 \
    }
DEFINE_FUSED_ROWS(1)
DEFINE_FUSED_ROWS(2)
DEFINE_FUSED_ROWS(3)
DEFINE_FUSED_ROWS(4)
DEFINE_FUSED_ROWS(5)
DEFINE_FUSED_ROWS(6)
DEFINE_FUSED_ROWS(7)
DEFINE_FUSED_ROWS(8)
/* the same for two rows of W at once (r and r + 1, `wstride` bytes apart in the packed weights, with
 * parameters sc, of and sc1, of1) over 8 rows of x: each load of x feeds two accumulators */
static void fused_pair_8(const uint8_t *p, const float *sc, const float *of, const float *sc1, const float *of1,
                         int64_t k, int64_t group, const float *xe, const float *xo, int64_t h, float *out,
                         int64_t stride, int64_t wstride) {
    __m512 a0[8], a1[8];
    for (int i = 0; i < 8; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < k; g0 += group) {
        const __m512 t0 = group_table(sc, of, g0 / group), t1 = group_table(sc1, of1, g0 / group);
        for (int64_t j = g0 / 2; j < (g0 + group) / 2; j += 16) {
            __m512 we0, wo0, we1, wo1;
            lookup16(p + j, t0, &we0, &wo0);
            lookup16(p + wstride + j, t1, &we1, &wo1);
            for (int i = 0; i < 8; i++) {
                const __m512 e = _mm512_loadu_ps(xe + i * h + j), d = _mm512_loadu_ps(xo + i * h + j);
                a0[i] = _mm512_fmadd_ps(wo0, d, _mm512_fmadd_ps(we0, e, a0[i]));
                a1[i] = _mm512_fmadd_ps(wo1, d, _mm512_fmadd_ps(we1, e, a1[i]));
            }
        }
    }
    for (int i = 0; i < 8; i++) {
        out[i * stride] = _mm512_reduce_add_ps(a0[i]);
        out[i * stride + 1] = _mm512_reduce_add_ps(a1[i]);
    }
}
typedef void (*fused_fn)(const uint8_t *, const float *, const float *, int64_t, int64_t, const float *,
                         const float *, int64_t, float *, int64_t);
static const fused_fn FUSED[9] = {0,           fused_rows_1, fused_rows_2, fused_rows_3, fused_rows_4,
                                  fused_rows_5, fused_rows_6, fused_rows_7, fused_rows_8};
#endif

int pagoda_int4_gemm_f32(const float *x, int64_t m, int64_t k, const uint8_t *packed, const void *scales,
                         const void *offsets, int mode, int64_t n, int64_t group, float *y, int threads) {
    if (k % group || group % 2) return 1;
    if (mode < 0 || mode > 2) return 4;
#ifndef __F16C__
    if (mode) return 3;
#endif
    const int64_t groups = k / group, h = k / 2;
    float *xe = alloc_floats(m * h), *xo = alloc_floats(m * h);
    if (!xe || !xo) {
        free(xe);
        free(xo);
        return 2;
    }
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < h; j++) {
            xe[i * h + j] = x[i * k + 2 * j];
            xo[i * h + j] = x[i * k + 2 * j + 1];
        }
    int failed = 0;
#ifdef __AVX512F__
    /* a few rows of x: dequantize into registers (each row of W once per 8 rows of x) */
    const int fused = group % 32 == 0 && m <= FUSED_MAX_M;
#else
    const int fused = 0;
#endif
#pragma omp parallel num_threads(threads)
    {
        /* per thread: two rows' parameters (sc, of each), and one dequantized row when not fused */
        float *buf = alloc_floats(4 * groups + (fused ? 0 : k));
        if (!buf) {
#pragma omp atomic write
            failed = 2;
        }
        /* every thread reaches the same worksharing loop; one without its buffer skips the rows */
        if (fused) {
#ifdef __AVX512F__
            const int64_t pairs = m >= 8 ? n / 2 : 0; /* rows of W taken two at a time */
            float *sc0 = buf, *of0 = buf + groups, *sc1 = buf + 2 * groups, *of1 = buf + 3 * groups;
#pragma omp for schedule(static)
            for (int64_t u = 0; u < pairs + (n - 2 * pairs); u++) {
                if (!buf) continue;
                const int64_t r = u < pairs ? 2 * u : 2 * pairs + (u - pairs);
                const int two = u < pairs;
                row_params(scales, offsets, mode, groups, r, sc0, of0);
                if (two) row_params(scales, offsets, mode, groups, r + 1, sc1, of1);
                for (int64_t i = 0; i < m;) {
                    const int rows = m - i < 8 ? (int)(m - i) : 8;
                    if (two && rows == 8) {
                        fused_pair_8(packed + r * h, sc0, of0, sc1, of1, k, group, xe + i * h, xo + i * h, h,
                                     y + i * n + r, n, h);
                    } else {
                        FUSED[rows](packed + r * h, sc0, of0, k, group, xe + i * h, xo + i * h, h, y + i * n + r, n);
                        if (two)
                            FUSED[rows](packed + (r + 1) * h, sc1, of1, k, group, xe + i * h, xo + i * h, h,
                                        y + i * n + r + 1, n);
                    }
                    i += rows;
                }
            }
#endif
        } else {
            float *sc = buf, *of = buf + groups, *w = buf + 4 * groups;
#pragma omp for schedule(static)
            for (int64_t r = 0; r < n; r++) {
                if (!buf) continue;
                row_params(scales, offsets, mode, groups, r, sc, of);
                dequant_row(packed + r * h, sc, of, k, group, w, w + h);
                for (int64_t i = 0; i < m; i += 4) {
                    const int rows = m - i < 4 ? (int)(m - i) : 4;
                    dot_rows(w, w + h, xe + i * h, xo + i * h, h, rows, y + i * n + r, n);
                }
            }
        }
        free(buf);
    }
    free(xe);
    free(xo);
    return failed;
}

/* INT8 weights with float16 block scales (GGUF Q8_0's layout: w = q * scale, blocks of `group` along
 * K): y[M, N] = x[M, K] @ dequant(W)^T in float32. Each thread dequantizes one row of W (exact in
 * float32: an 8-bit integer times a float16) and takes M dot products against it. */
static void dequant_row_i8(const int8_t *q, const uint16_t *s, int64_t k, int64_t group, float *w) {
    for (int64_t g0 = 0; g0 < k; g0 += group) {
        const float sc = from_half(s[g0 / group]);
        int64_t j = 0;
#ifdef __AVX512F__
        const __m512 vs = _mm512_set1_ps(sc);
        for (; j + 16 <= group; j += 16) _mm512_storeu_ps(w + g0 + j, scaled16_i8(q + g0 + j, vs));
#endif
        for (; j < group; j++) w[g0 + j] = (float)q[g0 + j] * sc;
    }
}

/* out[i * stride] = sum_j w[j] * x[i * k + j] for the rows i < rows (at most 4) of x: four rows
 * share each load of the weights. */
static void dot4_f32(const float *w, const float *x, int64_t k, int rows, float *out, int64_t stride) {
    int64_t j = 0;
    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#ifdef __AVX512F__
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (; j + 16 <= k; j += 16) {
        const __m512 a = _mm512_loadu_ps(w + j);
        for (int i = 0; i < rows; i++) acc[i] = _mm512_fmadd_ps(a, _mm512_loadu_ps(x + i * k + j), acc[i]);
    }
    for (int i = 0; i < rows; i++) sum[i] = _mm512_reduce_add_ps(acc[i]);
#endif
    for (int i = 0; i < rows; i++) {
        for (int64_t t = j; t < k; t++) sum[i] += w[t] * x[i * k + t];
        out[i * stride] = sum[i];
    }
}

#ifdef __AVX512F__
/* out[i * stride] = row of W . x[i] for R rows of x (R <= 8): each block of 16 int8 weights is
 * converted and scaled (exactly) in registers and feeds R accumulators. Needs group % 16 == 0. */
#define DEFINE_FUSED_I8(R)                                                                               \
    static void fused_i8_##R(const int8_t *q, const uint16_t *s, int64_t k, int64_t group, const float *x, \
                             float *out, int64_t stride) {                                              \
        __m512 acc[R];                                                                                   \
        for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();                                      \
        for (int64_t g0 = 0; g0 < k; g0 += group) {                                                     \
            const __m512 vs = _mm512_set1_ps(_cvtsh_ss(s[g0 / group]));                                 \
            for (int64_t j = g0; j < g0 + group; j += 16) {                                             \
                const __m512 w = scaled16_i8(q + j, vs);                                                \
                for (int i = 0; i < R; i++) acc[i] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + i * k + j), acc[i]); \
            }                                                                                           \
        }                                                                                               \
        for (int i = 0; i < R; i++) out[i * stride] = _mm512_reduce_add_ps(acc[i]);                    \
    }
DEFINE_FUSED_I8(1)
DEFINE_FUSED_I8(2)
DEFINE_FUSED_I8(3)
DEFINE_FUSED_I8(4)
DEFINE_FUSED_I8(5)
DEFINE_FUSED_I8(6)
DEFINE_FUSED_I8(7)
DEFINE_FUSED_I8(8)
/* two rows of W (`wstride` int8 apart) over 8 rows of x: each load of x feeds two accumulators */
static void fused_i8_pair_8(const int8_t *q, const uint16_t *s, int64_t k, int64_t group, const float *x, float *out,
                            int64_t stride, int64_t wstride) {
    __m512 a0[8], a1[8];
    for (int i = 0; i < 8; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    const int64_t groups = k / group;
    for (int64_t g0 = 0; g0 < k; g0 += group) {
        const __m512 s0 = _mm512_set1_ps(_cvtsh_ss(s[g0 / group])), s1 = _mm512_set1_ps(_cvtsh_ss(s[groups + g0 / group]));
        for (int64_t j = g0; j < g0 + group; j += 16) {
            const __m512 w0 = scaled16_i8(q + j, s0), w1 = scaled16_i8(q + wstride + j, s1);
            for (int i = 0; i < 8; i++) {
                const __m512 xv = _mm512_loadu_ps(x + i * k + j);
                a0[i] = _mm512_fmadd_ps(w0, xv, a0[i]);
                a1[i] = _mm512_fmadd_ps(w1, xv, a1[i]);
            }
        }
    }
    for (int i = 0; i < 8; i++) {
        out[i * stride] = _mm512_reduce_add_ps(a0[i]);
        out[i * stride + 1] = _mm512_reduce_add_ps(a1[i]);
    }
}
typedef void (*fused_i8_fn)(const int8_t *, const uint16_t *, int64_t, int64_t, const float *, float *, int64_t);
static const fused_i8_fn FUSED_I8[9] = {0,          fused_i8_1, fused_i8_2, fused_i8_3, fused_i8_4,
                                        fused_i8_5, fused_i8_6, fused_i8_7, fused_i8_8};
#endif

int pagoda_int8_gemm_f32(const float *x, int64_t m, int64_t k, const int8_t *q, const uint16_t *scales, int64_t n,
                         int64_t group, float *y, int threads) {
#ifndef __F16C__
    return 3;
#endif
    if (k % group) return 1;
    const int64_t groups = k / group;
    int failed = 0;
#if defined(__AVX512F__) && defined(__F16C__)
    if (group % 16 == 0 && m <= FUSED_MAX_M) {
        const int64_t pairs = m >= 8 ? n / 2 : 0; /* rows of W taken two at a time */
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t u = 0; u < pairs + (n - 2 * pairs); u++) {
            const int64_t r = u < pairs ? 2 * u : 2 * pairs + (u - pairs);
            for (int64_t i = 0; i < m; i += 8) {
                const int rows = m - i < 8 ? (int)(m - i) : 8;
                if (u < pairs && rows == 8)
                    fused_i8_pair_8(q + r * k, scales + r * groups, k, group, x + i * k, y + i * n + r, n, k);
                else
                    for (int64_t w = r; w < (u < pairs ? r + 2 : r + 1); w++)
                        FUSED_I8[rows](q + w * k, scales + w * groups, k, group, x + i * k, y + i * n + w, n);
            }
        }
        return 0;
    }
#endif
#pragma omp parallel num_threads(threads)
    {
        float *w = alloc_floats(k);
        if (!w) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            if (!w) continue; /* every thread reaches the loop; one without its buffer skips its rows */
            dequant_row_i8(q + r * k, scales + r * groups, k, group, w);
            for (int64_t i = 0; i < m; i += 4)
                dot4_f32(w, x + i * k, k, m - i < 4 ? (int)(m - i) : 4, y + i * n + r, n);
        }
        free(w);
    }
    return failed;
}
