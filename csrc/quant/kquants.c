/* K-quant quantizers (Q2_K .. Q6_K): the CPU kernel behind hanzo_torch.formats.kquant_search.
 *
 * The same algorithms as the torch version there (ggml's reference scale searches, facts from
 * ggml-quants.c), one super-block at a time, float32 sums accumulated value by value. Built with
 * -ffp-contract=off and without -ffast-math, so every float32 operation rounds once, as in the
 * torch version with EMULATE_FMA False and in libggml-base as ggml's CMake build compiles it.
 * Block layouts: ggml-common.h (block_q2_K .. block_q6_K).
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#define QK 256
#define EPS 1e-15f

/* nearest integer, ties to even (ggml's nearest_int): adding 1.5 * 2^23 leaves the rounded
 * integer in the low mantissa bits for |v| < 2^22; an inline add, where rintf is a libm call
 * on baseline x86-64 */
static inline int rnd(float v) {
    if (!(fabsf(v) < 4194304.f)) return (int)rintf(v);
    float t = v + 12582912.f;
    int32_t i;
    memcpy(&i, &t, 4);
    return (i & 0x007fffff) - 0x00400000;
}
static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

static uint16_t to_half(float f) {
    /* IEEE float32 -> fp16, round to nearest even (finite inputs; overflow gives inf) */
    uint32_t u; memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
    if (a < 0x38800000u) { /* fp16 subnormal or zero: exact add of 0.5 shifts the bits into place */
        float t; memcpy(&t, &a, 4);
        t += 0.5f;
        uint32_t tb; memcpy(&tb, &t, 4);
        return (uint16_t)(sign | (tb - 0x3f000000u));
    }
    uint32_t mant_odd = (a >> 13) & 1u;
    a += 0xc8000fffu + mant_odd; /* rebias the exponent (-112 << 23) and round half to even */
    return (uint16_t)(sign | (a >> 13));
}

static float from_half(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu, u;
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-08f; /* 2^-24 */
        return sign ? -v : v;
    }
    if (e == 31) u = sign | 0x7f800000u | (m << 13);
    else u = sign | ((e + 112) << 23) | (m << 13);
    float f; memcpy(&f, &u, 4);
    return f;
}

static inline void put_half(uint8_t *p, float f) { uint16_t h = to_half(f); p[0] = h & 0xff; p[1] = h >> 8; }
static inline float half_round(float f) { return from_half(to_half(f)); }

/* ggml's make_qkx2_quants; returns the scale, *the_min = -min, L in [0, nmax] */
static float qkx2(int n, int nmax, const float *x, const float *w, uint8_t *L, float *the_min,
                  float rmin, float rdelta, int nstep, int use_mad) {
    uint8_t La[32];
    float mn = x[0], mx = x[0], sum_w = w[0], sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        if (x[i] < mn) mn = x[i];
        if (x[i] > mx) mx = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (mn > 0) mn = 0;
    if (mx == mn) {
        memset(L, 0, (size_t)n);
        *the_min = -mn;
        return 0.f;
    }
    float iscale = nmax / (mx - mn), scale = 1 / iscale, best = 0;
    for (int i = 0; i < n; ++i) {
        L[i] = (uint8_t)clampi(rnd(iscale * (x[i] - mn)), 0, nmax);
        float diff = scale * L[i] + mn - x[i];
        diff = use_mad ? fabsf(diff) : diff * diff;
        best += w[i] * diff;
    }
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta * is + nmax) / (mx - mn);
        float sl = 0, sl2 = 0, sxl = 0;
        for (int i = 0; i < n; ++i) {
            int l = clampi(rnd(iscale * (x[i] - mn)), 0, nmax);
            La[i] = (uint8_t)l;
            float wl = w[i] * l;
            sl += wl;
            sl2 += wl * l;
            sxl += wl * x[i];
        }
        float D = sum_w * sl2 - sl * sl;
        if (D > 0) {
            float s = (sum_w * sxl - sum_x * sl) / D, m = (sl2 * sum_x - sl * sxl) / D;
            if (m > 0) { m = 0; s = sxl / sl2; }
            float err = 0;
            for (int i = 0; i < n; ++i) {
                float diff = s * La[i] + m - x[i];
                diff = use_mad ? fabsf(diff) : diff * diff;
                err += w[i] * diff;
            }
            if (err < best) { memcpy(L, La, (size_t)n); best = err; scale = s; mn = m; }
        }
    }
    *the_min = -mn;
    return scale;
}


/* make_qkx2_quants / make_qkx3_quants (the same float32 operations when use_mad is 0) for the
 * eight 32-value sub-blocks of a super-block at once, one sub-block per AVX2 lane: each lane
 * runs the scalar order of operations exactly (no FMA, IEEE div/sqrt, round-to-nearest-even
 * conversion), so the bytes equal the scalar path's. x, w: 256 floats (sub-block j at 32 * j);
 * writes L[256], scale[8], the_min[8]. */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HZ_HAVE_AVX2_PATH 1
__attribute__((target("avx2")))
static void qkx_avx2(const float *x, const float *w, uint8_t *L, float *scale_out, float *min_out,
                     int nmax, float rmin, float rdelta, int nstep) {
    __m256 X[32], W[32];
    __m256i BL[32];
    const __m256i idx = _mm256_setr_epi32(0, 32, 64, 96, 128, 160, 192, 224);
    for (int i = 0; i < 32; ++i) {
        X[i] = _mm256_i32gather_ps(x + i, idx, 4);
        W[i] = _mm256_i32gather_ps(w + i, idx, 4);
    }
    const __m256 zero = _mm256_setzero_ps();
    const __m256i izero = _mm256_setzero_si256(), inmax = _mm256_set1_epi32(nmax);
    __m256 mn = X[0], mx = X[0], sum_w = W[0], sum_x = _mm256_mul_ps(W[0], X[0]);
    for (int i = 1; i < 32; ++i) {
        mn = _mm256_min_ps(X[i], mn);  /* x < mn ? x : mn */
        mx = _mm256_max_ps(X[i], mx);  /* x > mx ? x : mx */
        sum_w = _mm256_add_ps(sum_w, W[i]);
        sum_x = _mm256_add_ps(sum_x, _mm256_mul_ps(W[i], X[i]));
    }
    mn = _mm256_blendv_ps(mn, zero, _mm256_cmp_ps(mn, zero, _CMP_GT_OQ));
    const __m256 mn0 = mn, flat = _mm256_cmp_ps(mx, mn, _CMP_LE_OQ);
    __m256 iscale = _mm256_div_ps(_mm256_set1_ps((float)nmax), _mm256_sub_ps(mx, mn));
    __m256 scale = _mm256_div_ps(_mm256_set1_ps(1.f), iscale), best = zero;
    for (int i = 0; i < 32; ++i) {
        __m256i l = _mm256_cvtps_epi32(_mm256_mul_ps(iscale, _mm256_sub_ps(X[i], mn)));
        l = _mm256_min_epi32(_mm256_max_epi32(l, izero), inmax);
        BL[i] = l;
        __m256 d = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(scale, _mm256_cvtepi32_ps(l)), mn), X[i]);
        best = _mm256_add_ps(best, _mm256_mul_ps(W[i], _mm256_mul_ps(d, d)));
    }
    for (int is = 0; is <= nstep; ++is) {
        iscale = _mm256_div_ps(_mm256_set1_ps(rmin + rdelta * is + nmax), _mm256_sub_ps(mx, mn));
        __m256 sl = zero, sl2 = zero, sxl = zero;
        __m256i La[32];
        for (int i = 0; i < 32; ++i) {
            __m256i l = _mm256_cvtps_epi32(_mm256_mul_ps(iscale, _mm256_sub_ps(X[i], mn)));
            l = _mm256_min_epi32(_mm256_max_epi32(l, izero), inmax);
            La[i] = l;
            __m256 fl = _mm256_cvtepi32_ps(l), wl = _mm256_mul_ps(W[i], fl);
            sl = _mm256_add_ps(sl, wl);
            sl2 = _mm256_add_ps(sl2, _mm256_mul_ps(wl, fl));
            sxl = _mm256_add_ps(sxl, _mm256_mul_ps(wl, X[i]));
        }
        __m256 D = _mm256_sub_ps(_mm256_mul_ps(sum_w, sl2), _mm256_mul_ps(sl, sl));
        __m256 ok = _mm256_cmp_ps(D, zero, _CMP_GT_OQ);
        if (!_mm256_movemask_ps(ok)) continue;
        __m256 s = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(sum_w, sxl), _mm256_mul_ps(sum_x, sl)), D);
        __m256 m = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(sl2, sum_x), _mm256_mul_ps(sl, sxl)), D);
        __m256 mpos = _mm256_cmp_ps(m, zero, _CMP_GT_OQ);
        m = _mm256_blendv_ps(m, zero, mpos);
        s = _mm256_blendv_ps(s, _mm256_div_ps(sxl, sl2), mpos);
        __m256 err = zero;
        for (int i = 0; i < 32; ++i) {
            __m256 d = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(s, _mm256_cvtepi32_ps(La[i])), m), X[i]);
            err = _mm256_add_ps(err, _mm256_mul_ps(W[i], _mm256_mul_ps(d, d)));
        }
        __m256 upd = _mm256_and_ps(ok, _mm256_cmp_ps(err, best, _CMP_LT_OQ));
        if (!_mm256_movemask_ps(upd)) continue;
        __m256i updi = _mm256_castps_si256(upd);
        for (int i = 0; i < 32; ++i) BL[i] = _mm256_blendv_epi8(BL[i], La[i], updi);
        best = _mm256_blendv_ps(best, err, upd);
        scale = _mm256_blendv_ps(scale, s, upd);
        mn = _mm256_blendv_ps(mn, m, upd);
    }
    __m256i flati = _mm256_castps_si256(flat);
    scale = _mm256_blendv_ps(scale, zero, flat);
    mn = _mm256_blendv_ps(mn, mn0, flat);
    __m256 neg = _mm256_xor_ps(mn, _mm256_set1_ps(-0.f));
    _mm256_storeu_ps(scale_out, scale);
    _mm256_storeu_ps(min_out, neg);
    int32_t lanes[8];
    for (int i = 0; i < 32; ++i) {
        _mm256_storeu_si256((__m256i *)lanes, _mm256_blendv_epi8(BL[i], izero, flati));
        for (int j = 0; j < 8; ++j) L[32 * j + i] = (uint8_t)lanes[j];
    }
}
#endif

/* 1 when the AVX2 sub-block search runs (the CPU has AVX2 and hz_quant_set_simd(0) was not called) */
static int simd_on = -1;
static int use_simd(void) {
#ifdef HZ_HAVE_AVX2_PATH
    if (simd_on < 0) simd_on = __builtin_cpu_supports("avx2") ? 1 : 0;
    return simd_on;
#else
    return 0;
#endif
}

/* Turn the AVX2 path off (0) or back on where the CPU has it (1); returns whether it is on. */
int hz_quant_set_simd(int on) {
    simd_on = -1;
    if (!on) { simd_on = 0; return 0; }
    return use_simd();
}

static void absmax(int n, const float *x, float *amax, float *max) {
    *amax = 0; *max = 0;
    for (int i = 0; i < n; ++i) {
        float a = fabsf(x[i]);
        if (a > *amax) { *amax = a; *max = x[i]; }
    }
}

/* ggml's make_qx_quants with rmse_type 1: weights qw, or x^2 where qw is NULL; L in [0, 2 nmax - 1] */
static float qx_rmse1(int n, int nmax, const float *x, int8_t *L, const float *qw) {
    float amax, mx;
    absmax(n, x, &amax, &mx);
    if (amax < EPS) { memset(L, 0, (size_t)n); return 0.f; }
    float iscale = -nmax / mx, sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = clampi(rnd(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)(l + nmax);
        float w = qw ? qw[i] : x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 != 0 ? sumlx / suml2 : 0.f, best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / mx;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; ++i) {
            int l = clampi(rnd(iscale * x[i]), -nmax, nmax - 1);
            float w = qw ? qw[i] : x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; ++i) L[i] = (int8_t)(nmax + clampi(rnd(iscale * x[i]), -nmax, nmax - 1));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* ggml's make_q3_quants with do_rmse: L in [0, 2 nmax - 1] */
static float q3_rmse(int n, int nmax, const float *x, int8_t *L) {
    float amax, mx;
    absmax(n, x, &amax, &mx);
    if (amax < EPS) { memset(L, 0, (size_t)n); return 0.f; }
    float iscale = -nmax / mx, sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = clampi(rnd(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)l;
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    for (int it = 0; it < 5; ++it) {
        int changed = 0;
        for (int i = 0; i < n; ++i) {
            float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * L[i];
            if (slx > 0) {
                float sl2 = suml2 - w * L[i] * L[i];
                int nl = clampi(rnd(x[i] * sl2 / slx), -nmax, nmax - 1);
                if (nl != L[i]) {
                    slx += w * x[i] * nl;
                    sl2 += w * nl * nl;
                    if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (int8_t)nl; sumlx = slx; suml2 = sl2; ++changed;
                    }
                }
            }
        }
        if (!changed) break;
    }
    for (int i = 0; i < n; ++i) L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0 ? sumlx / suml2 : 0.f;
}

/* 2-bit codes L[256] into 64 bytes: per 128 values, 4 bit planes of 32 bytes */
static void pack2(const uint8_t *L, uint8_t *qs) {
    for (int j = 0; j < QK; j += 128)
        for (int l = 0; l < 32; ++l)
            qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
}

static void q2_k_block(const float *x, uint8_t *y) {
    uint8_t L[QK];
    float w[16], sc[16], mn[16], max_s = 0, max_m = 0;
    for (int j = 0; j < 16; ++j) {
        for (int l = 0; l < 16; ++l) w[l] = fabsf(x[16 * j + l]);
        sc[j] = qkx2(16, 3, x + 16 * j, w, L + 16 * j, &mn[j], -0.5f, 0.1f, 15, 1);
        if (sc[j] > max_s) max_s = sc[j];
        if (mn[j] > max_m) max_m = mn[j];
    }
    uint8_t *scales = y, *qs = y + 16;
    float d = 0, dm = 0;
    if (max_s > 0) {
        float is = 15.f / max_s;
        for (int j = 0; j < 16; ++j) scales[j] = (uint8_t)rnd(is * sc[j]);
        d = max_s / 15.f;
    } else memset(scales, 0, 16);
    if (max_m > 0) {
        float im = 15.f / max_m;
        for (int j = 0; j < 16; ++j) scales[j] |= (uint8_t)(rnd(im * mn[j]) << 4);
        dm = max_m / 15.f;
    }
    put_half(y + 80, d);
    put_half(y + 82, dm);
    float dq = half_round(d), dmq = half_round(dm);
    for (int j = 0; j < 16; ++j) {
        float dj = dq * (scales[j] & 0xf);
        if (!dj) continue;
        float mj = dmq * (scales[j] >> 4);
        for (int i = 0; i < 16; ++i) L[16 * j + i] = (uint8_t)clampi(rnd((x[16 * j + i] + mj) / dj), 0, 3);
    }
    pack2(L, qs);
}

static void q3_k_block(const float *x, uint8_t *y) {
    int8_t L[QK];
    float sc[16], amax = 0, max_s = 0;
    for (int j = 0; j < 16; ++j) {
        sc[j] = q3_rmse(16, 4, x + 16 * j, L + 16 * j);
        float a = fabsf(sc[j]);
        if (a > amax) { amax = a; max_s = sc[j]; }
    }
    uint8_t *hmask = y, *qs = y + 32, *scales = y + 96;
    memset(scales, 0, 12);
    float d = 0;
    if (max_s != 0) {
        float is = -32.f / max_s;
        for (int j = 0; j < 16; ++j) {
            int l = clampi((int8_t)rnd(is * sc[j]), -32, 31) + 32;
            if (j < 8) scales[j] = (uint8_t)(l & 0xf);
            else scales[j - 8] |= (uint8_t)((l & 0xf) << 4);
            scales[j % 4 + 8] |= (uint8_t)((l >> 4) << (2 * (j / 4)));
        }
        d = 1 / is;
    }
    put_half(y + 108, d);
    float dq = half_round(d);
    for (int j = 0; j < 16; ++j) {
        int s = j < 8 ? scales[j] & 0xf : scales[j - 8] >> 4;
        s = (s | (((scales[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
        float dj = dq * s;
        if (!dj) continue;
        for (int i = 0; i < 16; ++i) L[16 * j + i] = (int8_t)(clampi(rnd(x[16 * j + i] / dj), -4, 3) + 4);
    }
    memset(hmask, 0, 32);
    uint8_t U[QK];
    for (int j = 0; j < QK; ++j) {
        int l = L[j];
        if (l > 3) { hmask[j % 32] |= (uint8_t)(1 << (j / 32)); l -= 4; }
        U[j] = (uint8_t)l;
    }
    pack2(U, qs);
}

/* Q4_K / Q5_K: d, dmin, 12 scale bytes, then the codes L[256] (returned) */
static void k4_head(const float *x, uint8_t *y, uint8_t *L, int nmax, float rmin, int nstep) {
    float w[QK], sc[8], mn[8], max_s = 0, max_m = 0;
    for (int j = 0; j < 8; ++j) {
        const float *xj = x + 32 * j;
        float s2 = 0;
        for (int l = 0; l < 32; ++l) s2 += xj[l] * xj[l];
        float av = sqrtf(s2 / 32);
        for (int l = 0; l < 32; ++l) w[32 * j + l] = av + fabsf(xj[l]);
    }
#ifdef HZ_HAVE_AVX2_PATH
    if (use_simd()) qkx_avx2(x, w, L, sc, mn, nmax, rmin, 0.1f, nstep);
    else
#endif
    for (int j = 0; j < 8; ++j)
        sc[j] = qkx2(32, nmax, x + 32 * j, w + 32 * j, L + 32 * j, &mn[j], rmin, 0.1f, nstep, 0);
    for (int j = 0; j < 8; ++j) {
        if (sc[j] > max_s) max_s = sc[j];
        if (mn[j] > max_m) max_m = mn[j];
    }
    float is = max_s > 0 ? 63.f / max_s : 0.f, im = max_m > 0 ? 63.f / max_m : 0.f;
    uint8_t ls[8], lm[8], *scales = y + 4;
    for (int j = 0; j < 8; ++j) {
        uint8_t a = (uint8_t)rnd(is * sc[j]), b = (uint8_t)rnd(im * mn[j]);
        ls[j] = a < 63 ? a : 63;
        lm[j] = b < 63 ? b : 63;
    }
    for (int j = 0; j < 4; ++j) {
        scales[j] = (uint8_t)(ls[j] | ((ls[j + 4] >> 4) << 6));
        scales[j + 4] = (uint8_t)(lm[j] | ((lm[j + 4] >> 4) << 6));
        scales[j + 8] = (uint8_t)((ls[j + 4] & 0xf) | ((lm[j + 4] & 0xf) << 4));
    }
    put_half(y, max_s / 63.f);
    put_half(y + 2, max_m / 63.f);
    float dq = half_round(max_s / 63.f), dmq = half_round(max_m / 63.f);
    for (int j = 0; j < 8; ++j) {
        float dj = dq * ls[j];
        if (!dj) continue;
        float mj = dmq * lm[j];
        for (int i = 0; i < 32; ++i) L[32 * j + i] = (uint8_t)clampi(rnd((x[32 * j + i] + mj) / dj), 0, nmax);
    }
}

static void q4_k_block(const float *x, uint8_t *y) {
    uint8_t L[QK];
    k4_head(x, y, L, 15, -1.f, 20);
    uint8_t *q = y + 16;
    for (int j = 0; j < QK; j += 64, q += 32)
        for (int l = 0; l < 32; ++l) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
}

static void q5_k_block(const float *x, uint8_t *y) {
    uint8_t L[QK];
    k4_head(x, y, L, 31, -0.5f, 15);
    uint8_t *qh = y + 16, *ql = y + 48;
    memset(qh, 0, 32);
    for (int j = 0; j < QK; j += 64, ql += 32)
        for (int l = 0; l < 32; ++l) {
            int a = L[j + l], b = L[j + l + 32], plane = j / 32;
            if (a > 15) { a -= 16; qh[l] |= (uint8_t)(1 << plane); }
            if (b > 15) { b -= 16; qh[l] |= (uint8_t)(1 << (plane + 1)); }
            ql[l] = (uint8_t)(a | (b << 4));
        }
}

#ifdef HZ_HAVE_AVX2_PATH
/* make_qx_quants with rmse_type 1 (qx_rmse1) for eight 16-value sub-blocks at once, one per
 * AVX2 lane, in the scalar order of operations: x, qw (or NULL): 128 floats (sub-block j at
 * 16 * j); writes L[128] (offset by nmax) and scale[8]. */
__attribute__((target("avx2")))
static void qx16_avx2(const float *x, const float *qw, int8_t *L, float *scale_out, int nmax) {
    __m256 X[16], W[16];
    __m256i BL[16];
    const __m256i idx = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);
    const __m256 zero = _mm256_setzero_ps(), absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i lo = _mm256_set1_epi32(-nmax), hi = _mm256_set1_epi32(nmax - 1);
    __m256 amax = zero, mx = zero;
    for (int i = 0; i < 16; ++i) {
        X[i] = _mm256_i32gather_ps(x + i, idx, 4);
        W[i] = qw ? _mm256_i32gather_ps(qw + i, idx, 4) : _mm256_mul_ps(X[i], X[i]);
        __m256 a = _mm256_and_ps(X[i], absm), gt = _mm256_cmp_ps(a, amax, _CMP_GT_OQ);
        amax = _mm256_blendv_ps(amax, a, gt);
        mx = _mm256_blendv_ps(mx, X[i], gt);
    }
    const __m256 tiny = _mm256_cmp_ps(amax, _mm256_set1_ps(EPS), _CMP_LT_OQ);
    __m256 iscale = _mm256_div_ps(_mm256_set1_ps((float)-nmax), mx), sumlx = zero, suml2 = zero;
    for (int i = 0; i < 16; ++i) {
        __m256i l = _mm256_cvtps_epi32(_mm256_mul_ps(iscale, X[i]));
        l = _mm256_min_epi32(_mm256_max_epi32(l, lo), hi);
        BL[i] = l;
        __m256 fl = _mm256_cvtepi32_ps(l);
        sumlx = _mm256_add_ps(sumlx, _mm256_mul_ps(_mm256_mul_ps(W[i], X[i]), fl));
        suml2 = _mm256_add_ps(suml2, _mm256_mul_ps(_mm256_mul_ps(W[i], fl), fl));
    }
    __m256 nz = _mm256_cmp_ps(suml2, zero, _CMP_NEQ_UQ);
    __m256 scale = _mm256_and_ps(nz, _mm256_div_ps(sumlx, suml2));
    __m256 best = _mm256_mul_ps(scale, sumlx);
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = _mm256_div_ps(_mm256_set1_ps(-(nmax + 0.1f * is)), mx);
        __m256i La[16];
        sumlx = suml2 = zero;
        for (int i = 0; i < 16; ++i) {
            __m256i l = _mm256_cvtps_epi32(_mm256_mul_ps(iscale, X[i]));
            l = _mm256_min_epi32(_mm256_max_epi32(l, lo), hi);
            La[i] = l;
            __m256 fl = _mm256_cvtepi32_ps(l);
            sumlx = _mm256_add_ps(sumlx, _mm256_mul_ps(_mm256_mul_ps(W[i], X[i]), fl));
            suml2 = _mm256_add_ps(suml2, _mm256_mul_ps(_mm256_mul_ps(W[i], fl), fl));
        }
        __m256 upd = _mm256_and_ps(_mm256_cmp_ps(suml2, zero, _CMP_GT_OQ),
                                   _mm256_cmp_ps(_mm256_mul_ps(sumlx, sumlx), _mm256_mul_ps(best, suml2), _CMP_GT_OQ));
        if (!_mm256_movemask_ps(upd)) continue;
        __m256i updi = _mm256_castps_si256(upd);
        for (int i = 0; i < 16; ++i) BL[i] = _mm256_blendv_epi8(BL[i], La[i], updi);
        __m256 s = _mm256_div_ps(sumlx, suml2);
        scale = _mm256_blendv_ps(scale, s, upd);
        best = _mm256_blendv_ps(best, _mm256_mul_ps(s, sumlx), upd);
    }
    scale = _mm256_blendv_ps(scale, zero, tiny);
    _mm256_storeu_ps(scale_out, scale);
    const __m256i off = _mm256_set1_epi32(nmax), tinyi = _mm256_castps_si256(tiny);
    int32_t lanes[8];
    for (int i = 0; i < 16; ++i) {
        _mm256_storeu_si256((__m256i *)lanes, _mm256_blendv_epi8(_mm256_add_epi32(BL[i], off),
                                                                 _mm256_setzero_si256(), tinyi));
        for (int j = 0; j < 8; ++j) L[16 * j + i] = (int8_t)lanes[j];
    }
}
#endif

static void q6_k_block(const float *x, uint8_t *y, const float *qw) {
    int8_t L[QK];
    float sc[16], amax = 0, max_s = 0;
#ifdef HZ_HAVE_AVX2_PATH
    if (use_simd()) {
        qx16_avx2(x, qw, L, sc, 32);
        qx16_avx2(x + 128, qw ? qw + 128 : NULL, L + 128, sc + 8, 32);
    } else
#endif
    for (int j = 0; j < 16; ++j) sc[j] = qx_rmse1(16, 32, x + 16 * j, L + 16 * j, qw ? qw + 16 * j : NULL);
    for (int j = 0; j < 16; ++j) {
        float a = fabsf(sc[j]);
        if (a > amax) { amax = a; max_s = sc[j]; }
    }
    if (amax < EPS) { memset(y, 0, 210); return; }
    uint8_t *ql = y, *qh = y + 128;
    int8_t *scales = (int8_t *)(y + 192);
    float is = -128.f / max_s;
    put_half(y + 208, 1 / is);
    for (int j = 0; j < 16; ++j) {
        int v = rnd(is * sc[j]);
        scales[j] = (int8_t)(v < 127 ? v : 127);
    }
    float dq = half_round(1 / is);
    for (int j = 0; j < 16; ++j) {
        float dj = dq * scales[j];
        if (!dj) continue;
        for (int i = 0; i < 16; ++i) L[16 * j + i] = (int8_t)(clampi(rnd(x[16 * j + i] / dj), -32, 31) + 32);
    }
    for (int j = 0; j < QK; j += 128, ql += 64, qh += 32)
        for (int l = 0; l < 32; ++l) {
            int a = L[j + l], b = L[j + l + 32], c = L[j + l + 64], e = L[j + l + 96];
            ql[l] = (uint8_t)((a & 0xf) | ((c & 0xf) << 4));
            ql[l + 32] = (uint8_t)((b & 0xf) | ((e & 0xf) << 4));
            qh[l] = (uint8_t)((a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6));
        }
}

/* ---- with an importance matrix (ggml's quantize_row_q{2..6}_K_impl with quant_weights) ---- */

/* ggml's make_qkx3_quants with weights: returns the scale, *the_min = -min, L in [0, nmax] */
static float qkx3(int n, int nmax, const float *x, const float *w, uint8_t *L, float *the_min,
                  float rmin, float rdelta, int nstep) {
    uint8_t La[32];
    float mn = x[0], mx = x[0], sum_w = w[0], sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        if (x[i] < mn) mn = x[i];
        if (x[i] > mx) mx = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (mn > 0) mn = 0;
    if (mx <= mn) {
        memset(L, 0, (size_t)n);
        *the_min = -mn;
        return 0.f;
    }
    float iscale = nmax / (mx - mn), scale = 1 / iscale, best = 0;
    for (int i = 0; i < n; ++i) {
        L[i] = (uint8_t)clampi(rnd(iscale * (x[i] - mn)), 0, nmax);
        float diff = scale * L[i] + mn - x[i];
        best += w[i] * (diff * diff);
    }
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta * is + nmax) / (mx - mn);
        float sl = 0, sl2 = 0, sxl = 0;
        for (int i = 0; i < n; ++i) {
            int l = clampi(rnd(iscale * (x[i] - mn)), 0, nmax);
            La[i] = (uint8_t)l;
            sl += w[i] * l;
            sl2 += w[i] * l * l;
            sxl += w[i] * l * x[i];
        }
        float D = sum_w * sl2 - sl * sl;
        if (D > 0) {
            float s = (sum_w * sxl - sum_x * sl) / D, m = (sl2 * sum_x - sl * sxl) / D;
            if (m > 0) { m = 0; s = sxl / sl2; }
            float err = 0;
            for (int i = 0; i < n; ++i) {
                float diff = s * La[i] + m - x[i];
                err += w[i] * (diff * diff);
            }
            if (err < best) { memcpy(L, La, (size_t)n); best = err; scale = s; mn = m; }
        }
    }
    *the_min = -mn;
    return scale;
}

/* ggml's make_qp_quants: positive x, weights qw, L in [0, nmax] (uint8 as ggml stores it) */
static float qp(int n, int nmax, const float *x, uint8_t *L, const float *qw) {
    float mx = 0;
    for (int i = 0; i < n; ++i) mx = mx > x[i] ? mx : x[i];
    if (mx < EPS) { memset(L, 0, (size_t)n); return 0.f; }
    float iscale = nmax / mx;
    for (int i = 0; i < n; ++i) L[i] = (uint8_t)rnd(iscale * x[i]);
    float scale = 1 / iscale, best = 0;
    for (int i = 0; i < n; ++i) {
        float diff = x[i] - scale * L[i];
        best += qw[i] * diff * diff;
    }
    for (int is = -4; is <= 4; ++is) {
        if (is == 0) continue;
        float isc = (0.1f * is + nmax) / mx, sc = 1 / isc, mse = 0;
        for (int i = 0; i < n; ++i) {
            int l = rnd(isc * x[i]);
            if (l > nmax) l = nmax;
            float diff = x[i] - sc * l;
            mse += qw[i] * diff * diff;
        }
        if (mse < best) { best = mse; iscale = isc; }
    }
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = rnd(iscale * x[i]);
        if (l > nmax) l = nmax;
        L[i] = (uint8_t)l;
        sumlx += qw[i] * x[i] * l;
        suml2 += qw[i] * l * l;
    }
    for (int it = 0; it < 5; ++it) {
        int changed = 0;
        for (int i = 0; i < n; ++i) {
            float w = qw[i];
            float slx = sumlx - w * x[i] * L[i], sl2 = suml2 - w * L[i] * L[i];
            if (slx > 0 && sl2 > 0) {
                int nl = rnd(x[i] * sl2 / slx);
                if (nl > nmax) nl = nmax;
                if (nl != L[i]) {
                    slx += w * x[i] * nl;
                    sl2 += w * nl * nl;
                    if (slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (uint8_t)nl; sumlx = slx; suml2 = sl2; ++changed;
                    }
                }
            }
        }
        if (!changed) break;
    }
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

static float sum_sq(int n, const float *x) {
    float s = 0;
    for (int i = 0; i < n; ++i) s += x[i] * x[i];
    return s;
}

static void q2_k_block_w(const float *x, uint8_t *y, const float *qw) {
    uint8_t L[QK], Ls[16], Lm[16];
    float w[16], sw[16], sc[16], mn[16];
    float sigma2 = sum_sq(QK, x) / QK;
    for (int j = 0; j < 16; ++j) {
        for (int l = 0; l < 16; ++l) w[l] = qw[16 * j + l] * sqrtf(sigma2 + x[16 * j + l] * x[16 * j + l]);
        sw[j] = 0;
        for (int l = 0; l < 16; ++l) sw[j] += w[l];
        sc[j] = qkx3(16, 3, x + 16 * j, w, L + 16 * j, &mn[j], -0.9f, 0.05f, 36);
    }
    float dm = qp(16, 15, sc, Ls, sw), mm = qp(16, 15, mn, Lm, sw);
    uint8_t *scales = y, *qs = y + 16;
    put_half(y + 80, dm);
    put_half(y + 82, mm);
    dm = half_round(dm);
    mm = half_round(mm);
    for (int j = 0; j < 16; ++j) scales[j] = (uint8_t)(Ls[j] | (Lm[j] << 4));
    for (int j = 0; j < 16; ++j) {
        float d = dm * (scales[j] & 0xf);
        if (!d) continue;
        float m = mm * (scales[j] >> 4);
        for (int i = 0; i < 16; ++i) L[16 * j + i] = (uint8_t)clampi(rnd((x[16 * j + i] + m) / d), 0, 3);
    }
    pack2(L, qs);
}

static void q3_k_block_w(const float *x, uint8_t *y, const float *qw) {
    int8_t L[QK], Ls[16];
    float w[16], sw[16], sc[16];
    float sigma2 = 2 * sum_sq(QK, x) / QK;
    for (int j = 0; j < 16; ++j) {
        for (int l = 0; l < 16; ++l) w[l] = qw[16 * j + l] * sqrtf(sigma2 + x[16 * j + l] * x[16 * j + l]);
        float s = 0;
        for (int l = 0; l < 16; ++l) s += w[l];
        sw[j] = s;
        sc[j] = qx_rmse1(16, 4, x + 16 * j, L + 16 * j, w);
    }
    uint8_t *hmask = y, *qs = y + 32, *scales = y + 96;
    memset(scales, 0, 12);
    float d_block = qx_rmse1(16, 32, sc, Ls, sw);
    for (int j = 0; j < 16; ++j) {
        int l = Ls[j];
        if (j < 8) scales[j] = (uint8_t)(l & 0xf);
        else scales[j - 8] |= (uint8_t)((l & 0xf) << 4);
        l >>= 4;
        scales[j % 4 + 8] |= (uint8_t)(l << (2 * (j / 4)));
    }
    put_half(y + 108, d_block);
    float dq = half_round(d_block);
    for (int j = 0; j < 16; ++j) {
        int8_t s = (int8_t)(j < 8 ? scales[j] & 0xf : scales[j - 8] >> 4);
        s = (int8_t)((s | (((scales[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32);
        float dj = dq * s;
        if (!dj) continue;
        for (int i = 0; i < 16; ++i) L[16 * j + i] = (int8_t)(clampi(rnd(x[16 * j + i] / dj), -4, 3) + 4);
    }
    memset(hmask, 0, 32);
    uint8_t U[QK];
    for (int j = 0; j < QK; ++j) {
        int l = L[j];
        if (l > 3) { hmask[j % 32] |= (uint8_t)(1 << (j / 32)); l -= 4; }
        U[j] = (uint8_t)l;
    }
    pack2(U, qs);
}

/* ggml's get_scale_min_k4: the 6-bit scale and min of group j from the 12 scale bytes */
static void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) { *d = q[j] & 63; *m = q[j + 4] & 63; }
    else {
        *d = (uint8_t)((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* Q4_K / Q5_K with weights: d, dmin, 12 scale bytes, then the codes L[256] (returned) */
static void k4_head_w(const float *x, uint8_t *y, uint8_t *L, int nmax, const float *qw, int cap) {
    float w[QK], sw[8], sc[8], mn[8];
    uint8_t Ls[8], Lm[8], *scales = y + 4;
    float sigma2 = 2 * sum_sq(QK, x) / QK;
    for (int j = 0; j < 8; ++j) {
        float *wj = w + 32 * j;
        for (int l = 0; l < 32; ++l) wj[l] = qw[32 * j + l] * sqrtf(sigma2 + x[32 * j + l] * x[32 * j + l]);
        float s = 0;
        for (int l = 0; l < 32; ++l) s += wj[l];
        sw[j] = s;
    }
#ifdef HZ_HAVE_AVX2_PATH
    if (use_simd()) qkx_avx2(x, w, L, sc, mn, nmax, -0.9f, 0.05f, 36);
    else
#endif
    for (int j = 0; j < 8; ++j)
        sc[j] = qkx3(32, nmax, x + 32 * j, w + 32 * j, L + 32 * j, &mn[j], -0.9f, 0.05f, 36);
    float d_block = qp(8, 63, sc, Ls, sw), m_block = qp(8, 63, mn, Lm, sw);
    for (int j = 0; j < 8; ++j) {
        uint8_t ls = Ls[j], lm = Lm[j];
        if (cap) { ls = ls < 63 ? ls : 63; lm = lm < 63 ? lm : 63; }
        if (j < 4) { scales[j] = ls; scales[j + 4] = lm; }
        else {
            scales[j + 4] = (uint8_t)((ls & 0xf) | ((lm & 0xf) << 4));
            scales[j - 4] |= (uint8_t)((ls >> 4) << 6);
            scales[j] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    put_half(y, d_block);
    put_half(y + 2, m_block);
    float dq = half_round(d_block), dmq = half_round(m_block);
    for (int j = 0; j < 8; ++j) {
        uint8_t s, m;
        scale_min_k4(j, scales, &s, &m);
        float d = dq * s;
        if (!d) continue;
        float dm = dmq * m;
        for (int i = 0; i < 32; ++i) L[32 * j + i] = (uint8_t)clampi(rnd((x[32 * j + i] + dm) / d), 0, nmax);
    }
}

static void pack_q4(const uint8_t *L, uint8_t *y) {
    uint8_t *q = y + 16;
    for (int j = 0; j < QK; j += 64, q += 32)
        for (int l = 0; l < 32; ++l) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
}

static void pack_q5(const uint8_t *L, uint8_t *y) {
    uint8_t *qh = y + 16, *ql = y + 48;
    memset(qh, 0, 32);
    for (int j = 0; j < QK; j += 64, ql += 32)
        for (int l = 0; l < 32; ++l) {
            int a = L[j + l], b = L[j + l + 32], plane = j / 32;
            if (a > 15) { a -= 16; qh[l] |= (uint8_t)(1 << plane); }
            if (b > 15) { b -= 16; qh[l] |= (uint8_t)(1 << (plane + 1)); }
            ql[l] = (uint8_t)(a | (b << 4));
        }
}

static void q4_k_block_w(const float *x, uint8_t *y, const float *qw) {
    uint8_t L[QK];
    k4_head_w(x, y, L, 15, qw, 0);
    pack_q4(L, y);
}

static void q5_k_block_w(const float *x, uint8_t *y, const float *qw) {
    uint8_t L[QK];
    k4_head_w(x, y, L, 31, qw, 1);
    pack_q5(L, y);
}

/* ---- IQ4_NL / IQ4_XS (ggml's quantize_row_iq4_nl_impl with ntry 7, as quantize_iq4_nl/_xs) ---- */

/* the 16 non-linear levels of IQ4_NL and IQ4_XS (ggml-common.h kvalues_iq4nl) */
static const int8_t KV4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* ggml's best_index_int8: the nearest level, the upper one on a tie */
static inline int best4(float x) {
    if (x <= KV4[0]) return 0;
    if (x >= KV4[15]) return 15;
    int ml = 0, mu = 15;
    while (mu - ml > 1) {
        int mav = (ml + mu) / 2;
        if (x < KV4[mav]) mu = mav; else ml = mav;
    }
    return x - KV4[mu - 1] < KV4[mu] - x ? mu - 1 : mu;
}

/* one super-block of sbs values (32: IQ4_NL, 256: IQ4_XS) in groups of 32; qw NULL: weights x^2 */
static void iq4_block(int sbs, const float *x, uint8_t *y, const float *qw) {
    const int ntry = 7, nb = sbs / 32;
    uint8_t L[QK];
    float w[32], scales[8];
    float sigma2 = 0;
    for (int j = 0; j < sbs; ++j) sigma2 += x[j] * x[j];
    sigma2 *= 2.f / sbs;
    uint8_t *q4 = nb > 1 ? y + 8 : y + 2;
    memset(q4, 0, (size_t)sbs / 2);
    float max_scale = 0, amax_scale = 0;
    for (int ib = 0; ib < nb; ++ib) {
        const float *xb = x + 32 * ib;
        uint8_t *Lb = L + 32 * ib;
        if (qw) for (int j = 0; j < 32; ++j) w[j] = qw[32 * ib + j] * sqrtf(sigma2 + xb[j] * xb[j]);
        else for (int j = 0; j < 32; ++j) w[j] = xb[j] * xb[j];
        float amax = 0, mx = 0;
        for (int j = 0; j < 32; ++j) {
            float ax = fabsf(xb[j]);
            if (ax > amax) { amax = ax; mx = xb[j]; }
        }
        if (amax < EPS) { scales[ib] = 0; continue; }
        float d = -mx / KV4[0], id = 1 / d, sumqx = 0, sumq2 = 0;
        for (int j = 0; j < 32; ++j) {
            int l = best4(id * xb[j]);
            Lb[j] = (uint8_t)l;
            float q = KV4[l];
            sumqx += w[j] * q * xb[j];
            sumq2 += w[j] * q * q;
        }
        d = sumq2 > 0 ? sumqx / sumq2 : 0.f;
        float best = d * sumqx;
        for (int itry = -ntry; itry <= ntry; ++itry) {
            id = (itry + KV4[0]) / mx;
            sumqx = sumq2 = 0;
            for (int j = 0; j < 32; ++j) {
                float q = KV4[best4(id * xb[j])];
                sumqx += w[j] * q * xb[j];
                sumq2 += w[j] * q * q;
            }
            if (sumq2 > 0 && sumqx * sumqx > best * sumq2) { d = sumqx / sumq2; best = d * sumqx; }
        }
        scales[ib] = d;
        if (fabsf(d) > amax_scale) { amax_scale = fabsf(d); max_scale = d; }
    }
    if (nb > 1) {
        uint16_t sh = 0;
        uint8_t *sl = y + 4;
        float d = -max_scale / 32;
        put_half(y, d);
        float id = d ? 1 / d : 0.f;
        for (int ib = 0; ib < nb; ++ib) {
            int l = clampi(rnd(id * scales[ib]), -32, 31);
            float dl = d * l, idl = dl ? 1 / dl : 0.f;
            for (int j = 0; j < 32; ++j) L[32 * ib + j] = (uint8_t)best4(idl * x[32 * ib + j]);
            l += 32;
            if (ib % 2 == 0) sl[ib / 2] = (uint8_t)(l & 0xf);
            else sl[ib / 2] |= (uint8_t)((l & 0xf) << 4);
            sh |= (uint16_t)((l >> 4) << 2 * (ib % 8));
        }
        y[2] = (uint8_t)(sh & 0xff);
        y[3] = (uint8_t)(sh >> 8);
    } else {
        put_half(y, scales[0]);
        float id = scales[0] ? 1 / scales[0] : 0;
        for (int j = 0; j < sbs; ++j) L[j] = (uint8_t)best4(id * x[j]);
    }
    for (int i = 0; i < sbs / 32; ++i)
        for (int j = 0; j < 16; ++j) q4[16 * i + j] = (uint8_t)(L[32 * i + j] | (L[32 * i + 16 + j] << 4));
}

static void q2_k_any(const float *x, uint8_t *y, const float *qw) { if (qw) q2_k_block_w(x, y, qw); else q2_k_block(x, y); }
static void q3_k_any(const float *x, uint8_t *y, const float *qw) { if (qw) q3_k_block_w(x, y, qw); else q3_k_block(x, y); }
static void q4_k_any(const float *x, uint8_t *y, const float *qw) { if (qw) q4_k_block_w(x, y, qw); else q4_k_block(x, y); }
static void q5_k_any(const float *x, uint8_t *y, const float *qw) { if (qw) q5_k_block_w(x, y, qw); else q5_k_block(x, y); }
static void iq4_nl_block(const float *x, uint8_t *y, const float *qw) { iq4_block(32, x, y, qw); }
static void iq4_xs_block(const float *x, uint8_t *y, const float *qw) { iq4_block(QK, x, y, qw); }

/* ---- Q4_0 / Q4_1 / Q5_0 / Q5_1 with weights (ggml's quantize_row_q{4,5}_{0,1}_impl): one row of
 * n values; sigma2 is the row's mean square (not a super-block's). type_id: 2, 3, 6, 7 ---- */
static void legacy_row_w(int type_id, const float *x, uint8_t *y, int64_t n, const float *qw) {
    float sum_x2 = 0;
    for (int64_t j = 0; j < n; ++j) sum_x2 += x[j] * x[j];
    float sigma2 = sum_x2 / n;
    const int ts = type_id == 2 ? 18 : type_id == 3 ? 20 : type_id == 6 ? 22 : 24;
    for (int64_t ib = 0; ib < n / 32; ++ib) {
        const float *xb = x + 32 * ib, *q = qw + 32 * ib;
        uint8_t *b = y + ib * ts, L[32];
        float w[32];
        for (int j = 0; j < 32; ++j) w[j] = q[j] * sqrtf(sigma2 + xb[j] * xb[j]);
        int off = 2;
        if (type_id == 2 || type_id == 6) {  /* symmetric: make_qx_quants, L = l + nmax */
            int8_t Ls[32];
            put_half(b, qx_rmse1(32, type_id == 2 ? 8 : 16, xb, Ls, w));
            for (int j = 0; j < 32; ++j) L[j] = (uint8_t)Ls[j];
        } else {  /* with a min: make_qkx3_quants */
            float the_min;
            put_half(b, qkx3(32, type_id == 3 ? 15 : 31, xb, w, L, &the_min, -0.9f, 0.05f, 36));
            put_half(b + 2, -the_min);
            off = 4;
        }
        if (type_id >= 6) {  /* the fifth bits: qh, little-endian uint32 */
            uint32_t qh = 0;
            for (int j = 0; j < 16; ++j) {
                qh |= (uint32_t)((L[j] & 0x10u) >> 4) << j;
                qh |= (uint32_t)((L[j + 16] & 0x10u) >> 4) << (j + 16);
            }
            for (int k = 0; k < 4; ++k) b[off + k] = (uint8_t)(qh >> (8 * k));
            off += 4;
        }
        for (int j = 0; j < 16; ++j) b[off + j] = (uint8_t)((L[j] & 0x0F) | ((L[j + 16] & 0x0F) << 4));
    }
}


/* ---- IQ3_XXS (ggml's quantize_row_iq3_xxs_impl, grid size 256) ----
 * Layout (ggml-common.h block_iq3_xxs, 98 bytes): fp16 d; 64 grid indices (8 per group of 32, one
 * per 4 values); 8 little-endian uint32, per group: four 7-bit sign masks (the 8th sign of each 8
 * values is the parity) and a 4-bit scale in bits 28..31. */

/* the 256 grid points: 4 three-bit levels l (value 2l + 1), level i in bits 3i..3i+2 */
static const uint16_t IQ3XXS_KGRID[256] = {
       0,    2,    4,    9,   11,   15,   16,   18,   25,   34,   59,   61,   65,   67,   72,   74,
      81,   85,   88,   90,   97,  108,  120,  128,  130,  132,  137,  144,  146,  153,  155,  159,
     169,  175,  189,  193,  199,  200,  202,  213,  248,  267,  287,  292,  303,  315,  317,  321,
     327,  346,  362,  413,  436,  456,  460,  462,  483,  497,  513,  515,  520,  522,  529,  531,
     536,  538,  540,  551,  552,  576,  578,  585,  592,  594,  641,  643,  648,  650,  657,  664,
     698,  704,  706,  720,  729,  742,  758,  769,  773,  808,  848,  852,  870,  889,  901,  978,
     992, 1024, 1026, 1033, 1035, 1040, 1042, 1046, 1049, 1058, 1089, 1091, 1093, 1096, 1098, 1105,
    1112, 1139, 1143, 1144, 1152, 1154, 1161, 1167, 1168, 1170, 1183, 1184, 1197, 1217, 1224, 1228,
    1272, 1276, 1309, 1323, 1347, 1367, 1377, 1404, 1473, 1475, 1486, 1509, 1537, 1544, 1546, 1553,
    1555, 1576, 1589, 1594, 1600, 1602, 1616, 1625, 1636, 1638, 1665, 1667, 1672, 1685, 1706, 1722,
    1737, 1755, 1816, 1831, 1850, 1856, 1862, 1874, 1901, 1932, 1950, 1971, 2011, 2032, 2052, 2063,
    2077, 2079, 2091, 2095, 2172, 2192, 2207, 2208, 2224, 2230, 2247, 2277, 2308, 2345, 2356, 2389,
    2403, 2424, 2501, 2504, 2506, 2520, 2570, 2593, 2616, 2624, 2630, 2646, 2669, 2700, 2714, 2746,
    2754, 2795, 2824, 2835, 2839, 2874, 2882, 2905, 2984, 3028, 3042, 3092, 3108, 3110, 3124, 3153,
    3185, 3215, 3252, 3288, 3294, 3364, 3397, 3434, 3483, 3523, 3537, 3587, 3589, 3591, 3592, 3610,
    3626, 3670, 3680, 3722, 3749, 3754, 3776, 3789, 3803, 3824, 3857, 3873, 3904, 3906, 3924, 3992,
};
/* IQ3_S's 512 grid points, the same encoding */
static const uint16_t IQ3S_KGRID[512] = {
       0,    1,    2,    5,    7,    8,    9,   10,   12,   14,   16,   17,   21,   27,   32,   34,
      37,   39,   41,   43,   48,   50,   57,   60,   63,   64,   65,   66,   68,   72,   73,   77,
      80,   83,   87,   89,   93,  100,  113,  117,  122,  128,  129,  133,  135,  136,  139,  142,
     145,  149,  152,  156,  162,  165,  167,  169,  171,  184,  187,  195,  201,  205,  208,  210,
     217,  219,  222,  228,  232,  234,  247,  249,  253,  256,  267,  271,  273,  276,  282,  288,
     291,  297,  312,  322,  324,  336,  338,  342,  347,  353,  357,  359,  374,  379,  390,  393,
     395,  409,  426,  441,  448,  450,  452,  464,  466,  470,  475,  488,  492,  512,  513,  514,
     516,  520,  521,  523,  525,  527,  528,  530,  537,  540,  542,  556,  558,  561,  570,  576,
     577,  579,  582,  584,  588,  593,  600,  603,  609,  616,  618,  632,  638,  640,  650,  653,
     655,  656,  660,  666,  672,  675,  685,  688,  698,  705,  708,  711,  712,  715,  721,  727,
     728,  732,  737,  754,  760,  771,  773,  778,  780,  793,  795,  802,  806,  808,  812,  833,
     840,  843,  849,  856,  858,  873,  912,  916,  919,  932,  934,  961,  963,  968,  970,  977,
     989,  993, 1010, 1016, 1024, 1025, 1027, 1029, 1031, 1032, 1034, 1036, 1038, 1041, 1043, 1047,
    1048, 1050, 1057, 1059, 1061, 1064, 1066, 1079, 1080, 1083, 1085, 1088, 1090, 1096, 1099, 1103,
    1106, 1109, 1113, 1116, 1122, 1129, 1153, 1156, 1159, 1169, 1171, 1176, 1183, 1185, 1195, 1199,
    1209, 1212, 1216, 1218, 1221, 1225, 1234, 1236, 1241, 1243, 1250, 1256, 1270, 1281, 1287, 1296,
    1299, 1306, 1309, 1313, 1338, 1341, 1348, 1353, 1362, 1375, 1376, 1387, 1400, 1408, 1410, 1415,
    1425, 1453, 1457, 1477, 1481, 1494, 1496, 1507, 1512, 1538, 1545, 1547, 1549, 1551, 1554, 1561,
    1563, 1565, 1570, 1572, 1575, 1577, 1587, 1593, 1601, 1603, 1605, 1612, 1617, 1619, 1632, 1648,
    1658, 1662, 1664, 1674, 1680, 1690, 1692, 1704, 1729, 1736, 1740, 1745, 1747, 1751, 1752, 1761,
    1763, 1767, 1773, 1787, 1795, 1801, 1806, 1810, 1817, 1834, 1840, 1844, 1857, 1864, 1866, 1877,
    1882, 1892, 1902, 1915, 1934, 1953, 1985, 1987, 2000, 2002, 2013, 2048, 2052, 2058, 2064, 2068,
    2071, 2074, 2081, 2088, 2104, 2114, 2119, 2121, 2123, 2130, 2136, 2141, 2147, 2153, 2157, 2177,
    2179, 2184, 2189, 2193, 2203, 2208, 2223, 2226, 2232, 2244, 2249, 2251, 2256, 2258, 2265, 2269,
    2304, 2306, 2324, 2335, 2336, 2361, 2373, 2375, 2385, 2418, 2443, 2460, 2480, 2504, 2509, 2520,
    2531, 2537, 2562, 2568, 2572, 2578, 2592, 2596, 2599, 2602, 2614, 2620, 2625, 2627, 2629, 2634,
    2641, 2650, 2682, 2688, 2697, 2707, 2712, 2718, 2731, 2754, 2759, 2760, 2775, 2788, 2793, 2805,
    2811, 2817, 2820, 2832, 2842, 2854, 2890, 2902, 2921, 2923, 2978, 3010, 3012, 3026, 3081, 3083,
    3085, 3097, 3099, 3120, 3136, 3152, 3159, 3188, 3210, 3228, 3234, 3245, 3250, 3256, 3264, 3276,
    3281, 3296, 3349, 3363, 3378, 3392, 3395, 3420, 3440, 3461, 3488, 3529, 3531, 3584, 3588, 3591,
    3600, 3602, 3614, 3616, 3628, 3634, 3650, 3657, 3668, 3683, 3685, 3713, 3716, 3720, 3726, 3729,
    3736, 3753, 3778, 3802, 3805, 3819, 3841, 3845, 3851, 3856, 3880, 3922, 3938, 3970, 3993, 4032,
};

/* Neighbour lists of the codes off a codebook grid (ggml's iq3xs_init_impl / iq2xs_init_impl):
 * grid[ng][dim] holds the points' values 2v + 1 of value indices v; a code u (dim indices of
 * bits each) is on the grid when map[u] >= 0; for every other u < nmap, map[u] = -1 - offset into
 * *nbp, where a count is followed by the grid points at the nwant (<= 3) smallest distinct squared
 * distances, ordered by (distance, index) as ggml's qsort of (d2, index) pairs orders them.
 * Returns 0, or -4 when out of memory. */
static int grid_neighbours(const int8_t *grid, int dim, int ng, int bits, int nmap, int nwant, int *map,
                           uint16_t **nbp) {
    size_t cap = (size_t)nmap * 8, used = 0;
    uint16_t *nb = (uint16_t *)malloc(cap * sizeof(uint16_t));
    const int vmask = (1 << bits) - 1;
    for (int u = 0; u < nmap && nb; ++u) {
        if (map[u] >= 0) continue;
        int d2[2048], lev[3] = {1 << 30, 1 << 30, 1 << 30};  /* the nwant smallest distinct distances */
        for (int j = 0; j < ng; ++j) {
            int d = 0;
            for (int i = 0; i < dim; ++i) {
                int e = grid[j * dim + i] - (2 * ((u >> (bits * i)) & vmask) + 1);
                d += e * e;
            }
            d2[j] = d;
            for (int l = 0; l < nwant; ++l) {
                if (d == lev[l]) break;
                if (d < lev[l]) {
                    for (int m = nwant - 1; m > l; --m) lev[m] = lev[m - 1];
                    lev[l] = d;
                    break;
                }
            }
        }
        if (used + (size_t)ng + 1 > cap) {
            cap *= 2;
            uint16_t *tmp = (uint16_t *)realloc(nb, cap * sizeof(uint16_t));
            if (!tmp) { free(nb); nb = NULL; break; }
            nb = tmp;
        }
        map[u] = -1 - (int)used;
        size_t start = used++;
        for (int l = 0; l < nwant; ++l)
            for (int j = 0; j < ng; ++j) if (d2[j] == lev[l]) nb[used++] = (uint16_t)j;
        nb[start] = (uint16_t)(used - start - 1);
    }
    *nbp = nb;
    return nb ? 0 : -4;
}

/* ggml's iq*_find_best_neighbour: of the neighbours nb (a count, then grid indices), the one with
 * the least weighted squared error of scale * lv[v] against xval over its dim values (value index
 * v = (grid value - 1) / 2); its indices to L. lv: the grids' own values 2v + 1, or IQ1's levels. */
static int grid_best_neighbour(const int8_t *grid, int dim, const uint16_t *nb, const float *xval, const float *w,
                               float scale, const float *lv, int8_t *L) {
    int n = nb[0], gi = -1;
    float best = FLT_MAX;
    for (int j = 1; j <= n; ++j) {
        const int8_t *pg = grid + nb[j] * dim;
        float d2 = 0;
        for (int i = 0; i < dim; ++i) {
            float q = lv[(pg[i] - 1) / 2];
            float diff = scale * q - xval[i];
            d2 += w[i] * diff * diff;
        }
        if (d2 < best) { best = d2; gi = nb[j]; }
    }
    if (gi < 0) gi = nb[1];  /* all errors inf/NaN (ggml aborts there) */
    for (int i = 0; i < dim; ++i) L[i] = (int8_t)((grid[gi * dim + i] - 1) / 2);
    return gi;
}
static const float GRID_LEVELS[8] = {1, 3, 5, 7, 9, 11, 13, 15};

/* a grid's tables (ggml's iq3xs_init_impl): the points' values 2l + 1; code (4 levels, 12 bits)
 * -> grid index, or -1 - offset into nb; per code off the grid, nb holds a count and the
 * neighbours' indices */
typedef struct {
    int8_t grid[512][4];
    int map[4096];
    uint16_t *nb;
    volatile int ready;
} iq3_tables;
static iq3_tables IQ3T[2];  /* 0: IQ3_XXS (256 points), 1: IQ3_S (512) */

/* The neighbours of a code off the grid: the grid points at the nwant smallest squared
 * distances (2 for 256 points, 3 for 512), ordered by (distance, index) as ggml's qsort of
 * (d2, index) pairs orders them. Returns 0, or -4 when out of memory. */
static int iq3_init(int which) {
    iq3_tables *t = &IQ3T[which];
    if (t->ready) return 0;
    int rc = 0;
#pragma omp critical(hz_iq3_init)
    if (!t->ready) {
        const uint16_t *kg = which ? IQ3S_KGRID : IQ3XXS_KGRID;
        int ng = which ? 512 : 256, nwant = which ? 3 : 2;
        for (int k = 0; k < ng; ++k)
            for (int i = 0; i < 4; ++i) t->grid[k][i] = (int8_t)(2 * ((kg[k] >> (3 * i)) & 7) + 1);
        for (int u = 0; u < 4096; ++u) t->map[u] = -1;
        for (int k = 0; k < ng; ++k) t->map[kg[k]] = k;
        rc = grid_neighbours(&t->grid[0][0], 4, ng, 3, 4096, nwant, t->map, &t->nb);
        if (rc == 0) t->ready = 1;
    }
    return rc;
}

/* ggml's iq3_find_best_neighbour: the neighbour with the least weighted squared error */
static int iq3_best_neighbour(const iq3_tables *t, const uint16_t *nb, const float *xval, const float *w,
                              float scale, int8_t *L) {
    return grid_best_neighbour(&t->grid[0][0], 4, nb, xval, w, scale, GRID_LEVELS, L);
}

static inline int iq3_code(const int8_t *L) { return L[0] | (L[1] << 3) | (L[2] << 6) | (L[3] << 9); }

static void iq3_xxs_block(const float *xbl, uint8_t *y, const float *qw) {
    const iq3_tables *t = &IQ3T[0];
    const int kmax = 8;
    float scales[8], weight[32], xval[32], waux[32], max_scale = 0;
    int8_t L[32], Laux[32];
    int on[8], on_aux[8];
    uint8_t signs[4], q3[64];
    uint32_t sas[8];
    memset(q3, 0, sizeof q3);
    memset(sas, 0, sizeof sas);
    float sumx2 = 0;
    for (int i = 0; i < QK; ++i) sumx2 += xbl[i] * xbl[i];
    float sigma2 = 2 * sumx2 / QK;
    for (int ib = 0; ib < 8; ++ib) {
        const float *xb = xbl + 32 * ib;
        if (qw) for (int i = 0; i < 32; ++i) weight[i] = qw[32 * ib + i] * sqrtf(sigma2 + xb[i] * xb[i]);
        else for (int i = 0; i < 32; ++i) weight[i] = xb[i] * xb[i];
        for (int i = 0; i < 32; ++i) waux[i] = sqrtf(weight[i]);
        for (int k = 0; k < 4; ++k) {
            int nflip = 0;
            uint8_t sg = 0;
            for (int i = 0; i < 8; ++i) {
                if (xb[8 * k + i] >= 0) xval[8 * k + i] = xb[8 * k + i];
                else { xval[8 * k + i] = -xb[8 * k + i]; ++nflip; sg |= (uint8_t)(1 << i); }
            }
            if (nflip % 2) {  /* odd: flip the value that costs least, keeping an even count */
                int imin = 0;
                float mn = weight[8 * k] * xb[8 * k] * xb[8 * k];
                for (int i = 1; i < 8; ++i) {
                    float ax = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i];
                    if (ax < mn) { mn = ax; imin = i; }
                }
                xval[8 * k + imin] = -xval[8 * k + imin];
                sg ^= (uint8_t)(1 << imin);
            }
            signs[k] = sg & 127;
        }
        float mx = xval[0];
        for (int i = 1; i < 32; ++i) mx = mx > xval[i] ? mx : xval[i];
        memset(L, 0, 32);
        if (mx < 1e-8f) { scales[ib] = 0; continue; }
        float best = 0, scale = mx / (2 * kmax - 1);
        for (int k = 0; k < 8; ++k) on[k] = 1;
        for (int is = -15; is <= 15; ++is) {
            float id = (2 * kmax - 1 + is * 0.2f) / mx, this_scale = 1 / id;
            for (int k = 0; k < 8; ++k) {
                for (int i = 0; i < 4; ++i) Laux[4 * k + i] = (int8_t)clampi(rnd(0.5f * (id * xval[4 * k + i] - 1)), 0, kmax - 1);
                int u = iq3_code(Laux + 4 * k);
                on_aux[k] = t->map[u] >= 0;
                if (!on_aux[k])
                    iq3_best_neighbour(t, t->nb - t->map[u] - 1, xval + 4 * k, waux + 4 * k, this_scale, Laux + 4 * k);
            }
            float sumqx = 0, sumq2 = 0;
            for (int i = 0; i < 32; ++i) {
                float w = weight[i], q = 2 * Laux[i] + 1;
                sumqx += w * xval[i] * q;
                sumq2 += w * q * q;
            }
            if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
                scale = sumqx / sumq2;
                best = scale * sumqx;
                memcpy(L, Laux, 32);
                memcpy(on, on_aux, sizeof on);
            }
        }
        int n_off = 0;
        for (int k = 0; k < 8; ++k) n_off += !on[k];
        if (n_off > 0 && scale > 0) {  /* re-round the groups that went to a neighbour at the final scale */
            float id = 1 / scale;
            for (int k = 0; k < 8; ++k) {
                if (on[k]) continue;
                int8_t l4[4];
                for (int i = 0; i < 4; ++i) l4[i] = (int8_t)clampi(rnd(0.5f * (id * xval[4 * k + i] - 1)), 0, kmax - 1);
                int u = iq3_code(l4), gi = t->map[u];
                if (gi < 0) gi = iq3_best_neighbour(t, t->nb - gi - 1, xval + 4 * k, waux + 4 * k, scale, L + 4 * k);
                for (int i = 0; i < 4; ++i) L[4 * k + i] = (int8_t)((t->grid[gi][i] - 1) / 2);
            }
            float sumqx = 0, sumq2 = 0;
            for (int i = 0; i < 32; ++i) {
                float w = weight[i], q = 2 * L[i] + 1;
                sumqx += w * xval[i] * q;
                sumq2 += w * q * q;
            }
            if (sumq2 > 0) scale = sumqx / sumq2;
        }
        if (scale < 0) {
            scale = -scale;
            for (int k = 0; k < 4; ++k) signs[k] = (uint8_t)((~signs[k]) & 127);
        }
        for (int k = 0; k < 8; ++k) {
            int gi = t->map[iq3_code(L + 4 * k)];
            q3[8 * ib + k] = (uint8_t)(gi < 0 ? 0 : gi);  /* always on the grid here */
        }
        sas[ib] = (uint32_t)signs[0] | ((uint32_t)signs[1] << 7) | ((uint32_t)signs[2] << 14) | ((uint32_t)signs[3] << 21);
        scales[ib] = scale;
        max_scale = max_scale > scale ? max_scale : scale;
    }
    if (!max_scale) { memset(y, 0, 98); return; }
    float d = max_scale / 31;
    put_half(y, d * 1.0125f);
    float id = 1 / d;
    for (int ib = 0; ib < 8; ++ib) {
        int l = clampi(rnd(0.5f * (id * scales[ib] - 1)), 0, 15);
        sas[ib] |= (uint32_t)l << 28;
    }
    memcpy(y + 2, q3, 64);
    for (int ib = 0; ib < 8; ++ib)
        for (int b = 0; b < 4; ++b) y[66 + 4 * ib + b] = (uint8_t)(sas[ib] >> (8 * b));
}

/* IQ3_S (ggml's quantize_row_iq3_s_impl, grid size 512, groups of 32). Layout (block_iq3_s,
 * 110 bytes): fp16 d; qs[64] low 8 bits of the grid indices; qh[8] their 9th bits (group ib, bit
 * k); signs[32] (8 bits per 8 values); scales[4] two 4-bit group scales per byte. As in ggml, a
 * group whose values are all zero leaves the qs and signs cursors where they are (the following
 * groups' indices and signs move up; qh does not). */
static void iq3_s_block(const float *xbl, uint8_t *y, const float *qw) {
    const iq3_tables *t = &IQ3T[1];
    const int kmax = 8;
    float scales[8], weight[32], xval[32], waux[32], max_scale = 0;
    int8_t L[32], Laux[32];
    int on[8], on_aux[8];
    uint8_t bsg[4];
    memset(y, 0, 110);
    uint8_t *qs = y + 2, *qh = y + 66, *signs = y + 74, *sc = y + 106;
    float sumx2 = 0;
    for (int i = 0; i < QK; ++i) sumx2 += xbl[i] * xbl[i];
    float sigma2 = 2 * sumx2 / QK;
    for (int ib = 0; ib < 8; ++ib) {
        const float *xb = xbl + 32 * ib;
        if (qw) for (int i = 0; i < 32; ++i) weight[i] = qw[32 * ib + i] * sqrtf(sigma2 + xb[i] * xb[i]);
        else for (int i = 0; i < 32; ++i) weight[i] = xb[i] * xb[i];
        for (int i = 0; i < 32; ++i) waux[i] = sqrtf(weight[i]);
        for (int k = 0; k < 4; ++k) {
            uint8_t sg = 0;
            for (int i = 0; i < 8; ++i) {
                if (xb[8 * k + i] >= 0) xval[8 * k + i] = xb[8 * k + i];
                else { xval[8 * k + i] = -xb[8 * k + i]; sg |= (uint8_t)(1 << i); }
            }
            bsg[k] = sg;
        }
        float mx = xval[0];
        for (int i = 1; i < 32; ++i) mx = mx > xval[i] ? mx : xval[i];
        memset(L, 0, 32);
        if (!mx) { scales[ib] = 0; continue; }
        float best = 0, scale = mx / (2 * kmax - 1);
        for (int k = 0; k < 8; ++k) on[k] = 0;
        for (int is = -9; is <= 9; ++is) {
            float id = (2 * kmax - 1 + is * 0.2f) / mx, this_scale = 1 / id;
            for (int k = 0; k < 8; ++k) {
                for (int i = 0; i < 4; ++i) Laux[4 * k + i] = (int8_t)clampi(rnd(0.5f * (id * xval[4 * k + i] - 1)), 0, kmax - 1);
                int u = iq3_code(Laux + 4 * k);
                on_aux[k] = t->map[u] >= 0;
                if (!on_aux[k])
                    iq3_best_neighbour(t, t->nb - t->map[u] - 1, xval + 4 * k, waux + 4 * k, this_scale, Laux + 4 * k);
            }
            float sumqx = 0, sumq2 = 0;
            for (int i = 0; i < 32; ++i) {
                float w = weight[i], q = 2 * Laux[i] + 1;
                sumqx += w * xval[i] * q;
                sumq2 += w * q * q;
            }
            if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
                scale = sumqx / sumq2;
                best = scale * sumqx;
                memcpy(L, Laux, 32);
                memcpy(on, on_aux, sizeof on);
            }
        }
        int n_off = 0;
        for (int k = 0; k < 8; ++k) n_off += !on[k];
        if (n_off > 0 && scale > 0) {  /* re-round every group of 4 at the final scale */
            float id = 1 / scale;
            for (int k = 0; k < 8; ++k) {
                int8_t l4[4];
                for (int i = 0; i < 4; ++i) l4[i] = (int8_t)clampi(rnd(0.5f * (id * xval[4 * k + i] - 1)), 0, kmax - 1);
                int u = iq3_code(l4), gi = t->map[u];
                if (gi < 0) gi = iq3_best_neighbour(t, t->nb - gi - 1, xval + 4 * k, waux + 4 * k, scale, L + 4 * k);
                for (int i = 0; i < 4; ++i) L[4 * k + i] = (int8_t)((t->grid[gi][i] - 1) / 2);
            }
            float sumqx = 0, sumq2 = 0;
            for (int i = 0; i < 32; ++i) {
                float w = weight[i], q = 2 * L[i] + 1;
                sumqx += w * xval[i] * q;
                sumq2 += w * q * q;
            }
            if (sumq2 > 0) scale = sumqx / sumq2;
        }
        if (scale < 0) {
            scale = -scale;
            for (int k = 0; k < 4; ++k) bsg[k] = (uint8_t)~bsg[k];
        }
        for (int k = 0; k < 8; ++k) {
            int gi = t->map[iq3_code(L + 4 * k)];
            if (gi < 0) gi = 0;  /* always on the grid here */
            qs[k] = (uint8_t)(gi & 255);
            qh[(ib * 8 + k) / 8] |= (uint8_t)((gi >> 8) << ((ib * 8 + k) % 8));
        }
        qs += 8;
        memcpy(signs, bsg, 4);
        signs += 4;
        scales[ib] = scale;
        max_scale = max_scale > scale ? max_scale : scale;
    }
    if (!max_scale) return;
    float d = max_scale / 31;
    put_half(y, d * 1.033f);
    float id = 1 / d;
    for (int ib = 0; ib < 8; ib += 2) {
        int l1 = clampi(rnd(0.5f * (id * scales[ib] - 1)), 0, 15), l2 = clampi(rnd(0.5f * (id * scales[ib + 1] - 1)), 0, 15);
        sc[ib / 2] = (uint8_t)(l1 | (l2 << 4));
    }
}

/* ---- IQ2_XXS and IQ2_XS (ggml's quantize_row_iq2_xxs_impl / _xs_impl; weights required) ----
 * Layout (block_iq2_xxs, 66 bytes): fp16 d; per group of 32 two little-endian uint32: four grid
 * indices (one per 8 values), then four 7-bit sign masks (8th sign: the parity) and a 4-bit
 * scale in bits 28..31. Grid points: 8 two-bit levels l (value 2l + 1), level i in bits 2i. */
static const uint16_t IQ2XXS_KGRID[256] = {
        0,     2,     5,     8,    10,    17,    20,    32,    34,    40,    42,    65,    68,    80,    88,    97,
      100,   128,   130,   138,   162,   257,   260,   272,   277,   320,   388,   408,   512,   514,   546,   642,
     1025,  1028,  1040,  1057,  1060,  1088,  1090,  1096,  1120,  1153,  1156,  1168,  1188,  1280,  1282,  1288,
     1312,  1350,  1385,  1408,  1425,  1545,  1552,  1600,  1668,  1700,  2048,  2053,  2056,  2068,  2088,  2113,
     2116,  2128,  2130,  2184,  2308,  2368,  2562,  2580,  4097,  4100,  4112,  4129,  4160,  4192,  4228,  4240,
     4245,  4352,  4360,  4384,  4432,  4442,  4480,  4644,  4677,  5120,  5128,  5152,  5157,  5193,  5248,  5400,
     5474,  5632,  5654,  6145,  6148,  6160,  6208,  6273,  6400,  6405,  6560,  6737,  8192,  8194,  8202,  8260,
     8289,  8320,  8322,  8489,  8520,  8704,  8706,  9217,  9220,  9232,  9280,  9302,  9472,  9537,  9572,  9872,
    10248, 10272, 10388, 10820, 16385, 16388, 16400, 16408, 16417, 16420, 16448, 16456, 16470, 16480, 16513, 16516,
    16528, 16640, 16672, 16737, 16768, 16773, 16897, 16912, 16968, 16982, 17000, 17408, 17416, 17440, 17536, 17561,
    17682, 17700, 17920, 18433, 18436, 18448, 18496, 18501, 18688, 18776, 18785, 18818, 19013, 19088, 20480, 20488,
    20497, 20505, 20512, 20608, 20616, 20740, 20802, 20900, 21137, 21648, 21650, 21770, 22017, 22100, 22528, 22545,
    22553, 22628, 22848, 23048, 24580, 24592, 24640, 24680, 24832, 24917, 25112, 25184, 25600, 25605, 25872, 25874,
    25988, 26690, 32768, 32770, 32778, 32833, 32898, 33028, 33048, 33088, 33297, 33793, 33796, 33808, 33813, 33856,
    33888, 34048, 34118, 34196, 34313, 34368, 34400, 34818, 35076, 35345, 36868, 36880, 36900, 36928, 37025, 37142,
    37248, 37445, 37888, 37922, 37956, 38225, 39041, 39200, 40962, 41040, 41093, 41225, 41472, 42008, 43088, 43268,
};
#define IQ2_MAP 43692  /* codes of 8 levels in 0..2 fit below 2 * (4^8 - 1) / 3 + 2 */
/* IQ2_XS's 512 grid points, the same encoding */
static const uint16_t IQ2XS_KGRID[512] = {
        0,     2,     5,     8,    10,    17,    20,    22,    25,    32,    34,    37,    40,    65,    68,    70,
       73,    80,    82,    85,    88,    97,   100,   128,   130,   133,   136,   145,   148,   153,   160,   257,
      260,   262,   265,   272,   274,   277,   280,   282,   289,   292,   320,   322,   325,   328,   337,   340,
      352,   360,   385,   388,   400,   512,   514,   517,   520,   529,   532,   544,   577,   580,   592,   597,
      640,   650,  1025,  1028,  1030,  1033,  1040,  1042,  1045,  1048,  1057,  1060,  1088,  1090,  1093,  1096,
     1105,  1108,  1110,  1120,  1153,  1156,  1168,  1280,  1282,  1285,  1288,  1297,  1300,  1312,  1345,  1348,
     1360,  1377,  1408,  1537,  1540,  1552,  1574,  1600,  1602,  1668,  2048,  2050,  2053,  2056,  2058,  2065,
     2068,  2080,  2085,  2113,  2116,  2128,  2136,  2176,  2208,  2218,  2305,  2308,  2320,  2368,  2433,  2441,
     2560,  2592,  2600,  2710,  2720,  4097,  4100,  4102,  4105,  4112,  4114,  4117,  4120,  4129,  4132,  4160,
     4162,  4165,  4168,  4177,  4180,  4192,  4202,  4225,  4228,  4240,  4352,  4354,  4357,  4360,  4369,  4372,
     4384,  4417,  4420,  4432,  4480,  4500,  4502,  4609,  4612,  4614,  4624,  4672,  4704,  5120,  5122,  5125,
     5128,  5137,  5140,  5152,  5185,  5188,  5193,  5200,  5220,  5248,  5377,  5380,  5392,  5440,  5632,  5652,
     5705,  6145,  6148,  6160,  6162,  6208,  6228,  6278,  6400,  6405,  6502,  6737,  6825,  8192,  8194,  8197,
     8200,  8202,  8209,  8212,  8224,  8257,  8260,  8272,  8320,  8352,  8449,  8452,  8464,  8512,  8520,  8549,
     8704,  8738,  8832,  8872,  9217,  9220,  9232,  9257,  9280,  9472,  9537,  9554,  9625,  9729,  9754,  9894,
    10240, 10248, 10250, 10272, 10325, 10376, 10402, 10600, 10640, 10760, 10784, 10882, 10888, 10890, 16385, 16388,
    16390, 16393, 16400, 16402, 16405, 16408, 16417, 16420, 16448, 16450, 16453, 16456, 16458, 16465, 16468, 16480,
    16485, 16513, 16516, 16528, 16640, 16642, 16645, 16648, 16657, 16660, 16672, 16705, 16708, 16720, 16768, 16773,
    16802, 16897, 16900, 16912, 16914, 16937, 16960, 17408, 17410, 17413, 17416, 17425, 17428, 17433, 17440, 17473,
    17476, 17488, 17536, 17556, 17665, 17668, 17680, 17700, 17728, 17818, 17920, 17930, 17988, 18000, 18433, 18436,
    18448, 18496, 18501, 18516, 18530, 18688, 18705, 18756, 18768, 18793, 18948, 20480, 20482, 20485, 20488, 20497,
    20500, 20512, 20520, 20545, 20548, 20560, 20608, 20737, 20740, 20752, 20757, 20800, 20802, 20992, 21060, 21162,
    21505, 21508, 21520, 21537, 21568, 21600, 21633, 21665, 21760, 21768, 21888, 21896, 22049, 22120, 22177, 22528,
    22548, 22593, 22608, 22681, 22810, 22848, 22850, 23173, 24577, 24580, 24592, 24640, 24660, 24674, 24710, 24745,
    24832, 25124, 25162, 25234, 25600, 25622, 25872, 25920, 25925, 26020, 26625, 26730, 26917, 27142, 27220, 27234,
    32768, 32770, 32773, 32776, 32785, 32788, 32800, 32810, 32833, 32836, 32848, 32896, 32898, 32936, 32938, 33025,
    33028, 33030, 33040, 33088, 33105, 33113, 33280, 33312, 33408, 33410, 33440, 33448, 33793, 33796, 33808, 33810,
    33813, 33856, 33888, 33929, 34048, 34116, 34213, 34328, 34410, 34816, 34824, 34853, 34906, 34944, 34946, 34984,
    35078, 35362, 35456, 35464, 35478, 35496, 36865, 36868, 36880, 36928, 36950, 36996, 37120, 37154, 37220, 37462,
    37513, 37888, 37893, 37956, 37968, 37976, 38185, 38288, 38290, 38465, 38993, 39078, 39241, 39445, 39520, 40960,
    40962, 40968, 40970, 40992, 41002, 41120, 41297, 41305, 41382, 41472, 41474, 41480, 41514, 41600, 41632, 42048,
    42133, 42597, 42648, 43018, 43040, 43042, 43048, 43168, 43176, 43268, 43396, 43398, 43560, 43562, 43665, 43690,
};
/* IQ2_S's 1024 grid points, the same encoding */
static const uint16_t IQ2S_KGRID[1024] = {
        0,     2,     5,     8,    10,    17,    20,    22,    25,    32,    34,    37,    40,    65,    68,    70,
       73,    80,    82,    85,    88,    97,   100,   102,   105,   128,   130,   133,   136,   145,   148,   160,
      165,   170,   257,   260,   262,   265,   272,   274,   277,   280,   289,   292,   320,   322,   325,   328,
      337,   340,   342,   345,   352,   357,   360,   385,   388,   400,   402,   405,   417,   420,   512,   514,
      517,   520,   529,   532,   544,   554,   577,   580,   582,   585,   592,   597,   640,   645,   650,   660,
      674,  1025,  1028,  1030,  1033,  1040,  1042,  1045,  1048,  1057,  1060,  1062,  1065,  1088,  1090,  1093,
     1096,  1098,  1105,  1108,  1110,  1113,  1120,  1122,  1125,  1153,  1156,  1158,  1161,  1168,  1173,  1176,
     1185,  1188,  1280,  1282,  1285,  1288,  1290,  1297,  1300,  1302,  1305,  1312,  1317,  1320,  1345,  1348,
     1350,  1353,  1360,  1362,  1365,  1368,  1377,  1380,  1408,  1410,  1413,  1416,  1425,  1428,  1440,  1537,
     1540,  1542,  1545,  1552,  1557,  1600,  1605,  1608,  1617,  1620,  1632,  1665,  1668,  1680,  2048,  2050,
     2053,  2056,  2065,  2068,  2070,  2073,  2080,  2085,  2090,  2113,  2116,  2118,  2121,  2128,  2130,  2133,
     2136,  2145,  2148,  2176,  2181,  2196,  2218,  2305,  2308,  2320,  2322,  2325,  2328,  2337,  2368,  2373,
     2376,  2385,  2388,  2400,  2433,  2448,  2560,  2577,  2580,  2594,  2600,  2602,  2640,  2713,  4097,  4100,
     4102,  4105,  4112,  4114,  4117,  4120,  4129,  4132,  4134,  4160,  4162,  4165,  4168,  4177,  4180,  4182,
     4185,  4192,  4194,  4197,  4200,  4225,  4228,  4230,  4240,  4245,  4248,  4257,  4260,  4352,  4354,  4357,
     4360,  4362,  4369,  4372,  4374,  4377,  4384,  4386,  4389,  4392,  4417,  4420,  4422,  4425,  4432,  4434,
     4437,  4440,  4449,  4452,  4480,  4482,  4485,  4488,  4497,  4500,  4609,  4612,  4617,  4624,  4629,  4641,
     4644,  4672,  4677,  4689,  4692,  4737,  4740,  4752,  5120,  5122,  5125,  5128,  5137,  5140,  5142,  5145,
     5152,  5157,  5160,  5185,  5188,  5190,  5193,  5200,  5202,  5205,  5208,  5217,  5220,  5248,  5250,  5253,
     5256,  5265,  5268,  5280,  5377,  5380,  5382,  5385,  5392,  5394,  5397,  5400,  5409,  5412,  5440,  5442,
     5445,  5448,  5457,  5460,  5472,  5505,  5508,  5520,  5632,  5637,  5640,  5649,  5652,  5664,  5697,  5700,
     5712,  5760,  5802,  6145,  6148,  6150,  6153,  6160,  6165,  6168,  6177,  6208,  6210,  6213,  6216,  6225,
     6228,  6240,  6273,  6276,  6400,  6402,  6405,  6408,  6417,  6420,  6432,  6465,  6468,  6480,  6505,  6562,
     6660,  6672,  6720,  6742,  8192,  8194,  8197,  8200,  8209,  8212,  8214,  8217,  8224,  8229,  8234,  8257,
     8260,  8272,  8274,  8277,  8292,  8320,  8330,  8340,  8362,  8449,  8452,  8464,  8466,  8469,  8481,  8512,
     8514,  8517,  8529,  8532,  8544,  8577,  8580,  8592,  8704,  8714,  8738,  8744,  8746,  8772,  8784,  8840,
     8842,  8872,  9217,  9220,  9222,  9225,  9232,  9237,  9240,  9249,  9252,  9280,  9282,  9285,  9288,  9297,
     9300,  9312,  9345,  9348,  9360,  9472,  9477,  9480,  9489,  9492,  9504,  9537,  9540,  9552,  9574,  9600,
     9729,  9732,  9744,  9792,  9817, 10240, 10245, 10257, 10260, 10305, 10308, 10320, 10378, 10410, 10497, 10500,
    10512, 10645, 10762, 10786, 10852, 10888, 10890, 16385, 16388, 16390, 16393, 16400, 16402, 16405, 16408, 16410,
    16417, 16420, 16422, 16448, 16450, 16453, 16456, 16458, 16465, 16468, 16470, 16473, 16480, 16482, 16485, 16513,
    16516, 16528, 16533, 16536, 16545, 16548, 16640, 16642, 16645, 16648, 16657, 16660, 16662, 16665, 16672, 16674,
    16677, 16705, 16708, 16710, 16713, 16720, 16722, 16725, 16728, 16737, 16740, 16768, 16770, 16773, 16776, 16785,
    16788, 16800, 16897, 16900, 16912, 16914, 16917, 16920, 16932, 16960, 16965, 16968, 16977, 16980, 16992, 17025,
    17028, 17408, 17410, 17413, 17416, 17418, 17425, 17428, 17430, 17433, 17440, 17442, 17445, 17448, 17473, 17476,
    17478, 17481, 17488, 17490, 17493, 17496, 17505, 17508, 17536, 17538, 17541, 17544, 17553, 17556, 17568, 17665,
    17668, 17670, 17673, 17680, 17682, 17685, 17688, 17697, 17700, 17728, 17730, 17733, 17736, 17745, 17748, 17760,
    17770, 17793, 17796, 17808, 17920, 17922, 17925, 17928, 17937, 17940, 17952, 17985, 17988, 18000, 18048, 18085,
    18433, 18436, 18441, 18448, 18450, 18453, 18456, 18465, 18468, 18496, 18498, 18501, 18504, 18513, 18516, 18528,
    18564, 18576, 18688, 18690, 18693, 18696, 18705, 18708, 18720, 18753, 18756, 18768, 18816, 18838, 18945, 18948,
    18960, 19008, 20480, 20482, 20485, 20488, 20497, 20500, 20502, 20505, 20512, 20514, 20517, 20520, 20545, 20548,
    20550, 20553, 20560, 20562, 20565, 20568, 20577, 20580, 20608, 20610, 20613, 20616, 20625, 20628, 20737, 20740,
    20742, 20745, 20752, 20754, 20757, 20760, 20769, 20772, 20800, 20802, 20805, 20808, 20817, 20820, 20832, 20865,
    20868, 20880, 20992, 20997, 21000, 21009, 21012, 21024, 21057, 21060, 21072, 21097, 21120, 21505, 21508, 21510,
    21513, 21520, 21522, 21525, 21528, 21537, 21540, 21568, 21570, 21573, 21576, 21585, 21588, 21600, 21633, 21636,
    21648, 21760, 21762, 21765, 21768, 21777, 21780, 21792, 21825, 21828, 21840, 21888, 22017, 22020, 22032, 22054,
    22080, 22528, 22530, 22533, 22536, 22545, 22548, 22560, 22593, 22596, 22608, 22618, 22656, 22785, 22788, 22800,
    22848, 23040, 23065, 23173, 23208, 24577, 24580, 24582, 24592, 24594, 24597, 24600, 24609, 24612, 24640, 24645,
    24648, 24657, 24660, 24672, 24708, 24720, 24832, 24834, 24837, 24840, 24849, 24852, 24864, 24897, 24900, 24912,
    24960, 24985, 25092, 25104, 25152, 25174, 25249, 25600, 25605, 25608, 25617, 25620, 25632, 25665, 25668, 25680,
    25728, 25857, 25860, 25872, 25920, 25930, 25960, 26002, 26112, 26260, 26625, 26628, 26640, 26725, 26776, 26880,
    26922, 27202, 27297, 32768, 32770, 32773, 32776, 32785, 32788, 32793, 32800, 32805, 32833, 32836, 32848, 32850,
    32853, 32856, 32865, 32896, 32901, 32913, 32916, 33025, 33028, 33033, 33040, 33042, 33045, 33048, 33057, 33060,
    33088, 33090, 33093, 33096, 33105, 33108, 33153, 33156, 33168, 33193, 33280, 33285, 33290, 33297, 33300, 33345,
    33348, 33360, 33793, 33796, 33798, 33801, 33808, 33810, 33813, 33816, 33825, 33856, 33858, 33861, 33864, 33873,
    33876, 33888, 33921, 33924, 33936, 34048, 34050, 34053, 34056, 34065, 34068, 34080, 34113, 34116, 34128, 34176,
    34186, 34305, 34308, 34320, 34345, 34368, 34816, 34821, 34833, 34836, 34881, 34884, 34896, 34978, 35073, 35076,
    35136, 35173, 35362, 35416, 35418, 35458, 35490, 36865, 36868, 36873, 36880, 36882, 36885, 36888, 36900, 36928,
    36930, 36933, 36936, 36945, 36948, 36960, 36993, 36996, 37008, 37120, 37125, 37137, 37140, 37185, 37188, 37200,
    37210, 37377, 37380, 37392, 37440, 37542, 37888, 37890, 37893, 37896, 37905, 37908, 37920, 37953, 37956, 37968,
    38016, 38038, 38145, 38148, 38160, 38208, 38296, 38305, 38400, 38470, 38500, 38913, 38916, 38928, 38950, 38976,
    39081, 39168, 39241, 39250, 39568, 40960, 40965, 40970, 40980, 40994, 41002, 41025, 41028, 41040, 41122, 41130,
    41280, 41317, 41474, 41482, 41506, 41512, 41514, 41602, 41608, 41610, 41640, 41985, 41988, 42000, 42048, 42121,
    42148, 42240, 42265, 42577, 43018, 43048, 43170, 43348, 43398, 43528, 43530, 43552, 43554, 43560, 43656, 43690,
};
/* IQ1_S / IQ1_M's 2048 grid points (ggml's kgrid_1bit_2048), the same encoding with levels 0..2:
 * the stored value is level - 1 (+ the delta) */
static const uint16_t IQ1_KGRID[2048] = {
        0,     2,     5,     8,    10,    17,    21,    32,    34,    40,    42,    69,    81,    84,    86,   101,
      128,   130,   136,   138,   149,   160,   162,   168,   170,   260,   261,   273,   276,   278,   281,   282,
      293,   321,   326,   329,   338,   341,   346,   353,   356,   358,   360,   389,   401,   404,   406,   421,
      512,   514,   520,   522,   533,   544,   546,   552,   554,   581,   593,   601,   612,   617,   640,   642,
      648,   650,   657,   661,   665,   672,   674,   680,   682,  1041,  1044,  1046,  1061,  1089,  1097,  1109,
     1114,  1124,  1125,  1169,  1177,  1189,  1281,  1284,  1285,  1286,  1301,  1304,  1306,  1321,  1344,  1349,
     1354,  1360,  1361,  1364,  1365,  1366,  1369,  1376,  1378,  1381,  1384,  1386,  1409,  1425,  1429,  1432,
     1434,  1441,  1444,  1445,  1446,  1449,  1556,  1561,  1601,  1604,  1616,  1618,  1621,  1624,  1632,  1633,
     1638,  1641,  1669,  1681,  1684,  1689,  2048,  2050,  2056,  2058,  2069,  2080,  2082,  2088,  2090,  2117,
     2129,  2134,  2149,  2176,  2178,  2184,  2186,  2197,  2208,  2210,  2216,  2218,  2309,  2321,  2324,  2329,
     2340,  2341,  2369,  2384,  2385,  2389,  2401,  2404,  2409,  2449,  2452,  2454,  2457,  2469,  2560,  2562,
     2568,  2570,  2581,  2592,  2594,  2600,  2602,  2629,  2641,  2649,  2657,  2661,  2688,  2690,  2693,  2696,
     2698,  2709,  2720,  2722,  2728,  2730,  4112,  4113,  4116,  4121,  4132,  4133,  4161,  4164,  4176,  4181,
     4184,  4193,  4196,  4197,  4201,  4241,  4244,  4246,  4257,  4261,  4353,  4356,  4358,  4361,  4368,  4370,
     4373,  4376,  4385,  4388,  4393,  4421,  4426,  4432,  4433,  4434,  4436,  4437,  4438,  4441,  4448,  4453,
     4484,  4498,  4501,  4513,  4516,  4625,  4628,  4630,  4645,  4672,  4678,  4681,  4690,  4693,  4696,  4698,
     4708,  4710,  4741,  4753,  4756,  4758,  4773,  5121,  5126,  5129,  5140,  5141,  5144,  5145,  5153,  5158,
     5185,  5189,  5190,  5192,  5194,  5201,  5204,  5205,  5206,  5209,  5218,  5221,  5224,  5252,  5257,  5264,
     5268,  5269,  5272,  5273,  5274,  5281,  5284,  5285,  5289,  5378,  5381,  5386,  5393,  5396,  5397,  5398,
     5401,  5408,  5410,  5413,  5416,  5418,  5441,  5444,  5445,  5446,  5457,  5458,  5460,  5461,  5462,  5465,
     5466,  5473,  5476,  5477,  5478,  5481,  5504,  5506,  5508,  5509,  5512,  5514,  5520,  5521,  5524,  5525,
     5526,  5529,  5530,  5536,  5538,  5541,  5633,  5636,  5637,  5638,  5653,  5654,  5656,  5658,  5665,  5670,
     5696,  5698,  5700,  5701,  5704,  5706,  5713,  5717,  5718,  5720,  5721,  5729,  5732,  5733,  5736,  5737,
     5738,  5766,  5770,  5778,  5781,  5796,  5801,  6161,  6166,  6181,  6209,  6212,  6214,  6217,  6224,  6229,
     6232,  6234,  6240,  6241,  6244,  6246,  6249,  6277,  6289,  6292,  6309,  6416,  6418,  6421,  6426,  6433,
     6437,  6466,  6468,  6469,  6472,  6481,  6484,  6485,  6486,  6489,  6490,  6496,  6501,  6506,  6537,  6545,
     6546,  6549,  6552,  6561,  6566,  6569,  6665,  6678,  6692,  6694,  6724,  6726,  6729,  6736,  6738,  6741,
     6744,  6753,  6758,  6761,  6789,  6801,  6806,  6810,  8192,  8194,  8200,  8202,  8213,  8224,  8226,  8229,
     8232,  8234,  8261,  8273,  8281,  8289,  8293,  8320,  8322,  8328,  8330,  8341,  8352,  8354,  8357,  8360,
     8362,  8453,  8465,  8468,  8473,  8485,  8514,  8516,  8521,  8533,  8536,  8538,  8545,  8548,  8549,  8550,
     8581,  8592,  8598,  8601,  8613,  8705,  8712,  8714,  8721,  8725,  8736,  8738,  8744,  8746,  8773,  8785,
     8790,  8793,  8805,  8833,  8840,  8842,  8849,  8853,  8864,  8866,  8872,  8874,  9221,  9236,  9238,  9241,
     9253,  9284,  9285,  9286,  9289,  9298,  9301,  9304,  9306,  9318,  9349,  9361,  9364,  9369,  9377,  9381,
     9481,  9493,  9505,  9513,  9536,  9541,  9544,  9553,  9556,  9557,  9561,  9570,  9573,  9576,  9609,  9616,
     9620,  9621,  9624,  9626,  9633,  9636,  9638,  9641,  9733,  9744,  9746,  9753,  9765,  9793,  9801,  9813,
     9824,  9825,  9833,  9860,  9862,  9872,  9882, 10240, 10242, 10248, 10250, 10261, 10272, 10274, 10280, 10282,
    10309, 10321, 10324, 10341, 10368, 10370, 10376, 10378, 10400, 10402, 10408, 10410, 10505, 10513, 10516, 10521,
    10533, 10566, 10569, 10578, 10581, 10593, 10596, 10598, 10601, 10629, 10640, 10646, 10649, 10660, 10661, 10752,
    10754, 10760, 10762, 10784, 10786, 10792, 10794, 10821, 10833, 10838, 10841, 10853, 10880, 10882, 10888, 10890,
    10901, 10912, 10914, 10920, 10922, 16389, 16401, 16406, 16421, 16457, 16466, 16469, 16472, 16474, 16481, 16484,
    16486, 16532, 16537, 16545, 16550, 16640, 16641, 16644, 16646, 16649, 16658, 16661, 16662, 16664, 16666, 16673,
    16678, 16681, 16709, 16712, 16714, 16721, 16724, 16725, 16726, 16729, 16730, 16741, 16744, 16746, 16769, 16772,
    16774, 16784, 16786, 16789, 16800, 16801, 16802, 16901, 16913, 16916, 16918, 16933, 16961, 16978, 16981, 16986,
    16996, 17001, 17033, 17044, 17061, 17409, 17429, 17433, 17449, 17477, 17480, 17482, 17489, 17492, 17493, 17494,
    17505, 17506, 17509, 17512, 17514, 17537, 17542, 17545, 17552, 17554, 17557, 17568, 17569, 17577, 17665, 17666,
    17669, 17674, 17681, 17684, 17685, 17686, 17689, 17696, 17701, 17706, 17729, 17732, 17733, 17734, 17737, 17744,
    17745, 17748, 17749, 17750, 17752, 17753, 17761, 17764, 17765, 17766, 17769, 17794, 17796, 17797, 17800, 17809,
    17812, 17813, 17814, 17817, 17818, 17829, 17832, 17834, 17921, 17925, 17929, 17940, 17941, 17944, 17946, 17953,
    17956, 17961, 17984, 17986, 17989, 17992, 18000, 18001, 18002, 18005, 18006, 18009, 18018, 18021, 18024, 18049,
    18053, 18058, 18068, 18069, 18081, 18084, 18086, 18437, 18449, 18453, 18458, 18469, 18498, 18505, 18512, 18517,
    18520, 18529, 18532, 18534, 18537, 18565, 18577, 18580, 18582, 18585, 18597, 18689, 18693, 18694, 18698, 18704,
    18708, 18709, 18712, 18721, 18724, 18726, 18752, 18757, 18762, 18769, 18770, 18772, 18773, 18774, 18777, 18784,
    18786, 18789, 18790, 18794, 18822, 18825, 18834, 18837, 18838, 18840, 18849, 18852, 18854, 18857, 18966, 19012,
    19014, 19017, 19029, 19032, 19034, 19044, 19049, 19092, 19109, 20481, 20484, 20485, 20486, 20489, 20498, 20501,
    20506, 20513, 20516, 20521, 20544, 20549, 20552, 20561, 20564, 20565, 20566, 20569, 20581, 20584, 20614, 20617,
    20629, 20632, 20640, 20641, 20646, 20649, 20741, 20744, 20745, 20746, 20753, 20756, 20757, 20758, 20760, 20761,
    20768, 20773, 20774, 20776, 20778, 20801, 20804, 20805, 20806, 20809, 20816, 20817, 20818, 20820, 20821, 20822,
    20824, 20825, 20826, 20833, 20836, 20837, 20838, 20841, 20866, 20869, 20881, 20884, 20885, 20886, 20889, 20896,
    20901, 20906, 20993, 20998, 21010, 21013, 21018, 21025, 21028, 21058, 21061, 21066, 21073, 21076, 21077, 21078,
    21081, 21090, 21093, 21125, 21136, 21138, 21141, 21145, 21146, 21156, 21508, 21509, 21521, 21524, 21525, 21526,
    21528, 21529, 21537, 21541, 21544, 21546, 21569, 21572, 21573, 21574, 21577, 21578, 21584, 21585, 21588, 21589,
    21590, 21592, 21593, 21594, 21601, 21602, 21604, 21605, 21606, 21609, 21632, 21640, 21642, 21649, 21652, 21653,
    21654, 21657, 21665, 21668, 21669, 21674, 21761, 21762, 21764, 21765, 21766, 21769, 21776, 21777, 21778, 21780,
    21781, 21782, 21785, 21786, 21793, 21796, 21797, 21798, 21801, 21824, 21825, 21826, 21828, 21829, 21830, 21832,
    21833, 21840, 21841, 21842, 21844, 21845, 21846, 21848, 21849, 21850, 21856, 21857, 21860, 21861, 21862, 21864,
    21865, 21866, 21889, 21892, 21893, 21897, 21898, 21904, 21905, 21908, 21909, 21910, 21912, 21913, 21921, 21924,
    21925, 21926, 21929, 22016, 22017, 22018, 22020, 22022, 22024, 22025, 22033, 22036, 22037, 22040, 22041, 22048,
    22049, 22050, 22052, 22053, 22054, 22056, 22057, 22081, 22085, 22086, 22088, 22089, 22090, 22096, 22097, 22098,
    22100, 22101, 22102, 22104, 22105, 22106, 22113, 22116, 22117, 22121, 22146, 22149, 22150, 22152, 22153, 22154,
    22161, 22165, 22170, 22178, 22181, 22182, 22184, 22185, 22532, 22533, 22534, 22537, 22544, 22549, 22552, 22561,
    22570, 22597, 22600, 22602, 22609, 22612, 22613, 22614, 22616, 22617, 22624, 22626, 22628, 22629, 22658, 22665,
    22672, 22674, 22677, 22680, 22689, 22697, 22785, 22786, 22789, 22794, 22801, 22804, 22805, 22806, 22809, 22821,
    22849, 22852, 22853, 22854, 22857, 22864, 22865, 22866, 22868, 22869, 22870, 22872, 22873, 22874, 22881, 22884,
    22885, 22886, 22889, 22913, 22917, 22921, 22929, 22932, 22933, 22934, 22936, 22937, 22949, 23044, 23048, 23061,
    23066, 23072, 23077, 23078, 23081, 23109, 23112, 23113, 23121, 23125, 23126, 23128, 23129, 23138, 23141, 23144,
    23146, 23169, 23178, 23186, 23189, 23190, 23192, 23194, 23201, 24581, 24596, 24598, 24601, 24613, 24644, 24656,
    24661, 24662, 24664, 24666, 24673, 24676, 24678, 24681, 24705, 24726, 24741, 24833, 24836, 24838, 24841, 24850,
    24853, 24865, 24866, 24870, 24873, 24901, 24905, 24913, 24917, 24918, 24921, 24933, 24934, 24938, 24964, 24970,
    24978, 24981, 24993, 24998, 25001, 25105, 25110, 25113, 25152, 25153, 25158, 25173, 25174, 25176, 25184, 25221,
    25233, 25238, 25253, 25617, 25618, 25621, 25622, 25626, 25633, 25638, 25641, 25664, 25666, 25669, 25672, 25674,
    25681, 25684, 25685, 25686, 25689, 25690, 25696, 25698, 25701, 25732, 25733, 25737, 25744, 25746, 25748, 25749,
    25750, 25752, 25754, 25761, 25764, 25769, 25861, 25864, 25866, 25873, 25877, 25878, 25881, 25924, 25925, 25926,
    25929, 25936, 25937, 25940, 25941, 25942, 25945, 25953, 25956, 25957, 25958, 25961, 25990, 25993, 25994, 26001,
    26005, 26006, 26009, 26010, 26018, 26021, 26022, 26024, 26114, 26121, 26133, 26144, 26150, 26152, 26153, 26176,
    26181, 26184, 26186, 26193, 26196, 26197, 26198, 26200, 26202, 26208, 26213, 26216, 26240, 26242, 26245, 26250,
    26260, 26262, 26264, 26265, 26272, 26276, 26278, 26282, 26646, 26649, 26661, 26689, 26706, 26709, 26714, 26721,
    26729, 26757, 26769, 26776, 26790, 26881, 26884, 26896, 26901, 26913, 26916, 26918, 26921, 26944, 26945, 26949,
    26950, 26952, 26961, 26964, 26965, 26966, 26969, 26976, 26981, 26986, 27010, 27012, 27018, 27029, 27041, 27044,
    27045, 27049, 27153, 27158, 27160, 27201, 27204, 27209, 27216, 27221, 27224, 27226, 27236, 27237, 27241, 27270,
    27284, 27288, 27290, 27302, 32768, 32770, 32776, 32778, 32800, 32802, 32808, 32810, 32837, 32848, 32849, 32852,
    32854, 32857, 32869, 32896, 32898, 32904, 32906, 32917, 32928, 32930, 32936, 32938, 33029, 33041, 33044, 33046,
    33049, 33061, 33089, 33092, 33097, 33104, 33106, 33109, 33110, 33112, 33113, 33124, 33126, 33129, 33157, 33161,
    33172, 33174, 33177, 33189, 33280, 33282, 33288, 33290, 33301, 33312, 33314, 33320, 33322, 33361, 33364, 33369,
    33381, 33408, 33410, 33416, 33418, 33429, 33440, 33442, 33448, 33450, 33812, 33817, 33857, 33860, 33873, 33877,
    33882, 33889, 33892, 33897, 33940, 33945, 34049, 34057, 34066, 34069, 34074, 34086, 34089, 34112, 34113, 34117,
    34120, 34129, 34132, 34133, 34134, 34137, 34138, 34149, 34150, 34152, 34154, 34177, 34180, 34182, 34185, 34192,
    34194, 34197, 34200, 34214, 34321, 34326, 34329, 34341, 34369, 34372, 34377, 34378, 34384, 34389, 34393, 34394,
    34401, 34406, 34410, 34437, 34449, 34458, 34468, 34816, 34818, 34824, 34826, 34837, 34848, 34850, 34856, 34858,
    34881, 34885, 34897, 34900, 34905, 34917, 34921, 34944, 34946, 34952, 34954, 34965, 34976, 34978, 34984, 34986,
    35077, 35078, 35089, 35092, 35094, 35109, 35137, 35140, 35142, 35145, 35152, 35154, 35157, 35162, 35169, 35172,
    35205, 35222, 35225, 35237, 35328, 35330, 35336, 35338, 35349, 35360, 35362, 35368, 35370, 35397, 35409, 35412,
    35414, 35456, 35458, 35464, 35466, 35477, 35488, 35490, 35496, 35498, 36869, 36881, 36886, 36888, 36889, 36901,
    36929, 36934, 36937, 36949, 36952, 36954, 36969, 36970, 36997, 37009, 37012, 37014, 37017, 37029, 37121, 37124,
    37126, 37129, 37136, 37141, 37144, 37146, 37153, 37156, 37158, 37161, 37184, 37189, 37200, 37201, 37204, 37205,
    37206, 37209, 37218, 37221, 37252, 37254, 37266, 37269, 37272, 37281, 37284, 37286, 37289, 37381, 37393, 37396,
    37401, 37413, 37444, 37446, 37449, 37456, 37458, 37461, 37464, 37478, 37481, 37509, 37524, 37526, 37545, 37889,
    37892, 37894, 37904, 37909, 37912, 37926, 37952, 37962, 37969, 37972, 37973, 37974, 37976, 37977, 37984, 37985,
    37986, 37989, 38020, 38022, 38034, 38036, 38037, 38040, 38049, 38057, 38144, 38149, 38152, 38154, 38160, 38161,
    38164, 38165, 38166, 38169, 38177, 38181, 38185, 38186, 38209, 38212, 38213, 38214, 38217, 38224, 38225, 38226,
    38228, 38229, 38230, 38232, 38233, 38234, 38241, 38244, 38245, 38246, 38249, 38273, 38277, 38280, 38289, 38290,
    38292, 38293, 38294, 38297, 38298, 38304, 38306, 38309, 38312, 38314, 38401, 38404, 38416, 38421, 38425, 38432,
    38438, 38441, 38469, 38472, 38473, 38481, 38482, 38485, 38486, 38489, 38501, 38504, 38530, 38532, 38537, 38538,
    38546, 38548, 38549, 38564, 38566, 38569, 38917, 38934, 38937, 38949, 38977, 38982, 38992, 38994, 38997, 38998,
    39002, 39012, 39013, 39045, 39057, 39062, 39065, 39077, 39172, 39174, 39177, 39184, 39186, 39189, 39192, 39194,
    39200, 39201, 39204, 39206, 39232, 39234, 39237, 39240, 39242, 39249, 39252, 39253, 39254, 39257, 39266, 39269,
    39270, 39274, 39297, 39300, 39312, 39314, 39317, 39322, 39329, 39334, 39429, 39445, 39461, 39492, 39494, 39497,
    39504, 39509, 39512, 39521, 39557, 39569, 39572, 39573, 39574, 40960, 40962, 40968, 40970, 40981, 40992, 40994,
    41000, 41002, 41029, 41041, 41044, 41046, 41049, 41088, 41090, 41096, 41098, 41109, 41120, 41122, 41128, 41130,
    41221, 41225, 41233, 41236, 41238, 41241, 41242, 41286, 41289, 41297, 41301, 41304, 41306, 41313, 41316, 41349,
    41360, 41362, 41366, 41369, 41474, 41480, 41482, 41488, 41497, 41506, 41512, 41514, 41541, 41553, 41558, 41561,
    41573, 41600, 41602, 41608, 41610, 41621, 41632, 41634, 41640, 41642, 42009, 42021, 42049, 42052, 42064, 42068,
    42069, 42072, 42074, 42081, 42085, 42086, 42088, 42089, 42117, 42246, 42249, 42256, 42258, 42261, 42264, 42278,
    42281, 42306, 42309, 42321, 42324, 42325, 42326, 42329, 42341, 42346, 42369, 42372, 42373, 42374, 42377, 42386,
    42389, 42392, 42501, 42513, 42518, 42522, 42529, 42533, 42564, 42566, 42570, 42578, 42581, 42582, 42584, 42592,
    42594, 42630, 42640, 42645, 42646, 42649, 42657, 42660, 42662, 43008, 43010, 43016, 43018, 43040, 43042, 43048,
    43050, 43089, 43092, 43094, 43097, 43136, 43138, 43144, 43146, 43157, 43168, 43170, 43176, 43178, 43269, 43284,
    43289, 43297, 43301, 43329, 43344, 43349, 43354, 43361, 43366, 43369, 43408, 43414, 43520, 43522, 43528, 43530,
    43552, 43554, 43560, 43562, 43601, 43604, 43606, 43648, 43650, 43656, 43658, 43669, 43680, 43682, 43688, 43690,
};
typedef struct {
    int8_t grid[2048][8];
    int map[IQ2_MAP];
    uint16_t *nb;
    volatile int ready;
} iq2_tables;
static iq2_tables IQ2T[4];  /* 0: IQ2_XXS (256 points), 1: IQ2_XS (512), 2: IQ2_S (1024), 3: IQ1_S/IQ1_M (2048) */

/* the code -> grid index map and, for every code off the grid, the points at the 2 (IQ2_S: 1,
 * IQ1: 3) smallest squared distances ordered by (distance, index) (ggml's iq2xs_init_impl) */
static int iq2_init(int which) {
    iq2_tables *t = &IQ2T[which];
    if (t->ready) return 0;
    int rc = 0;
#pragma omp critical(hz_iq2_init)
    if (!t->ready) {
        static const uint16_t *const KG[4] = {IQ2XXS_KGRID, IQ2XS_KGRID, IQ2S_KGRID, IQ1_KGRID};
        static const int NG[4] = {256, 512, 1024, 2048}, NWANT[4] = {2, 2, 1, 3};
        const uint16_t *kg = KG[which];
        int ng = NG[which], nwant = NWANT[which];
        for (int k = 0; k < ng; ++k)
            for (int i = 0; i < 8; ++i) t->grid[k][i] = (int8_t)(2 * ((kg[k] >> (2 * i)) & 3) + 1);
        for (int u = 0; u < IQ2_MAP; ++u) t->map[u] = -1;
        for (int k = 0; k < ng; ++k) t->map[kg[k]] = k;
        rc = grid_neighbours(&t->grid[0][0], 8, ng, 2, IQ2_MAP, nwant, t->map, &t->nb);
        if (rc == 0) t->ready = 1;
    }
    return rc;
}

/* ggml's iq2_find_best_neighbour */
static int iq2_best_neighbour(const iq2_tables *t, const uint16_t *nb, const float *xval, const float *w,
                              float scale, int8_t *L) {
    return grid_best_neighbour(&t->grid[0][0], 8, nb, xval, w, scale, GRID_LEVELS, L);
}

static inline int iq2_code(const int8_t *L) {
    int u = 0;
    for (int i = 0; i < 8; ++i) u |= L[i] << (2 * i);
    return u;
}

static void iq2_xxs_block(const float *xbl, uint8_t *y, const float *qw) {
    const iq2_tables *t = &IQ2T[0];
    const int kmax = 3;
    float scales[8], weight[32], xval[32], waux[32], max_scale = 0;
    int8_t L[32], Laux[32];
    uint8_t signs[4];
    uint32_t q2[16];
    memset(q2, 0, sizeof q2);
    float sumx2 = 0;
    for (int i = 0; i < QK; ++i) sumx2 += xbl[i] * xbl[i];
    float sigma2 = sumx2 / QK;
    for (int ib = 0; ib < 8; ++ib) {
        const float *xb = xbl + 32 * ib;
        for (int i = 0; i < 32; ++i) weight[i] = qw[32 * ib + i] * sqrtf(sigma2 + xb[i] * xb[i]);
        for (int i = 0; i < 32; ++i) waux[i] = sqrtf(weight[i]);
        for (int k = 0; k < 4; ++k) {
            int nflip = 0;
            uint8_t sg = 0;
            for (int i = 0; i < 8; ++i) {
                if (xb[8 * k + i] >= 0) xval[8 * k + i] = xb[8 * k + i];
                else { xval[8 * k + i] = -xb[8 * k + i]; ++nflip; sg |= (uint8_t)(1 << i); }
            }
            if (nflip % 2) {
                int imin = 0;
                float mn = weight[8 * k] * xb[8 * k] * xb[8 * k];
                for (int i = 1; i < 8; ++i) {
                    float ax = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i];
                    if (ax < mn) { mn = ax; imin = i; }
                }
                xval[8 * k + imin] = -xval[8 * k + imin];
                sg ^= (uint8_t)(1 << imin);
            }
            signs[k] = sg & 127;
        }
        float mx = xval[0];
        for (int i = 1; i < 32; ++i) mx = mx > xval[i] ? mx : xval[i];
        if (mx < EPS) { scales[ib] = 0; continue; }
        float scale = qp(32, kmax + 1, xval, (uint8_t *)L, weight), eff_max = scale * kmax;
        if (eff_max <= 0) { scales[ib] = 0; continue; }
        float best = 0;
        for (int is = -6; is <= 6; ++is) {
            float id = (2 * kmax - 1 + is * 0.1f) / eff_max, this_scale = 1 / id;
            for (int k = 0; k < 4; ++k) {
                for (int i = 0; i < 8; ++i) Laux[8 * k + i] = (int8_t)clampi(rnd(0.5f * (id * xval[8 * k + i] - 1)), 0, kmax - 1);
                int u = iq2_code(Laux + 8 * k);
                if (t->map[u] < 0)
                    iq2_best_neighbour(t, t->nb - t->map[u] - 1, xval + 8 * k, waux + 8 * k, this_scale, Laux + 8 * k);
            }
            float sumqx = 0, sumq2 = 0;
            for (int i = 0; i < 32; ++i) {
                float w = weight[i], q = 2 * Laux[i] + 1;
                sumqx += w * xval[i] * q;
                sumq2 += w * q * q;
            }
            if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
                scale = sumqx / sumq2;
                best = scale * sumqx;
                memcpy(L, Laux, 32);
            }
        }
        if (scale > 0) {  /* every group re-rounded at the final scale */
            float id = 1 / scale;
            for (int k = 0; k < 4; ++k) {
                int8_t l8[8];
                for (int i = 0; i < 8; ++i) l8[i] = (int8_t)clampi(rnd(0.5f * (id * xval[8 * k + i] - 1)), 0, kmax - 1);
                int gi = t->map[iq2_code(l8)];
                if (gi < 0) gi = iq2_best_neighbour(t, t->nb - gi - 1, xval + 8 * k, waux + 8 * k, scale, L + 8 * k);
                for (int i = 0; i < 8; ++i) L[8 * k + i] = (int8_t)((t->grid[gi][i] - 1) / 2);
            }
            float sumqx = 0, sumq2 = 0;
            for (int i = 0; i < 32; ++i) {
                float w = weight[i], q = 2 * L[i] + 1;
                sumqx += w * xval[i] * q;
                sumq2 += w * q * q;
            }
            if (sumq2 > 0) scale = sumqx / sumq2;
        }
        if (scale < 0) {
            scale = -scale;
            for (int k = 0; k < 4; ++k) signs[k] = (uint8_t)((~signs[k]) & 127);
        }
        for (int k = 0; k < 4; ++k) {
            int gi = t->map[iq2_code(L + 8 * k)];
            if (gi < 0) gi = 0;  /* always on the grid here */
            q2[2 * ib] |= (uint32_t)gi << (8 * k);
            q2[2 * ib + 1] |= (uint32_t)signs[k] << (7 * k);
        }
        scales[ib] = scale;
        max_scale = max_scale > scale ? max_scale : scale;
    }
    if (!max_scale) { memset(y, 0, 66); return; }
    float d = max_scale / 31;
    put_half(y, d);
    float id = 1 / d;
    for (int ib = 0; ib < 8; ++ib) {
        int l = clampi(rnd(0.5f * (id * scales[ib] - 1)), 0, 15);
        q2[2 * ib + 1] |= (uint32_t)l << 28;
    }
    for (int j = 0; j < 16; ++j)
        for (int b = 0; b < 4; ++b) y[2 + 4 * j + b] = (uint8_t)(q2[j] >> (8 * b));
}

/* The scale search of one 16-value group of IQ2_XS / IQ2_S (ggml's loop over is = -9..9 in
 * quantize_row_iq2_xs_impl / _iq2_s_impl): xval the sign-folded values, weight their weights,
 * waux their square roots for the neighbour search, mx the largest xval. Writes the two 8-value
 * groups' grid codes to L and returns the scale (mx / (2 kmax - 1) when no candidate improves on it). */
static float iq2_scale16(const iq2_tables *t, int kmax, float mx, const float *xval, const float *weight,
                         const float *waux, int8_t *L) {
    int8_t Laux[16];
    int on[2], on_aux[2];
    float best = 0, scale = mx / (2 * kmax - 1);
    on[0] = on[1] = 1;
    for (int is = -9; is <= 9; ++is) {
        float id = (2 * kmax - 1 + is * 0.1f) / mx, this_scale = 1 / id;
        for (int k = 0; k < 2; ++k) {
            for (int i = 0; i < 8; ++i) Laux[8 * k + i] = (int8_t)clampi(rnd(0.5f * (id * xval[8 * k + i] - 1)), 0, kmax - 1);
            int u = iq2_code(Laux + 8 * k);
            on_aux[k] = t->map[u] >= 0;
            if (!on_aux[k])
                iq2_best_neighbour(t, t->nb - t->map[u] - 1, xval + 8 * k, waux + 8 * k, this_scale, Laux + 8 * k);
        }
        float sumqx = 0, sumq2 = 0;
        for (int i = 0; i < 16; ++i) {
            float w = weight[i], q = 2 * Laux[i] + 1;
            sumqx += w * xval[i] * q;
            sumq2 += w * q * q;
        }
        if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
            scale = sumqx / sumq2;
            best = scale * sumqx;
            memcpy(L, Laux, 16);
            on[0] = on_aux[0]; on[1] = on_aux[1];
        }
    }
    if ((!on[0] || !on[1]) && scale > 0) {  /* the off-grid groups re-rounded at the final scale */
        float id = 1 / scale;
        for (int k = 0; k < 2; ++k) {
            if (on[k]) continue;
            for (int i = 0; i < 8; ++i) L[8 * k + i] = (int8_t)clampi(rnd(0.5f * (id * xval[8 * k + i] - 1)), 0, kmax - 1);
            int gi = t->map[iq2_code(L + 8 * k)];
            if (gi < 0) iq2_best_neighbour(t, t->nb - gi - 1, xval + 8 * k, waux + 8 * k, scale, L + 8 * k);
        }
        float sumqx = 0, sumq2 = 0;
        for (int i = 0; i < 16; ++i) {
            float w = weight[i], q = 2 * L[i] + 1;
            sumqx += w * xval[i] * q;
            sumq2 += w * q * q;
        }
        if (sumq2 > 0) scale = sumqx / sumq2;
    }
    return scale;
}

/* IQ2_XS (ggml's quantize_row_iq2_xs_impl; importance weights required). Layout (block_iq2_xs,
 * 74 bytes): fp16 d; 32 little-endian uint16, one per 8 values: grid index (9 bits) | 7 sign
 * bits << 9; 8 bytes of 4-bit scales, one per 16 values (even group: low nibble). */
static void iq2_xs_block(const float *xbl, uint8_t *y, const float *qw) {
    const iq2_tables *t = &IQ2T[1];
    const int kmax = 3;
    float scales[16], weight[16], xval[16], waux[16], max_scale = 0;
    int8_t L[16];
    uint8_t signs[2];
    uint16_t q2[32];
    memset(q2, 0, sizeof q2);
    memset(y, 0, 74);
    float sumx2 = 0;
    for (int i = 0; i < QK; ++i) sumx2 += xbl[i] * xbl[i];
    float sigma2 = sumx2 / QK;
    for (int ib = 0; ib < 16; ++ib) {
        const float *xb = xbl + 16 * ib;
        for (int i = 0; i < 16; ++i) weight[i] = qw[16 * ib + i] * sqrtf(sigma2 + xb[i] * xb[i]);
        for (int i = 0; i < 16; ++i) waux[i] = sqrtf(weight[i]);
        for (int k = 0; k < 2; ++k) {
            int nflip = 0;
            uint8_t sg = 0;
            for (int i = 0; i < 8; ++i) {
                if (xb[8 * k + i] >= 0) xval[8 * k + i] = xb[8 * k + i];
                else { xval[8 * k + i] = -xb[8 * k + i]; ++nflip; sg |= (uint8_t)(1 << i); }
            }
            if (nflip % 2) {
                int imin = 0;
                float mn = weight[8 * k] * xb[8 * k] * xb[8 * k];
                for (int i = 1; i < 8; ++i) {
                    float ax = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i];
                    if (ax < mn) { mn = ax; imin = i; }
                }
                xval[8 * k + imin] = -xval[8 * k + imin];
                sg ^= (uint8_t)(1 << imin);
            }
            signs[k] = sg & 127;
        }
        float mx = xval[0];
        for (int i = 1; i < 16; ++i) mx = mx > xval[i] ? mx : xval[i];
        memset(L, 0, 16);
        if (mx < EPS) { scales[ib] = 0; continue; }
        float scale = iq2_scale16(t, kmax, mx, xval, weight, waux, L);
        if (scale < 0) {
            scale = -scale;
            for (int k = 0; k < 2; ++k) signs[k] = (uint8_t)((~signs[k]) & 127);
        }
        for (int k = 0; k < 2; ++k) {
            int gi = t->map[iq2_code(L + 8 * k)];
            if (gi < 0) gi = 0;  /* always on the grid here */
            q2[2 * ib + k] = (uint16_t)(gi | (signs[k] << 9));
        }
        scales[ib] = scale;
        max_scale = max_scale > scale ? max_scale : scale;
    }
    if (!max_scale) return;
    float d = max_scale / 31;
    put_half(y, d);
    float id = 1 / d;
    for (int j = 0; j < 32; ++j) { y[2 + 2 * j] = (uint8_t)(q2[j] & 0xff); y[3 + 2 * j] = (uint8_t)(q2[j] >> 8); }
    for (int ib = 0; ib < 16; ++ib) {
        int l = clampi(rnd(0.5f * (id * scales[ib] - 1)), 0, 15);
        y[66 + ib / 2] |= (uint8_t)(ib % 2 ? l << 4 : l);
    }
}

/* IQ2_S (ggml's quantize_row_iq2_s_impl; weights optional). Layout (block_iq2_s, 82 bytes):
 * fp16 d; qs[32] low 8 bits of the 32 grid indices, then qs[32..63] their 8 sign bits (no parity);
 * qh[8] the indices' bits 8..9, two per entry; scales[8] 4-bit, one per 16 values. */
static void iq2_s_block(const float *xbl, uint8_t *y, const float *qw) {
    const iq2_tables *t = &IQ2T[2];
    const int kmax = 3;
    float scales[16], weight[16], xval[16], waux[16], max_scale = 0;
    int8_t L[16];
    uint8_t signs[2];
    memset(y, 0, 82);
    uint8_t *qs = y + 2, *qh = y + 66, *sc = y + 74;
    float sumx2 = 0;
    for (int i = 0; i < QK; ++i) sumx2 += xbl[i] * xbl[i];
    float sigma2 = 2 * sumx2 / QK;
    for (int ib = 0; ib < 16; ++ib) {
        const float *xb = xbl + 16 * ib;
        if (qw) for (int i = 0; i < 16; ++i) weight[i] = qw[16 * ib + i] * sqrtf(sigma2 + xb[i] * xb[i]);
        else for (int i = 0; i < 16; ++i) weight[i] = 0.25f * sigma2 + xb[i] * xb[i];
        for (int i = 0; i < 16; ++i) waux[i] = sqrtf(weight[i]);
        for (int k = 0; k < 2; ++k) {
            uint8_t sg = 0;
            for (int i = 0; i < 8; ++i) {
                if (xb[8 * k + i] >= 0) xval[8 * k + i] = xb[8 * k + i];
                else { xval[8 * k + i] = -xb[8 * k + i]; sg |= (uint8_t)(1 << i); }
            }
            signs[k] = sg;
        }
        float mx = xval[0];
        for (int i = 1; i < 16; ++i) mx = mx > xval[i] ? mx : xval[i];
        memset(L, 0, 16);
        if (mx < 1e-8f) { scales[ib] = 0; continue; }
        float scale = iq2_scale16(t, kmax, mx, xval, weight, waux, L);
        if (scale < 0) {
            scale = -scale;
            for (int k = 0; k < 2; ++k) signs[k] = (uint8_t)~signs[k];
        }
        for (int k = 0; k < 2; ++k) {
            int gi = t->map[iq2_code(L + 8 * k)];
            if (gi < 0) gi = 0;  /* always on the grid here */
            int i8 = 2 * ib + k;
            qs[i8] = (uint8_t)(gi & 255);
            qh[i8 / 4] |= (uint8_t)((gi >> 8) << (2 * (i8 % 4)));
            qs[32 + i8] = signs[k];
        }
        scales[ib] = scale;
        max_scale = max_scale > scale ? max_scale : scale;
    }
    if (!max_scale) return;
    float d = max_scale / 31;
    put_half(y, d * 0.9875f);
    float id = 1 / d;
    for (int ib = 0; ib < 16; ++ib) {
        int l = clampi(rnd(0.5f * (id * scales[ib] - 1)), 0, 15);
        sc[ib / 2] |= (uint8_t)(ib % 2 ? l << 4 : l);
    }
}

/* ---- IQ1_S and IQ1_M (ggml's quantize_row_iq1_s_impl / _iq1_m_impl) ----
 * Three levels per value, -1, 0, 1, shifted by +-IQ1_DELTA; the grid (IQ2T[3]) stores level
 * l in 0..2 as 2l + 1, so xg[(g - 1) / 2] is the shifted level of grid value g. */
#define IQ1_DELTA 0.125f
static const float IQ1_XP[3] = {-1 + IQ1_DELTA, IQ1_DELTA, 1 + IQ1_DELTA};
static const float IQ1_XM[3] = {-1 - IQ1_DELTA, -IQ1_DELTA, 1 - IQ1_DELTA};

/* ggml's iq1_find_best_neighbour2: the neighbour with the least weighted squared error of
 * scale * xg[level] against xval */
static int iq1_best_neighbour(const iq2_tables *t, const uint16_t *nb, const float *xval, const float *w,
                              float scale, const float *xg, int8_t *L) {
    return grid_best_neighbour(&t->grid[0][0], 8, nb, xval, w, scale, xg, L);
}

/* idx[0..n) ordered by x ascending, ties in index order (the order glibc's merge-sort qsort
 * gives ggml's iq1_sort_helper) */
static void iq1_sort(int n, const float *x, int *idx) {
    for (int j = 0; j < n; ++j) {
        int k = j;
        while (k > 0 && x[idx[k - 1]] > x[j]) { idx[k] = idx[k - 1]; --k; }
        idx[k] = j;
    }
}

/* IQ1_S (importance weights required). Layout (block_iq1_s, 50 bytes): fp16 d; qs[32] low 8 bits
 * of the 32 grid indices (11 bits); qh[8] little-endian uint16 per 32 values: the 4 indices'
 * high 3 bits at 3k, the 3-bit scale at bit 12, the delta sign (1: -delta) at bit 15. */
static void iq1_s_block(const float *xbl, uint8_t *y, const float *qw) {
    const iq2_tables *t = &IQ2T[3];
    float scales[8], weight[32], sumx[33], sumw[33], max_scale = 0;
    int8_t L[32], shifts[8];
    int idx[32];
    uint16_t index[4], qh[8];
    memset(y, 0, 50);
    memset(qh, 0, sizeof qh);
    uint8_t *qs = y + 2;
    float sumx2 = 0;
    for (int i = 0; i < QK; ++i) sumx2 += xbl[i] * xbl[i];
    float sigma2 = 2 * sumx2 / QK;
    for (int ib = 0; ib < 8; ++ib) {
        const float *xb = xbl + 32 * ib;
        for (int i = 0; i < 32; ++i) weight[i] = qw[32 * ib + i] * sqrtf(sigma2 + xb[i] * xb[i]);
        float mx = fabsf(xb[0]);
        for (int i = 1; i < 32; ++i) mx = mx > fabsf(xb[i]) ? mx : fabsf(xb[i]);
        scales[ib] = 0;
        shifts[ib] = 1;
        if (mx < 1e-12f) continue;
        /* the best split of the sorted values into levels 0 | 1 | 2, exhaustively, for both shifts */
        iq1_sort(32, xb, idx);
        sumx[0] = sumw[0] = 0;
        for (int j = 0; j < 32; ++j) {
            int i = idx[j];
            sumx[j + 1] = sumx[j] + weight[i] * xb[i];
            sumw[j + 1] = sumw[j] + weight[i];
        }
        float best = -FLT_MAX, scale = mx;
        int b1 = -1, b2 = -1, bs = 0;
        for (int i1 = 0; i1 <= 32; ++i1) {
            for (int i2 = i1; i2 <= 32; ++i2) {
                for (int sh = 1; sh >= -1; sh -= 2) {
                    const float *v = sh == 1 ? IQ1_XP : IQ1_XM;
                    float sumqx = (sumx[i1] - sumx[0]) * v[0] + (sumx[i2] - sumx[i1]) * v[1] + (sumx[32] - sumx[i2]) * v[2];
                    float sumq2 = (sumw[i1] - sumw[0]) * v[0] * v[0] + (sumw[i2] - sumw[i1]) * v[1] * v[1] +
                                  (sumw[32] - sumw[i2]) * v[2] * v[2];
                    if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
                        scale = sumqx / sumq2;
                        best = scale * sumqx;
                        b1 = i1; b2 = i2; bs = sh;
                    }
                }
            }
        }
        if (b1 < 0 || b2 < 0 || bs == 0) continue;
        for (int j = 0; j < 32; ++j) L[idx[j]] = (int8_t)(j < b1 ? 0 : j < b2 ? 1 : 2);
        if (scale < 0) {
            for (int j = 0; j < 32; ++j) L[j] = (int8_t)(2 - L[j]);
            scale = -scale;
            bs = -bs;
        }
        const float *xx = bs == 1 ? IQ1_XP : IQ1_XM;
        int all_on = 1;
        for (int k = 0; k < 4; ++k) {
            int u = iq2_code(L + 8 * k), gi = t->map[u];
            if (gi < 0) {
                all_on = 0;
                gi = iq1_best_neighbour(t, t->nb - gi - 1, xb + 8 * k, weight + 8 * k, scale, xx, L + 8 * k);
            }
            index[k] = (uint16_t)gi;
        }
        if (!all_on) {
            float sumqx = 0, sumq2 = 0;
            for (int k = 0; k < 4; ++k) {
                const int8_t *pg = t->grid[index[k]];
                for (int j = 0; j < 8; ++j) {
                    float w = weight[8 * k + j], q = xx[(pg[j] - 1) / 2];
                    sumqx += w * q * xb[8 * k + j];
                    sumq2 += w * q * q;
                }
            }
            if (sumqx > 0 && sumq2 > 0) scale = sumqx / sumq2;
        }
        uint16_t h = 0;
        for (int k = 0; k < 4; ++k) {
            qs[4 * ib + k] = (uint8_t)(index[k] & 255);
            h |= (uint16_t)((index[k] >> 8) << (3 * k));
        }
        qh[ib] = h;
        scales[ib] = scale;
        shifts[ib] = (int8_t)bs;
        max_scale = max_scale > scale ? max_scale : scale;
    }
    if (max_scale) {
        float d = max_scale / 15;
        put_half(y, d * 1.125f);
        float id = 1 / d;
        for (int ib = 0; ib < 8; ++ib) {
            int l = clampi(rnd(0.5f * (id * scales[ib] - 1)), 0, 7);
            if (shifts[ib] == -1) l |= 8;
            qh[ib] |= (uint16_t)(l << 12);
        }
    }
    for (int ib = 0; ib < 8; ++ib) { y[34 + 2 * ib] = (uint8_t)(qh[ib] & 0xff); y[35 + 2 * ib] = (uint8_t)(qh[ib] >> 8); }
}

/* IQ1_M (weights optional; without: x^2). Layout (block_iq1_m, 56 bytes): qs[32] low 8 bits of
 * the grid indices; qh[16] per 16 values: the two indices' high 3 bits at 0 and 4, their delta
 * signs (1: -delta) at bits 3 and 7; scales[8] as 4 little-endian uint16, 3-bit scales of the
 * 16 groups at 3 (i % 4) of entry i / 4, and the fp16 super-block scale's 4 nibbles in bits 12..15. */
static void iq1_m_block(const float *xbl, uint8_t *y, const float *qw) {
    static const uint8_t masks[4] = {0x00, 0x80, 0x08, 0x88};
    const iq2_tables *t = &IQ2T[3];
    float scales[16], weight[16], max_scale = 0;
    int8_t L[16], shifts[16];
    int idx[16];
    uint16_t index[2], sc[4] = {0, 0, 0, 0};
    memset(y, 0, 56);
    uint8_t *qs = y, *qh = y + 32;
    float sumx2 = 0;
    for (int i = 0; i < QK; ++i) sumx2 += xbl[i] * xbl[i];
    float sigma2 = 2 * sumx2 / QK;
    const float p2 = IQ1_XP[2], m2 = IQ1_XM[2];
    const float cp1 = IQ1_XP[0] * IQ1_XP[0] - IQ1_XP[1] * IQ1_XP[1], cp2 = IQ1_XP[1] * IQ1_XP[1] - IQ1_XP[2] * IQ1_XP[2];
    const float cm1 = IQ1_XM[0] * IQ1_XM[0] - IQ1_XM[1] * IQ1_XM[1], cm2 = IQ1_XM[1] * IQ1_XM[1] - IQ1_XM[2] * IQ1_XM[2];
    for (int ib = 0; ib < 16; ++ib) {
        const float *xb = xbl + 16 * ib;
        if (qw) for (int i = 0; i < 16; ++i) weight[i] = qw[16 * ib + i] * sqrtf(sigma2 + xb[i] * xb[i]);
        else for (int i = 0; i < 16; ++i) weight[i] = xb[i] * xb[i];
        float mx = fabsf(xb[0]);
        for (int i = 1; i < 16; ++i) mx = mx > fabsf(xb[i]) ? mx : fabsf(xb[i]);
        scales[ib] = 0;
        shifts[ib] = 0;
        if (mx < 1e-7f) continue;
        iq1_sort(16, xb, idx);
        /* prefix sums per half (each half of 8 has its own delta sign); k: 0 (+,+), 1 (+,-), 2 (-,+), 3 (-,-) */
        float px[2][17], pw[2][17];
        px[0][0] = px[1][0] = pw[0][0] = pw[1][0] = 0;
        for (int j = 0; j < 16; ++j) {
            int i = idx[j], h = i < 8 ? 0 : 1;
            px[h][j + 1] = px[h][j] + weight[i] * xb[i];
            px[1 - h][j + 1] = px[1 - h][j];
            pw[h][j + 1] = pw[h][j] + weight[i];
            pw[1 - h][j + 1] = pw[1 - h][j];
        }
        const float txs[2] = {px[0][16], px[1][16]}, tws[2] = {pw[0][16], pw[1][16]};
        float best = -FLT_MAX, scale = mx;
        int b1 = -1, b2 = -1, bk = -1;
        for (int i1 = 0; i1 <= 16; ++i1) {
            for (int i2 = i1; i2 <= 16; ++i2) {
                float qx_p[2], qx_m[2], q2_p[2], q2_m[2], sqx[4], sq2[4];
                for (int h = 0; h < 2; ++h) {
                    float sx = px[h][i1] + px[h][i2];
                    qx_p[h] = txs[h] * p2 - sx;
                    qx_m[h] = txs[h] * m2 - sx;
                    q2_p[h] = tws[h] * p2 * p2 + pw[h][i1] * cp1 + pw[h][i2] * cp2;
                    q2_m[h] = tws[h] * m2 * m2 + pw[h][i1] * cm1 + pw[h][i2] * cm2;
                }
                sqx[0] = qx_p[0] + qx_p[1]; sqx[1] = qx_p[0] + qx_m[1];
                sqx[2] = qx_m[0] + qx_p[1]; sqx[3] = qx_m[0] + qx_m[1];
                sq2[0] = q2_p[0] + q2_p[1]; sq2[1] = q2_p[0] + q2_m[1];
                sq2[2] = q2_m[0] + q2_p[1]; sq2[3] = q2_m[0] + q2_m[1];
                for (int k = 0; k < 4; ++k) {
                    if (sq2[k] > 0 && sqx[k] * sqx[k] > best * sq2[k]) {
                        scale = sqx[k] / sq2[k];
                        best = scale * sqx[k];
                        b1 = i1; b2 = i2; bk = k;
                    }
                }
            }
        }
        if (b1 < 0 || b2 < 0 || bk < 0) continue;
        for (int j = 0; j < 16; ++j) L[idx[j]] = (int8_t)(j < b1 ? 0 : j < b2 ? 1 : 2);
        if (scale < 0) {
            for (int j = 0; j < 16; ++j) L[j] = (int8_t)(2 - L[j]);
            scale = -scale;
            bk = 3 - bk;
        }
        int all_on = 1;
        for (int k = 0; k < 2; ++k) {
            const float *xx = (k == 0 ? bk < 2 : bk % 2 == 0) ? IQ1_XP : IQ1_XM;
            int u = iq2_code(L + 8 * k), gi = t->map[u];
            if (gi < 0) {
                all_on = 0;
                gi = iq1_best_neighbour(t, t->nb - gi - 1, xb + 8 * k, weight + 8 * k, scale, xx, L + 8 * k);
            }
            index[k] = (uint16_t)gi;
        }
        if (!all_on) {
            float sumqx = 0, sumq2 = 0;
            for (int k = 0; k < 2; ++k) {
                const float *xx = (k == 0 ? bk < 2 : bk % 2 == 0) ? IQ1_XP : IQ1_XM;
                const int8_t *pg = t->grid[index[k]];
                for (int j = 0; j < 8; ++j) {
                    float w = weight[8 * k + j], q = xx[(pg[j] - 1) / 2];
                    sumqx += w * q * xb[8 * k + j];
                    sumq2 += w * q * q;
                }
            }
            if (sumqx > 0 && sumq2 > 0) scale = sumqx / sumq2;
        }
        qs[2 * ib] = (uint8_t)(index[0] & 255);
        qs[2 * ib + 1] = (uint8_t)(index[1] & 255);
        qh[ib] = (uint8_t)((index[0] >> 8) | ((index[1] >> 8) << 4));
        scales[ib] = scale;
        shifts[ib] = (int8_t)bk;
        max_scale = max_scale > scale ? max_scale : scale;
    }
    if (!max_scale) return;
    float d = max_scale / 15, id = 1 / d, sumqx = 0, sumq2 = 0;
    /* the super-block scale refitted to the rounded group scales, over every group (skipped
     * ones with grid point 0) */
    for (int ib = 0; ib < 16; ++ib) {
        int l = clampi(rnd(0.5f * (id * scales[ib] - 1)), 0, 7);
        sc[ib / 4] |= (uint16_t)(l << (3 * (ib % 4)));
        qh[ib] |= masks[shifts[ib]];
        const float *xb = xbl + 16 * ib;
        if (qw) for (int i = 0; i < 16; ++i) weight[i] = qw[16 * ib + i] * sqrtf(sigma2 + xb[i] * xb[i]);
        else for (int i = 0; i < 16; ++i) weight[i] = xb[i] * xb[i];
        for (int k = 0; k < 2; ++k) {
            const float *xx = (k == 0 ? shifts[ib] < 2 : shifts[ib] % 2 == 0) ? IQ1_XP : IQ1_XM;
            const int8_t *pg = t->grid[qs[2 * ib + k] | ((qh[ib] << (8 - 4 * k)) & 0x700)];
            for (int j = 0; j < 8; ++j) {
                float w = weight[8 * k + j], q = xx[(pg[j] - 1) / 2] * (2 * l + 1);
                sumqx += w * q * xb[8 * k + j];
                sumq2 += w * q * q;
            }
        }
    }
    if (sumq2 > 0) d = sumqx / sumq2;
    uint16_t s = to_half(d * 1.1125f);
    sc[0] |= (uint16_t)((s & 0x000f) << 12);
    sc[1] |= (uint16_t)((s & 0x00f0) << 8);
    sc[2] |= (uint16_t)((s & 0x0f00) << 4);
    sc[3] |= (uint16_t)(s & 0xf000);
    for (int i = 0; i < 4; ++i) { y[48 + 2 * i] = (uint8_t)(sc[i] & 0xff); y[49 + 2 * i] = (uint8_t)(sc[i] >> 8); }
}

typedef void (*block_fn)(const float *, uint8_t *, const float *);

/* 1 when the n floats at x are all finite (exponent bits not all ones) */
static int all_finite(const float *x, int64_t n) {
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
        uint32_t u; memcpy(&u, x + i, 4);
        bad |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
    }
    return !bad;
}

/* Quantize nrows rows of n_per_row floats at x into y, as ggml_quantize_chunk(type_id, ...) does:
 * type_id is ggml's (10..14: Q2_K..Q6_K, 20: IQ4_NL, 23: IQ4_XS; 2, 3, 6, 7: Q4_0, Q4_1, Q5_0,
 * Q5_1 with weights only; 18: IQ3_XXS, 21: IQ3_S; 16, 17, 19: IQ2_XXS, IQ2_XS, IQ1_S, weights required; 22: IQ2_S; 29: IQ1_M); qw, when not NULL, holds n_per_row importance weights shared by every
 * row. Each block is checked for non-finite values as it is quantized. Returns 0, -1 for an
 * unknown type (or a legacy type without weights), -2 for a row length that is not a block
 * multiple, -3 when x holds a non-finite value (y is then partly written), -4 when a table
 * could not be allocated, -5 for a type that needs weights called without. */
int hz_quantize_rows(int type_id, const float *x, uint8_t *y, int64_t nrows, int64_t n_per_row,
                     const float *qw, int nthreads) {
    block_fn f;
    int bs = QK, ts, bad = 0;
    if (type_id == 2 || type_id == 3 || type_id == 6 || type_id == 7) {
        if (!qw) return -1;  /* without weights these are ggml's _ref quantizers, not here */
        if (n_per_row <= 0 || n_per_row % 32) return -2;
        int64_t rb = n_per_row / 32 * (type_id == 2 ? 18 : type_id == 3 ? 20 : type_id == 6 ? 22 : 24);
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(|:bad)
        for (int64_t r = 0; r < nrows; ++r) {
            if (!all_finite(x + r * n_per_row, n_per_row)) { bad = 1; continue; }
            legacy_row_w(type_id, x + r * n_per_row, y + r * rb, n_per_row, qw);
        }
        return bad ? -3 : 0;
    }
    switch (type_id) {
    case 10: f = q2_k_any; ts = 84; break;
    case 11: f = q3_k_any; ts = 110; break;
    case 12: f = q4_k_any; ts = 144; break;
    case 13: f = q5_k_any; ts = 176; break;
    case 14: f = q6_k_block; ts = 210; break;
    case 20: f = iq4_nl_block; bs = 32; ts = 18; break;
    case 23: f = iq4_xs_block; ts = 136; break;
    case 18: f = iq3_xxs_block; ts = 98; if (iq3_init(0)) return -4; break;
    case 21: f = iq3_s_block; ts = 110; if (iq3_init(1)) return -4; break;
    case 16: if (!qw) return -5; f = iq2_xxs_block; ts = 66; if (iq2_init(0)) return -4; break;
    case 17: if (!qw) return -5; f = iq2_xs_block; ts = 74; if (iq2_init(1)) return -4; break;
    case 22: f = iq2_s_block; ts = 82; if (iq2_init(2)) return -4; break;
    case 19: if (!qw) return -5; f = iq1_s_block; ts = 50; if (iq2_init(3)) return -4; break;
    case 29: f = iq1_m_block; ts = 56; if (iq2_init(3)) return -4; break;
    default: return -1;
    }
    if (n_per_row <= 0 || n_per_row % bs) return -2;
    int64_t per_row = n_per_row / bs, n = nrows * per_row;
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(|:bad)
    for (int64_t i = 0; i < n; ++i) {
        if (!all_finite(x + i * bs, bs)) { bad = 1; continue; }
        f(x + i * bs, y + i * ts, qw ? qw + (i % per_row) * bs : NULL);
    }
    return bad ? -3 : 0;
}

/* Quantize n super-blocks of 256 floats at x into y without weights, nthreads threads.
 * kind: 2..6 for Q2_K..Q6_K. Returns 0, -1 for an unknown kind, -3 for a non-finite value. */
int hz_quantize_k(int kind, const float *x, uint8_t *y, int64_t n, int nthreads) {
    if (kind < 2 || kind > 6) return -1;
    return hz_quantize_rows(8 + kind, x, y, n, QK, NULL, nthreads);
}
