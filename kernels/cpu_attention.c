/* Paged KV writes and paged decode attention for CPUs, over float32, FP8 e4m3 (float8_e4m3fn) or
 * int8 pages.
 *
 * Layout (kernels/paged_attention.py): pages [num_pages, page_size, H, D]; FP8 scales either static
 * float32 [H] or per token bfloat16 [num_pages, page_size, H] beside the pages (raw uint16 bits here);
 * int8 pages always have per-token bfloat16 scales (kernels/int8_format.py).
 *
 * pagoda_write_kv is bit-exact with the torch path, with true float32 division (the file must not be
 * built with -ffast-math): FP8 per-token scales are bf16_rne(max(amax|x| / 448, 1e-12)), values
 * e4m3fn_rne(clamp(x / scale, -448, 448)); int8 scales are bf16_rne(max(amax|x| / 127, 1e-12)),
 * values clamp(round_half_even(x / scale), -127, 127) with NaN stored as 0 (NaN rows get a NaN
 * scale). pagoda_paged_decode runs one (sequence, KV head) pair per OpenMP iteration: the G query
 * heads of that KV head score every cached token, a max-subtracted float32 softmax, then the weighted
 * V sum. Rows load as float32 whatever their element kind: FP8 codes decode through float16 bits (the
 * e4m3 sign, exponent and mantissa placed so that the half reads code * 2**-8, subnormals included),
 * the 2**8 folded into the scales; int8 values convert exactly and their scale multiplies as is.
 * Built at run time by kernels/cpu_int4_native.py and called through kernels/cpu_attention_native.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define E4M3_MAX 448.0f
#define INT8_MAX_F 127.0f
#define SCALE_FLOOR 1e-12f
#define HALF_BIAS 256.0f /* decoded codes read value * 2**-8 */

enum { MODE_F32 = 0, MODE_FP8_STATIC = 1, MODE_FP8_TOKEN = 2, MODE_INT8_TOKEN = 3 };

/* what one cached element is: a float32, an e4m3 code or an int8 value */
typedef enum { ELEM_F32 = 0, ELEM_E4M3 = 1, ELEM_I8 = 2 } elem_kind;

static inline elem_kind mode_elem(int mode) {
    return mode == MODE_F32 ? ELEM_F32 : mode == MODE_INT8_TOKEN ? ELEM_I8 : ELEM_E4M3;
}

static inline uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 -> bfloat16 bits, round to nearest even; NaN -> 0xFFFF, as torch's vectorized CPU cast
 * (its scalar one gives 0x7FC0; both read as NaN). */
static inline uint16_t f32_to_bf16(float f) {
    if (isnan(f)) return 0xFFFF;
    uint32_t u = f2u(f);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* float32 already clamped to [-448, 448] (or NaN) -> e4m3fn bits, round to nearest even. */
static inline uint8_t f32_to_e4m3(float f) {
    uint32_t u = f2u(f);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7F;
    if (a >= 0x3C800000u) { /* >= 2**-6: normal; 23 -> 3 mantissa bits, exponent bias 127 -> 7 */
        uint32_t r = a + 0x7FFFFu + ((a >> 20) & 1u);
        return sign | (uint8_t)((r >> 20) - (120u << 3));
    }
    /* subnormal: multiples of 2**-9 (8 * 2**-9 is the smallest normal, code 0x08) */
    return sign | (uint8_t)lrintf(u2f(a) * 512.0f);
}

/* e4m3 code -> value * 2**-8 (the scalar twin of the vector decode below). */
static float e4m3_table[256];

__attribute__((constructor)) static void init_e4m3_table(void) {
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 15, m = c & 7;
        float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf((float)m, -9);
        if ((c & 0x7F) == 0x7F) v = NAN;
        e4m3_table[c] = ((c & 0x80) ? -v : v) / HALF_BIAS;
    }
}

/* ---------------------------------------------------------------------------------------- write */

/* One token's row of one head: x [D] -> dst (quantized with scale s, or copied). */
static void quantize_row(const float *x, int64_t d, float s, uint8_t *dst) {
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-E4M3_MAX), hi = _mm512_set1_ps(E4M3_MAX);
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), sign_mask = _mm512_set1_epi32((int)0x80000000u);
    for (; i + 16 <= d; i += 16) {
        /* max(lo, y) / min(hi, y) return y when y is NaN (the second operand), as torch's clamp */
        __m512 y = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_div_ps(_mm512_loadu_ps(x + i), vs)));
        __m512i u = _mm512_castps_si512(y);
        __m512i a = _mm512_and_si512(u, abs_mask);
        __m512i sign = _mm512_srli_epi32(_mm512_and_si512(u, sign_mask), 24);
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
        __m512i r = _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(0x7FFFF)), odd);
        __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(r, 20), _mm512_set1_epi32(120 << 3));
        __m512 sub_f = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(512.0f)),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i sub = _mm512_cvttps_epi32(sub_f);
        __mmask16 is_normal = _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(0x3C800000));
        __mmask16 is_nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000));
        __m512i code = _mm512_mask_blend_epi32(is_normal, sub, normal);
        code = _mm512_mask_blend_epi32(is_nan, code, _mm512_set1_epi32(0x7F));
        _mm_storeu_si128((__m128i *)(dst + i), _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign)));
    }
#endif
    for (; i < d; i++) {
        float y = x[i] / s;
        y = y < -E4M3_MAX ? -E4M3_MAX : (y > E4M3_MAX ? E4M3_MAX : y);
        dst[i] = f32_to_e4m3(y);
    }
}

/* Test hook: n float32 values -> e4m3fn bits of clamp(x, -448, 448), through the vector path of
 * quantize_row (scalar = 0; its scalar tail for the last n % 16) or the scalar converter alone. */
void pagoda_f32_to_e4m3(const float *x, int64_t n, uint8_t *out, int scalar) {
    if (!scalar) {
        quantize_row(x, n, 1.0f, out);
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        float v = x[i]; /* NaN compares false and stays NaN */
        out[i] = f32_to_e4m3(v < -E4M3_MAX ? -E4M3_MAX : (v > E4M3_MAX ? E4M3_MAX : v));
    }
}

/* float32 -> int8 as torch's round().clamp(-127, 127).nan_to_num(0): round half to even in the
 * default rounding mode; the clamp before lrintf keeps huge values in range (same result). */
static inline int8_t f32_to_i8(float y) {
    if (isnan(y)) return 0;
    y = y < -INT8_MAX_F ? -INT8_MAX_F : (y > INT8_MAX_F ? INT8_MAX_F : y);
    return (int8_t)lrintf(y);
}

/* One token's row of one head: x [D] -> int8 round(x / s) clamped to +-127, NaN -> 0. */
static void quantize_row_i8(const float *x, int64_t d, float s, int8_t *dst) {
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-INT8_MAX_F), hi = _mm512_set1_ps(INT8_MAX_F);
    for (; i + 16 <= d; i += 16) {
        __m512 y = _mm512_div_ps(_mm512_loadu_ps(x + i), vs);
        __mmask16 ord = _mm512_cmp_ps_mask(y, y, _CMP_ORD_Q); /* NaN lanes -> 0 below */
        y = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        y = _mm512_min_ps(hi, _mm512_max_ps(lo, y));
        _mm_storeu_si128((__m128i *)(dst + i), _mm512_cvtepi32_epi8(_mm512_maskz_cvtps_epi32(ord, y)));
    }
#endif
    for (; i < d; i++) dst[i] = f32_to_i8(x[i] / s);
}

/* Test hook: n float32 values -> int8 round(x / s) clamped to +-127 (NaN -> 0), through the vector
 * path of quantize_row_i8 (scalar = 0; its scalar tail for the last n % 16) or the scalar one alone. */
void pagoda_f32_to_int8(const float *x, int64_t n, float s, int8_t *out, int scalar) {
    if (!scalar) {
        quantize_row_i8(x, n, s, out);
        return;
    }
    for (int64_t i = 0; i < n; i++) out[i] = f32_to_i8(x[i] / s);
}

/* amax(|x|) over d values; NaN when any is NaN (as torch's amax). */
static float abs_max(const float *x, int64_t d) {
    float m = 0.0f;
    int nan = 0;
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 vm = _mm512_setzero_ps();
    for (; i + 16 <= d; i += 16) {
        __m512 v = _mm512_abs_ps(_mm512_loadu_ps(x + i));
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
        vm = _mm512_max_ps(vm, v);
    }
    m = _mm512_reduce_max_ps(vm);
#endif
    for (; i < d; i++) {
        float v = fabsf(x[i]);
        nan |= isnan(v);
        m = v > m ? v : m;
    }
    return nan ? NAN : m;
}

static void write_component(const float *x, int64_t x_stride, int64_t t, int64_t h, int64_t d,
                            const int64_t *slots, void *cache, int mode, void *scale) {
    for (int64_t ti = 0; ti < t; ti++) {
        int64_t slot = slots[ti];
        if (slot < 0) continue;
        for (int64_t hi = 0; hi < h; hi++) {
            const float *row = x + ti * x_stride + hi * d;
            int64_t at = (slot * h + hi) * d;
            if (mode == MODE_F32) {
                memcpy((float *)cache + at, row, (size_t)d * sizeof(float));
                continue;
            }
            float s;
            if (mode == MODE_FP8_TOKEN || mode == MODE_INT8_TOKEN) {
                float amax = abs_max(row, d) / (mode == MODE_INT8_TOKEN ? INT8_MAX_F : E4M3_MAX);
                uint16_t bits = f32_to_bf16(amax < SCALE_FLOOR ? SCALE_FLOOR : amax); /* NaN stays NaN */
                ((uint16_t *)scale)[slot * h + hi] = bits;
                s = u2f((uint32_t)bits << 16);
            } else {
                s = ((const float *)scale)[hi];
            }
            if (mode == MODE_INT8_TOKEN)
                quantize_row_i8(row, d, s, (int8_t *)cache + at);
            else
                quantize_row(row, d, s, (uint8_t *)cache + at);
        }
    }
}

/* Writes K and V of t tokens (rows x_stride floats apart, [H, D] contiguous within) at their slots;
 * negative slots are skipped. Returns 0, or -1 (nothing written) when a slot is >= num_slots. */
int pagoda_write_kv(int64_t t, const int64_t *slots, int64_t num_slots, const float *k, int64_t k_stride,
                    int64_t hk, int64_t dk, void *k_cache, int k_mode, void *k_scale, const float *v,
                    int64_t v_stride, int64_t hv, int64_t dv, void *v_cache, int v_mode, void *v_scale) {
    for (int64_t i = 0; i < t; i++)
        if (slots[i] >= num_slots) return -1;
    write_component(k, k_stride, t, hk, dk, slots, k_cache, k_mode, k_scale);
    write_component(v, v_stride, t, hv, dv, slots, v_cache, v_mode, v_scale);
    return 0;
}

/* --------------------------------------------------------------------------------------- decode */

/* One cached row (d elements of one kind) -> float32 dst, zero-padded to dp (a multiple of 16).
 * FP8 rows read code * 2**-8, int8 rows their values. */
static inline void load_row(const void *src, elem_kind kind, int64_t d, int64_t dp, float *dst) {
    int64_t i = 0;
#ifdef __AVX512F__
    if (kind == ELEM_I8) {
        const int8_t *p = (const int8_t *)src;
        for (; i + 16 <= d; i += 16) {
            __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + i)));
            _mm512_storeu_ps(dst + i, _mm512_cvtepi32_ps(v));
        }
    } else if (kind == ELEM_E4M3) {
        const uint8_t *p = (const uint8_t *)src;
        for (; i + 16 <= d; i += 16) {
            /* e4m3 s.eeee.mmm -> half s.0eeee.mmm0000000: reads code * 2**-8, subnormals too */
            __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + i)));
            __m256i h = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(c, 8), _mm256_set1_epi16((short)0x8000)),
                                        _mm256_and_si256(_mm256_slli_epi16(c, 7), _mm256_set1_epi16(0x3F80)));
            _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(h));
        }
    } else {
        const float *p = (const float *)src;
        for (; i + 16 <= d; i += 16) _mm512_storeu_ps(dst + i, _mm512_loadu_ps(p + i));
    }
#endif
    if (kind == ELEM_I8)
        for (; i < d; i++) dst[i] = (float)((const int8_t *)src)[i];
    else if (kind == ELEM_E4M3)
        for (; i < d; i++) dst[i] = e4m3_table[((const uint8_t *)src)[i]];
    else
        for (; i < d; i++) dst[i] = ((const float *)src)[i];
    for (; i < dp; i++) dst[i] = 0.0f;
}

static inline float dot(const float *a, const float *b, int64_t dp) {
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < dp; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
#else
    float acc = 0.0f;
    for (int64_t i = 0; i < dp; i++) acc += a[i] * b[i];
    return acc;
#endif
}

static inline void axpy(float w, const float *x, float *y, int64_t dp) {
#ifdef __AVX512F__
    const __m512 vw = _mm512_set1_ps(w);
    for (int64_t i = 0; i < dp; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(vw, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#else
    for (int64_t i = 0; i < dp; i++) y[i] += w * x[i];
#endif
}

#ifdef __AVX512F__
/* e**x for x <= 0 (scores minus their max): the shared vector exp of cpu_math.h */
static inline __m512 exp_neg(__m512 x) { return pagoda_exp512(x); }
#endif

/* s[0..n) <- softmax(s), max-subtracted, in float32 (n >= 1). */
static void softmax(float *s, int64_t n) {
    float m = s[0], sum = 0.0f;
    int64_t j = 0;
#ifdef __AVX512F__
    __m512 vm = _mm512_set1_ps(s[0]);
    for (; j + 16 <= n; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + j));
    m = _mm512_reduce_max_ps(vm);
#endif
    for (; j < n; j++) m = s[j] > m ? s[j] : m;
    j = 0;
#ifdef __AVX512F__
    const __m512 vmax = _mm512_set1_ps(m);
    __m512 vsum = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) {
        __m512 e = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(s + j), vmax));
        _mm512_storeu_ps(s + j, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    if (j < n) {
        __mmask16 tail = (__mmask16)((1u << (n - j)) - 1);
        __m512 e = exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), vmax));
        _mm512_mask_storeu_ps(s + j, tail, e);
        vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(tail, e));
        j = n;
    }
    sum = _mm512_reduce_add_ps(vsum);
#endif
    for (; j < n; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    const float inv = 1.0f / sum;
    for (j = 0; j < n; j++) s[j] *= inv;
}

static inline float bf16_to_f32(uint16_t b) { return u2f((uint32_t)b << 16); }

typedef struct {
    const void *cache;
    int mode;
    const void *scale; /* float32 [H] (static) or bf16 bits [num_pages, page_size, H] (per token) */
} kv_part;

/* the factor of token slot `slot` of head h: its scale (FP8: times the 2**8 of the half decode) or 1 */
static inline float row_scale(const kv_part *p, int64_t slot, int64_t hkv, int64_t h) {
    if (p->mode == MODE_F32) return 1.0f;
    if (p->mode == MODE_INT8_TOKEN) return bf16_to_f32(((const uint16_t *)p->scale)[slot * hkv + h]);
    float s = p->mode == MODE_FP8_TOKEN ? bf16_to_f32(((const uint16_t *)p->scale)[slot * hkv + h])
                                        : ((const float *)p->scale)[h];
    return s * HALF_BIAS;
}

/* One (sequence, KV head) pair over its keys start..len-1 (start > 0: a sliding window), row by row
 * through buffers: the path of CPUs without AVX-512 BW/VL (and of empty sequences). Buffers:
 * qs [g * dp], row [dp], acc [g * dp], scores [g * (len - start)]. */
static void decode_pair(const float *q, int64_t hq, int64_t d, int64_t dp, const kv_part *kp, const kv_part *vp,
                        int64_t page_size, int64_t hkv, const int32_t *table, int64_t start, int64_t len,
                        float scale, int64_t b, int64_t h, float *out, float *buf) {
    const int64_t g = hq / hkv;
    float *qs = buf, *row = qs + g * dp, *acc = row + dp, *scores = acc + g * dp;
    float *o = out + (b * hq + h * g) * d;
    if (len == 0) {
        memset(o, 0, (size_t)(g * d) * sizeof(float));
        return;
    }
    table += start / page_size; /* key j sits at j + off of the shifted table */
    const int64_t off = start % page_size, n = len - start;
    const elem_kind fk = mode_elem(kp->mode), fv = mode_elem(vp->mode);
    const size_t ek = fk == ELEM_F32 ? 4 : 1, ev = fv == ELEM_F32 ? 4 : 1;
    for (int64_t gi = 0; gi < g; gi++) {
        const float *qr = q + (b * hq + h * g + gi) * d;
        for (int64_t i = 0; i < dp; i++) qs[gi * dp + i] = i < d ? qr[i] * scale : 0.0f;
    }
    /* scores[gi * n + j] = (q_gi . k_j) * scale * k_scale_j */
    for (int64_t j = 0; j < n; j++) {
        int64_t slot = (int64_t)table[(j + off) / page_size] * page_size + (j + off) % page_size;
        load_row((const char *)kp->cache + ((slot * hkv + h) * d) * ek, fk, d, dp, row);
        float ks = row_scale(kp, slot, hkv, h);
        for (int64_t gi = 0; gi < g; gi++) scores[gi * n + j] = dot(qs + gi * dp, row, dp) * ks;
    }
    for (int64_t gi = 0; gi < g; gi++) softmax(scores + gi * n, n);
    memset(acc, 0, (size_t)(g * dp) * sizeof(float));
    for (int64_t j = 0; j < n; j++) {
        int64_t slot = (int64_t)table[(j + off) / page_size] * page_size + (j + off) % page_size;
        load_row((const char *)vp->cache + ((slot * hkv + h) * d) * ev, fv, d, dp, row);
        float vs = row_scale(vp, slot, hkv, h);
        for (int64_t gi = 0; gi < g; gi++) axpy(scores[gi * n + j] * vs, row, acc + gi * dp, dp);
    }
    for (int64_t gi = 0; gi < g; gi++) memcpy(o + gi * d, acc + gi * dp, (size_t)d * sizeof(float));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FAST_DECODE 1
/* 16 e4m3 codes (lanes outside m read as 0) -> value * 2**-8: the half s.0eeee.mmm0000000 */
static inline __m512 fp8x16(const uint8_t *p, __mmask16 m) {
    __m256i c = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, p)), 7); /* sign at bit 14 */
    c = _mm256_add_epi16(c, _mm256_and_si256(c, _mm256_set1_epi16(0x4000)));         /* moved to bit 15 */
    return _mm512_cvtph_ps(c);
}

/* 16 elements of a row at element offset `at` (lanes outside m read as 0) -> float32; FP8 as fp8x16 */
static inline __m512 row_chunk(const void *base, elem_kind kind, int64_t at, __mmask16 m) {
    if (kind == ELEM_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, (const int8_t *)base + at)));
    return kind == ELEM_E4M3 ? fp8x16((const uint8_t *)base + at, m)
                             : _mm512_maskz_loadu_ps(m, (const float *)base + at);
}

/* lane t of the result = the sum of the 16 lanes of v[t] */
static inline __m512 hsum16(const __m512 *v) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* One (sequence, KV head) pair with AVX-512: query heads in blocks of 4, K rows decoded chunk by chunk
 * straight into registers and scored 16 tokens at a time (one transposing reduction per 16), then V
 * accumulated in registers 4 heads x 64 dims at a time; keys start..len-1 as decode_pair. Buffers:
 * qs [gp * dp], scores [gp * lp], ksc, vsc [lp], rows [lp] (gp = g rounded up to 4, lp = len - start
 * rounded up to 16). */
static void decode_pair_fast(const float *q, int64_t hq, int64_t d, int64_t dp, const kv_part *kp,
                             const kv_part *vp, int64_t page_size, int64_t hkv, const int32_t *table,
                             int64_t start, int64_t len, float scale, int64_t b, int64_t h, float *out, float *buf) {
    table += start / page_size;
    const int64_t off = start % page_size;
    len -= start; /* from here on: the n = len - start keys of the window, key j at j + off */
    const int64_t g = hq / hkv, gp = (g + 3) / 4 * 4, lp = (len + 15) / 16 * 16, nc = dp / 16;
    float *qs = buf, *scores = qs + gp * dp, *ksc = scores + gp * lp, *vsc = ksc + lp;
    int64_t *rows = (int64_t *)(vsc + lp);
    float *o = out + (b * hq + h * g) * d;
    const elem_kind fk = mode_elem(kp->mode), fv = mode_elem(vp->mode);
    for (int64_t gi = 0; gi < gp; gi++) {
        const float *qr = q + (b * hq + h * g + gi) * d;
        for (int64_t i = 0; i < dp; i++) qs[gi * dp + i] = gi < g && i < d ? qr[i] * scale : 0.0f;
    }
    for (int64_t j = 0; j < len; j++) {
        int64_t slot = (int64_t)table[(j + off) / page_size] * page_size + (j + off) % page_size;
        rows[j] = (slot * hkv + h) * d;
        ksc[j] = row_scale(kp, slot, hkv, h);
        vsc[j] = row_scale(vp, slot, hkv, h);
    }
    for (int64_t j = len; j < lp; j++) ksc[j] = vsc[j] = 0.0f;
    for (int64_t gb = 0; gb < g; gb += 4) {
        for (int64_t j0 = 0; j0 < len; j0 += 16) {
            __m512 part[4][16];
            for (int t = 0; t < 16; t++) {
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                if (j0 + t < len) {
                    const int64_t at = rows[j0 + t];
                    for (int64_t c = 0; c < nc; c++) {
                        const int64_t left = d - 16 * c;
                        const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
                        const __m512 kv = row_chunk(kp->cache, fk, at + 16 * c, m);
                        const float *qc = qs + gb * dp + 16 * c;
                        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qc), kv, a0);
                        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qc + dp), kv, a1);
                        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(qc + 2 * dp), kv, a2);
                        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(qc + 3 * dp), kv, a3);
                    }
                }
                part[0][t] = a0, part[1][t] = a1, part[2][t] = a2, part[3][t] = a3;
            }
            const __m512 ks = _mm512_loadu_ps(ksc + j0);
            for (int i = 0; i < 4; i++)
                _mm512_storeu_ps(scores + (gb + i) * lp + j0, _mm512_mul_ps(hsum16(part[i]), ks));
        }
    }
    for (int64_t gi = 0; gi < gp; gi++) {
        float *s = scores + gi * lp;
        if (gi < g) softmax(s, len);
        for (int64_t j = 0; j < lp; j += 16) /* V's scales (0 past len and for padding heads) */
            _mm512_storeu_ps(s + j, gi < g ? _mm512_mul_ps(_mm512_loadu_ps(s + j), _mm512_loadu_ps(vsc + j))
                                           : _mm512_setzero_ps());
    }
    for (int64_t gb = 0; gb < g; gb += 4) {
        const float *w = scores + gb * lp;
        for (int64_t c0 = 0; c0 < nc; c0 += 4) {
            __m512 acc[4][4];
            __mmask16 m[4];
            for (int c = 0; c < 4; c++) {
                const int64_t left = d - 16 * (c0 + c);
                m[c] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
                for (int i = 0; i < 4; i++) acc[i][c] = _mm512_setzero_ps();
            }
            for (int64_t j = 0; j < len; j++) {
                const int64_t at = rows[j] + 16 * c0;
                const __m512 w0 = _mm512_set1_ps(w[j]), w1 = _mm512_set1_ps(w[lp + j]);
                const __m512 w2 = _mm512_set1_ps(w[2 * lp + j]), w3 = _mm512_set1_ps(w[3 * lp + j]);
                for (int c = 0; c < 4; c++) {
                    const __m512 vv = row_chunk(vp->cache, fv, at + 16 * c, m[c]);
                    acc[0][c] = _mm512_fmadd_ps(w0, vv, acc[0][c]);
                    acc[1][c] = _mm512_fmadd_ps(w1, vv, acc[1][c]);
                    acc[2][c] = _mm512_fmadd_ps(w2, vv, acc[2][c]);
                    acc[3][c] = _mm512_fmadd_ps(w3, vv, acc[3][c]);
                }
            }
            for (int i = 0; i < 4 && gb + i < g; i++)
                for (int c = 0; c < 4; c++)
                    _mm512_mask_storeu_ps(o + (gb + i) * d + 16 * (c0 + c), m[c], acc[i][c]);
        }
    }
}
#endif

/* The first key a decode query at position len - 1 sees: len - window with a sliding window
 * (window > 0), else 0. */
static inline int64_t window_start(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* out [B, Hq, D] float32 = decode attention of q [B, Hq, D] over the pages of each sequence.
 * tables [B, cols] int32, lens [B] int32; window > 0: each query sees only its last `window` keys
 * (the pages before them are never read, nor their ids checked). Before reading any page, checks
 * every length (0 <= len <= cols * page_size) and every page id it reads (0 <= id < num_pages):
 * returns -(b + 1) for the first sequence b that fails (nothing computed), -(B + 1) when scratch
 * memory runs out, else 0. */
int pagoda_paged_decode(const float *q, int64_t bsz, int64_t hq, int64_t d, const void *k_cache, int k_mode,
                        const void *k_scale, const void *v_cache, int v_mode, const void *v_scale,
                        int64_t num_pages, int64_t page_size, int64_t hkv, const int32_t *tables, int64_t cols,
                        const int32_t *lens, int64_t window, float scale, float *out, int threads) {
    int64_t max_len = 0;
    for (int64_t b = 0; b < bsz; b++) {
        int64_t len = lens[b];
        if (len < 0 || len > cols * page_size) return (int)-(b + 1);
        int64_t start = window_start(len, window);
        for (int64_t p = start / page_size; p < (len + page_size - 1) / page_size; p++) {
            int32_t id = tables[b * cols + p];
            if (id < 0 || id >= num_pages) return (int)-(b + 1);
        }
        max_len = len - start > max_len ? len - start : max_len;
    }
    const kv_part kp = {k_cache, k_mode, k_scale}, vp = {v_cache, v_mode, v_scale};
    const int64_t g = hq / hkv, dp = (d + 15) / 16 * 16, pairs = bsz * hkv;
    /* scratch of either pair function: the fast one's (padded) buffers cover the scalar one's */
    const int64_t gp = (g + 3) / 4 * 4, lp = (max_len + 15) / 16 * 16 + 16;
    const size_t need = (size_t)(2 * gp * dp + dp + gp * lp + 2 * lp) * sizeof(float) + (size_t)lp * sizeof(int64_t);
    int failed = 0;
    if (threads < 1) threads = 1;
    if (threads > pairs) threads = (int)(pairs > 0 ? pairs : 1);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *buf = (float *)aligned_alloc(64, (need + 63) / 64 * 64);
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < pairs; i++) {
            if (buf == NULL) continue;
            int64_t b = i / hkv, h = i % hkv, start = window_start(lens[b], window);
#ifdef FAST_DECODE
            if (lens[b] > 0) {
                decode_pair_fast(q, hq, d, dp, &kp, &vp, page_size, hkv, tables + b * cols, start, lens[b], scale, b,
                                 h, out, buf);
                continue;
            }
#endif
            decode_pair(q, hq, d, dp, &kp, &vp, page_size, hkv, tables + b * cols, start, lens[b], scale, b, h, out,
                        buf);
        }
        free(buf);
    }
    return failed ? (int)-(bsz + 1) : 0;
}
