/* One decoder layer's step in one call, for CPUs: the float32 path of a Llama-family layer over float32,
 * FP8 or int8 KV pages (cpu_attention.c) whose four projections are INT4 (the exact float32 kernel of
 * cpu_int4.c) or FP8 with per-output-channel scales (the fused kernel of cpu_fp8.c). Per call, for T
 * tokens, each with its own slot, position, block table row and context length:
 *
 *   h = rmsnorm(x) * w_in;  qkv = h @ Wqkv^T (+ bias);  (q, k = per-head rmsnorm);
 *   q, k = rope(q, k);  pages[slots] = k, v;
 *   a = paged_decode(q);  x += a @ Wo^T;  h = rmsnorm(x) * w_post;  gu = h @ Wgu^T;
 *   x += (silu(gate) * up) @ Wdown^T
 *
 * A decode step has one token per sequence. A prefill chunk gives each of its tokens its sequence's
 * table and its own position + 1 as the context length: every token's K and V are written before any
 * query reads, so each query sees exactly the keys at or before its position (causal attention).
 * The same sequence of float32 operations as the torch path (node_agent/models/llama.py), except
 * that the norms sum their squares in another order, SiLU takes cpu_math.h's exp and the attention
 * kernel sums in its own order (all within float32 rounding); an FP8 projection is the torch path's
 * own kernel and scale product, bit for bit. Replaces ~20 torch calls per layer. The caller
 * (kernels/cpu_decode_layer_native.py) validates shapes, page ids and slots before the call.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"

int pagoda_int4_vnni_gemm_f32(const float *x, int64_t m, int64_t k, const uint8_t *packed16, const void *scales,
                              const void *offsets, int mode, int64_t n, int64_t group, float *y, int threads);
int pagoda_int4_gemm_f32(const float *x, int64_t m, int64_t k, const uint8_t *packed, const void *scales,
                         const void *offsets, int mode, int64_t n, int64_t group, float *y, int threads);
int pagoda_write_kv(int64_t t, const int64_t *slots, int64_t num_slots, const float *k, int64_t k_stride,
                    int64_t hk, int64_t dk, void *k_cache, int k_mode, void *k_scale, const float *v,
                    int64_t v_stride, int64_t hv, int64_t dv, void *v_cache, int v_mode, void *v_scale);
int pagoda_fp8_gemm_f32(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *y);
int pagoda_paged_decode(const float *q, int64_t bsz, int64_t hq, int64_t d, const void *k_cache, int k_mode,
                        const void *k_scale, const void *v_cache, int v_mode, const void *v_scale,
                        int64_t num_pages, int64_t page_size, int64_t hkv, const int32_t *tables, int64_t cols,
                        const int32_t *lens, int64_t window, float scale, float *out, int threads);

typedef struct {
    const uint8_t *packed; /* INT4: [n, k / 2], or the 16-row layout of cpu_int4_vnni.c when interleaved;
                              FP8: the e4m3 codes [n, k] */
    const void *scales, *offsets; /* INT4: as pagoda_int4_gemm_f32 reads them in parameter mode `mode`;
                                     FP8: float32 scales [n], no offsets */
    int64_t mode, n, k, group, interleaved;
    int64_t fp8; /* 1: an FP8 weight (mode, group, interleaved unused) */
} pagoda_i4;

typedef struct {
    int64_t hidden, hq, hkv, d, inter;
    float eps;
    const float *in_norm, *post_norm; /* [hidden] */
    pagoda_i4 qkv, o, gate_up, down;
    /* this step's pages: [num_pages, page_size, hkv, d]; modes as cpu_attention.c */
    void *k_cache, *k_scale, *v_cache, *v_scale;
    int64_t k_mode, v_mode;
    const float *qkv_bias;       /* [(hq + 2 hkv) d] or NULL (Qwen2) */
    const float *q_norm, *k_norm; /* [d] each or NULL (Qwen3: RMSNorm of every q and k head) */
    int64_t window;               /* sliding window (keys per query), 0: none */
} pagoda_layer;

typedef struct {
    int64_t t;              /* tokens (= sequences) */
    const int64_t *slots;   /* [t] */
    int64_t num_slots;      /* num_pages * page_size */
    const float *cos, *sin; /* [t, d] */
    const int32_t *tables;  /* [t, cols] */
    int64_t cols;
    const int32_t *lens; /* [t] */
    int64_t num_pages, page_size;
    float scale;    /* softmax scale */
    float *scratch; /* at least pagoda_decode_scratch_floats(...) */
    int64_t threads;
} pagoda_step;

/* floats of scratch one call needs */
int64_t pagoda_decode_scratch_floats(int64_t t, int64_t hidden, int64_t hq, int64_t hkv, int64_t d, int64_t inter) {
    int64_t nqkv = (hq + 2 * hkv) * d;
    return t * (hidden + nqkv + hq * d + hkv * d + hq * d + 2 * inter + inter + hidden);
}

static void rms_norm(const float *x, const float *w, int64_t t, int64_t n, float eps, float *out) {
    for (int64_t i = 0; i < t; i++) {
        const float *r = x + i * n;
        float ss = 0.0f;
        int64_t j0 = 0;
#ifdef __AVX512F__
        __m512 acc = _mm512_setzero_ps();
        for (; j0 + 16 <= n; j0 += 16) {
            const __m512 v = _mm512_loadu_ps(r + j0);
            acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
        }
        ss = _mm512_reduce_add_ps(acc);
#endif
        for (int64_t j = j0; j < n; j++) ss += r[j] * r[j];
        const float rstd = 1.0f / sqrtf(ss / (float)n + eps);
        for (int64_t j = 0; j < n; j++) out[i * n + j] = (r[j] * rstd) * w[j];
    }
}

/* rotate-half RoPE of `heads` heads of `d` (rows `stride` floats apart) into dst [t, heads, d] */
static void rope(const float *src, int64_t stride, int64_t t, int64_t heads, int64_t d, const float *cos,
                 const float *sin, float *dst) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < t; i++) {
        const float *c = cos + i * d, *s = sin + i * d;
        for (int64_t h = 0; h < heads; h++) {
            const float *x = src + i * stride + h * d;
            float *y = dst + (i * heads + h) * d;
            for (int64_t j = 0; j < half; j++) {
                y[j] = x[j] * c[j] + (-x[j + half]) * s[j];
                y[j + half] = x[j + half] * c[j + half] + x[j] * s[j + half];
            }
        }
    }
}

/* out = silu(g) * u = g / (1 + e**-g) * u */
static void silu_mul(const float *g, const float *u, int64_t n, float *out) {
    int64_t j = 0;
#ifdef __AVX512F__
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; j + 16 <= n; j += 16) {
        const __m512 v = _mm512_loadu_ps(g + j);
        const __m512 e = pagoda_exp512(_mm512_sub_ps(_mm512_setzero_ps(), v));
        _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_div_ps(v, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + j)));
    }
#endif
    for (; j < n; j++) out[j] = (g[j] / (1.0f + expf(-g[j]))) * u[j];
}

/* FP8: the fused kernel, then each column times its scale (kernels/fp8.py's order). INT4: the VNNI
 * kernel for interleaved weights (code 6, NaN or inf in x, fails the layer: the caller then runs the
 * per-op path), else the float32 one */
static int gemm(const pagoda_i4 *w, const float *x, int64_t m, float *y, int threads) {
    if (w->fp8) {
        const int rc = pagoda_fp8_gemm_f32(x, m, w->k, w->packed, w->n, y);
        if (rc) return rc;
        const float *s = (const float *)w->scales;
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < w->n; j++) y[i * w->n + j] = y[i * w->n + j] * s[j];
        return 0;
    }
    if (w->interleaved)
        return pagoda_int4_vnni_gemm_f32(x, m, w->k, w->packed, w->scales, w->offsets, (int)w->mode, w->n, w->group,
                                         y, threads);
    return pagoda_int4_gemm_f32(x, m, w->k, w->packed, w->scales, w->offsets, (int)w->mode, w->n, w->group, y,
                                threads);
}

/* x [t, hidden] is updated in place. Returns 0, or the failing kernel's code (x is then undefined). */
int pagoda_decode_layer(const pagoda_layer *L, const pagoda_step *S, float *x) {
    const int64_t t = S->t, hid = L->hidden, d = L->d, hq = L->hq, hkv = L->hkv, inter = L->inter;
    const int64_t nqkv = (hq + 2 * hkv) * d;
    const int threads = (int)S->threads;
    float *h = S->scratch, *qkv = h + t * hid, *q = qkv + t * nqkv, *k = q + t * hq * d, *attn = k + t * hkv * d;
    float *gu = attn + t * hq * d, *act = gu + t * 2 * inter, *delta = act + t * inter;
    int rc;

    rms_norm(x, L->in_norm, t, hid, L->eps, h);
    if ((rc = gemm(&L->qkv, h, t, qkv, threads))) return 10 + rc;
    if (L->qkv_bias)
        for (int64_t i = 0; i < t; i++)
            for (int64_t j = 0; j < nqkv; j++) qkv[i * nqkv + j] = qkv[i * nqkv + j] + L->qkv_bias[j];
    if (L->q_norm && L->k_norm)
        for (int64_t i = 0; i < t; i++) {
            float *row = qkv + i * nqkv;
            rms_norm(row, L->q_norm, hq, d, L->eps, row); /* in place: each head's sum is taken first */
            rms_norm(row + hq * d, L->k_norm, hkv, d, L->eps, row + hq * d);
        }
    rope(qkv, nqkv, t, hq, d, S->cos, S->sin, q);
    rope(qkv + hq * d, nqkv, t, hkv, d, S->cos, S->sin, k);
    rc = pagoda_write_kv(t, S->slots, S->num_slots, k, hkv * d, hkv, d, L->k_cache, (int)L->k_mode, L->k_scale,
                         qkv + (hq + hkv) * d, nqkv, hkv, d, L->v_cache, (int)L->v_mode, L->v_scale);
    if (rc) return 20;
    rc = pagoda_paged_decode(q, t, hq, d, L->k_cache, (int)L->k_mode, L->k_scale, L->v_cache, (int)L->v_mode,
                             L->v_scale, S->num_pages, S->page_size, hkv, S->tables, S->cols, S->lens, L->window,
                             S->scale, attn, threads);
    if (rc) return 30;
    if ((rc = gemm(&L->o, attn, t, delta, threads))) return 40 + rc;
    for (int64_t i = 0; i < t * hid; i++) x[i] = x[i] + delta[i];
    rms_norm(x, L->post_norm, t, hid, L->eps, h);
    if ((rc = gemm(&L->gate_up, h, t, gu, threads))) return 50 + rc;
    for (int64_t i = 0; i < t; i++) silu_mul(gu + i * 2 * inter, gu + i * 2 * inter + inter, inter, act + i * inter);
    if ((rc = gemm(&L->down, act, t, delta, threads))) return 60 + rc;
    for (int64_t i = 0; i < t * hid; i++) x[i] = x[i] + delta[i];
    return 0;
}
