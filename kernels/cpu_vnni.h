/* The x side of the AVX-512 VNNI GEMMs (cpu_int4_vnni.c, cpu_int8_vnni.c): x split per block of 32 k
 * into a power-of-two step e and X = round(x / e), |X| <= 127 * 2^16 (24 bits relative to the block's
 * max|x|), held as 3 balanced signed int8 limbs X = hi * 2^16 + mid * 2^8 + lo, the signed operand of
 * _mm512_dpbusd_epi32. */
#ifndef PAGODA_CPU_VNNI_H
#define PAGODA_CPU_VNNI_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define PAGODA_VNNI 1
#include <immintrin.h>

/* one row of x over 32 k: limbs as dwords of 4 bytes (their order set by prepare_block's `nibbles`);
 * e the step, sx e * sum(X); chi and clo the bias corrections of a weight operand stored +128: sum over
 * the block of 128 * X = 2^16 * -chi - clo, chi = -(sum X >> 9) added before the hi limbs' sum is
 * shifted by 8 bits, clo = -128 * (sum X & 511) beside the lo limbs' sum. 128 bytes, on 64-byte lines. */
typedef struct {
    int32_t hi[8], mid[8], lo[8];
    float e, sx;
    int32_t chi, clo;
    int32_t pad[4];
} xblock;

#define XLIMIT 8323072          /* 127 * 2^16: the top balanced digit stays within int8 */
#define XBITS 23                /* 2^(XBITS-1) < XLIMIT < 2^XBITS */
#define PREP_SERIAL_BLOCKS 1024 /* x blocks prepared before the parallel region (~10 ns each) */

static inline float pow2f(int ex) { /* a normal power of two, -126 <= ex <= 127 */
    const uint32_t bits = (uint32_t)(ex + 127) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* 32 floats at v -> out; returns 1 when one of them is not finite. With `nibbles` dword 2j holds k = 8j
 * + 0, 2, 4, 6 and dword 2j + 1 k = 8j + 1, 3, 5, 7 (the order of the low and high nibbles of an INT4
 * dword), else dword j holds k = 4j .. 4j + 3. */
static inline int prepare_block(const float *v, xblock *out, const int nibbles) {
    const __m512 x0 = _mm512_loadu_ps(v), x1 = _mm512_loadu_ps(v + 16);
    const __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1), inf = _mm512_set1_ps(__builtin_inff());
    /* NaN compares unordered and inf not less: both leave a lane out */
    const __mmask16 finite = _mm512_cmp_ps_mask(a0, inf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(a1, inf, _CMP_LT_OQ);
    if (finite != 0xFFFF) return 1;
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
    /* the smallest e = 2^ex with amax / e <= XLIMIT, but a normal float (ex >= -126: blocks below
     * ~2^-103 keep what survives a step of 2^-126) */
    uint32_t bits;
    memcpy(&bits, &amax, 4);
    int ex = (int)(bits >> 23) - 127 - (XBITS - 1);
    if (ex < -126) ex = -126;
    if (amax > (float)XLIMIT * pow2f(ex)) ex++;
    const __m512 inv = _mm512_set1_ps(pow2f(-ex));
    /* x / e is exact; the conversion rounds to nearest even; |X| <= XLIMIT */
    const __m512i X0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv));
    const __m512i X1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
    const __m512i c128 = _mm512_set1_epi32(128);
    /* balanced base-256 digits: t = (X + 128) >> 8, digit = X - 256 t in [-128, 127] */
    const __m512i t0 = _mm512_srai_epi32(_mm512_add_epi32(X0, c128), 8);
    const __m512i t1 = _mm512_srai_epi32(_mm512_add_epi32(X1, c128), 8);
    const __m512i l0 = _mm512_sub_epi32(X0, _mm512_slli_epi32(t0, 8));
    const __m512i l1 = _mm512_sub_epi32(X1, _mm512_slli_epi32(t1, 8));
    const __m512i h0 = _mm512_srai_epi32(_mm512_add_epi32(t0, c128), 8);
    const __m512i h1 = _mm512_srai_epi32(_mm512_add_epi32(t1, c128), 8);
    const __m512i m0 = _mm512_sub_epi32(t0, _mm512_slli_epi32(h0, 8));
    const __m512i m1 = _mm512_sub_epi32(t1, _mm512_slli_epi32(h1, 8));
    const __m128i order = nibbles ? _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15)
                                  : _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    _mm_store_si128((__m128i *)&out->hi[0], _mm_shuffle_epi8(_mm512_cvtepi32_epi8(h0), order));
    _mm_store_si128((__m128i *)&out->hi[4], _mm_shuffle_epi8(_mm512_cvtepi32_epi8(h1), order));
    _mm_store_si128((__m128i *)&out->mid[0], _mm_shuffle_epi8(_mm512_cvtepi32_epi8(m0), order));
    _mm_store_si128((__m128i *)&out->mid[4], _mm_shuffle_epi8(_mm512_cvtepi32_epi8(m1), order));
    _mm_store_si128((__m128i *)&out->lo[0], _mm_shuffle_epi8(_mm512_cvtepi32_epi8(l0), order));
    _mm_store_si128((__m128i *)&out->lo[4], _mm_shuffle_epi8(_mm512_cvtepi32_epi8(l1), order));
    out->e = pow2f(ex);
    /* |sum X| < 2^28: one rounding to float, times a power of two */
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(X0, X1));
    out->sx = (float)sum * out->e;
    out->chi = -(sum >> 9); /* arithmetic shift: floor, so 512 * (sum >> 9) + (sum & 511) = sum */
    out->clo = -128 * (sum & 511);
    return 0;
}

/* x [m, k] -> xq [m * k / 32] blocks. `serial` (few blocks, a decode step): this thread prepares them
 * before the parallel region, sparing the team a barrier (one that costs a scheduler slice when
 * another process holds a core); returns 1 when x is not finite. Otherwise returns 0 and the team
 * prepares them in prepare_x_team. */
static inline int prepare_x_serial(const float *x, int64_t m, int64_t k, xblock *xq, int nibbles, int serial) {
    const int64_t blocks = k / 32;
    int bad = 0;
    for (int64_t t = 0; serial && t < m * blocks; t++)
        bad |= prepare_block(x + (t / blocks) * k + (t % blocks) * 32, xq + t, nibbles);
    return bad;
}

/* Called by every thread of a team when not serial: a worksharing loop over the blocks, ending in
 * its barrier (every block ready); *bad set when x is not finite. */
static inline void prepare_x_team(const float *x, int64_t m, int64_t k, xblock *xq, int nibbles, int *bad) {
    const int64_t blocks = k / 32;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < m * blocks; t++) {
        if (prepare_block(x + (t / blocks) * k + (t % blocks) * 32, xq + t, nibbles)) {
#pragma omp atomic write
            *bad = 1;
        }
    }
}
#endif
#endif
