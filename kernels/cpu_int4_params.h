/* INT4 group parameters as the native kernels read them (cpu_int4.c, cpu_int4_vnni.c): `mode` 0,
 * `s` scales and `o` offsets float32 [N, groups]; 1, both float16; 2, codes (kernels/int4_codes.py):
 * `s` uint8 [N, groups, 3], each group's 24 bits a 12-bit scale index (low) and a 12-bit offset
 * index (high) into `o`, a float16 table. Callers refuse modes 1 and 2 without F16C. */
#ifndef PAGODA_CPU_INT4_PARAMS_H
#define PAGODA_CPU_INT4_PARAMS_H
#include <stdint.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

static inline float from_half(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    (void)h;
    return 0.0f; /* unreachable: the entry points refuse float16 parameters without F16C */
#endif
}

/* row r's scales and offsets as float32 sc[g * stride] and of[g * stride], g < groups: decoded once per
 * row of W (stride 1: one row's arrays; 16: a column of a 16-row block's [groups][16]) */
static inline void int4_row_params(const void *s, const void *o, int mode, int64_t groups, int64_t r, float *sc,
                                   float *of, int64_t stride) {
    if (mode == 2) {
        const uint8_t *c = (const uint8_t *)s + r * groups * 3;
        const uint16_t *table = (const uint16_t *)o;
        int64_t g = 0;
        for (; g + 1 < groups; g++, c += 3) { /* four bytes at a time, the fourth the next group's */
            uint32_t code;
            memcpy(&code, c, 4);
            sc[g * stride] = from_half(table[code & 0xFFF]);
            of[g * stride] = from_half(table[(code >> 12) & 0xFFF]);
        }
        if (g < groups) {
            const uint32_t last = (uint32_t)c[0] | (uint32_t)c[1] << 8 | (uint32_t)c[2] << 16;
            sc[g * stride] = from_half(table[last & 0xFFF]);
            of[g * stride] = from_half(table[last >> 12]);
        }
    } else if (mode == 1) {
        const uint16_t *rs = (const uint16_t *)s + r * groups, *ro = (const uint16_t *)o + r * groups;
        for (int64_t g = 0; g < groups; g++) {
            sc[g * stride] = from_half(rs[g]);
            of[g * stride] = from_half(ro[g]);
        }
    } else {
        const float *rs = (const float *)s + r * groups, *ro = (const float *)o + r * groups;
        for (int64_t g = 0; g < groups; g++) {
            sc[g * stride] = rs[g];
            of[g * stride] = ro[g];
        }
    }
}
#endif
