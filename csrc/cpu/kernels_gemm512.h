// 512-bit int8 GEMM for the AVX-512 level (F/BW/VL/DQ + VNNI). Included by kernels.h inside
// namespace hz_avx512 (HZ_ISA >= 2), after kernels_gemm.h, whose panel unpack it shares: for a
// tile of NR weight rows and a K panel the weights are unpacked once (Hooks<T>::chunk, 32 values
// per __m256i) into a 64-byte aligned buffer, where two consecutive chunks form one zmm operand.
//
// 256-value formats (and Q1_0's 128): per 64 values and (activation row m, weight row r),
//   vpmaddubsw (uint8 q x int8 x -> int16 pairs) + vpdpwssd (x int16 sub-block scales -> int32),
// the 256-bit kernels' two instructions on twice the width; signed formats take |q| and negate x
// where q < 0 under a mask (AVX-512 has no 512-bit vpsignb). Mins: Q6_K and Q3_K subtract their
// integer-ratio min in int32 (GemmMinRatio), the others as one FMA of dmin * mn (16 floats, one
// per 16 values) against the activation's per-16 float sums: exactly one zmm each.
//
// 32-value formats: one zmm holds blocks b and b+1 of a weight row, and ONE vpdpbusd per 64
// values and (m, r) does the int8 dot (uint8 x int8 -> int32, no int16 saturation). The values
// must be unsigned, so each format's integer w satisfies w = u - OFF with u in 0..255:
//   signed formats (Q8_0, IQ4_NL, MXFP4): u = w + 128 (stored as w ^ 0x80), OFF = 128;
//   Q4_0, Q5_0: u = the stored nibble (| high bit), OFF = 8, 16 (Hooks::U_OFF);
//   Q4_1, Q5_1: OFF = 0, their float min term as one FMA per (m, r) and block pair.
// sum w*x = sum u*x - OFF * sum x is exact in int32: the accumulator of a block pair starts at
// -OFF * (the block's int8 sum of x, from the activation's per-16 int16 sums) in lanes 0 and 8.
//
// Results are the same products and sums as the 256-bit kernels, in another float summation
// order: held to the same float32 tolerance by the conformance suite (cpu-avx512, and
// cpu-avx512-sim where the CPU lacks AVX-512: the same source built on SIMDe's intrinsics).
// hz_gemm512 = 0 (HANZO_CPU_GEMM512=0) runs the 256-bit kernels instead, for A/B runs.

static inline __m512i hz_load512(const __m256i* p) { return _mm512_load_si512((const void*)p); }
static inline float hsum16(__m512 v) {  // (low 8 + high 8), then hsum8's tree
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}
static inline __m512i zext512(__m256i v) { return _mm512_inserti64x4(_mm512_setzero_si512(), v, 0); }
static inline __m512 cvt16_ps(__m256i v16) {  // 16 int16 -> 16 float
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(v16)));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(v16, 1)));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

template <class T>
static void gemm512_k(const uint8_t* W, int64_t rb, int64_t n0, int64_t n1, const HzAct* a, int64_t M,
                      float* y, int64_t ldy) {
    typedef Hooks<T> H;
    constexpr int MR = HZ_GEMM_MR, NR = HZ_GEMM_NR, NC = T::QK / 32;
    static_assert(NC % 2 == 0, "chunk pairs");
    constexpr int RATIO = H::HAS_MIN ? GemmMinRatio<T>::value : 0;
    constexpr bool FMIN = H::HAS_MIN && RATIO == 0;  // min as float FMAs
    static_assert(!FMIN || T::QK == 256, "a float min term reads 16 sums per 256-value block");
    const int64_t K = a->K, nb = K / T::QK;
    const int64_t KB = hz_min<int64_t>(nb, hz_gemm_kc / T::QK > 0 ? hz_gemm_kc / T::QK : 1);
    __m256i* qbuf = (__m256i*)aligned_alloc(64, sizeof(__m256i) * NR * KB * NC);
    __m256i* sbuf = (__m256i*)aligned_alloc(64, sizeof(__m256i) * NR * KB * NC);
    __m256i* ibuf = (__m256i*)aligned_alloc(64, sizeof(__m256i) * ((NR * KB + 1) / 2 * 2));  // RATIO: int16 mn per 16
    __m512* mbuf = (__m512*)aligned_alloc(64, sizeof(__m512) * NR * KB);     // FMIN: dmin * mn per 16
    float* dbuf = (float*)aligned_alloc(64, sizeof(float) * ((NR * KB + 15) / 16 * 16));
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t mc = 0; mc < M; mc += hz_gemm_mc) {
        const int64_t me = hz_min<int64_t>(M, mc + hz_gemm_mc);
        for (int64_t kp = 0; kp < nb; kp += KB) {
            const int64_t kb = hz_min<int64_t>(KB, nb - kp);
            for (int64_t nt = n0; nt < n1; nt += NR) {
                const int nr = (int)hz_min<int64_t>(NR, n1 - nt);
                for (int r = 0; r < NR; ++r) {
                    const uint8_t* row = W + (nt + (r < nr ? r : nr - 1)) * rb + kp * T::BYTES;
                    for (int64_t b = 0; b < kb; ++b) {
                        const typename H::Prep p = unpack_block<T>(row + b * T::BYTES, qbuf + (r * KB + b) * NC, sbuf + (r * KB + b) * NC);
                        dbuf[r * KB + b] = p.d;
                        if constexpr (RATIO != 0) ibuf[r * KB + b] = p.mn16;
                        if constexpr (FMIN)
                            mbuf[r * KB + b] = _mm512_mul_ps(_mm512_set1_ps(p.dmin), cvt16_ps(p.mn16));
                    }
                }
                for (int64_t mt = mc; mt < me; mt += MR) {
                    const int mr = (int)hz_min<int64_t>(MR, me - mt);
                    const TileRows<T, MR> tr(a, mt, mr, kp);
                    const int8_t* const (&xq)[MR] = tr.q; const float* const (&xd)[MR] = tr.d;
                    const float* const (&xs)[MR] = tr.sf; const int16_t* const (&xs16)[MR] = tr.s16;
                    __m512 acc[MR][NR];
                    for (int m = 0; m < MR; ++m)
                        for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
                    for (int64_t b = 0; b < kb; ++b) {
                        __m512i is[MR][NR];
                        for (int m = 0; m < MR; ++m)
                            for (int r = 0; r < NR; ++r) is[m][r] = zero;
                        for (int c = 0; c < NC; c += 2) {
                            __m512i x[MR];
                            for (int m = 0; m < MR; ++m) x[m] = _mm512_loadu_si512((const void*)(xq[m] + b * T::QK + 32 * c));
                            for (int r = 0; r < NR; ++r) {
                                const __m512i q = hz_load512(qbuf + (r * KB + b) * NC + c);
                                const __m512i s = hz_load512(sbuf + (r * KB + b) * NC + c);
                                if constexpr (H::SIGNED) {
                                    const __m512i qa = _mm512_abs_epi8(q);
                                    const __mmask64 neg = _mm512_movepi8_mask(q);
                                    for (int m = 0; m < MR; ++m)
                                        is[m][r] = _mm512_dpwssd_epi32(is[m][r], _mm512_maddubs_epi16(qa, _mm512_mask_sub_epi8(x[m], neg, zero, x[m])), s);
                                } else {
                                    for (int m = 0; m < MR; ++m)
                                        is[m][r] = _mm512_dpwssd_epi32(is[m][r], _mm512_maddubs_epi16(q, x[m]), s);
                                }
                            }
                        }
                        for (int m = 0; m < MR; ++m) {
                            const float dx = xd[m][b];
                            __m512 xsv;
                            if constexpr (FMIN) xsv = _mm512_loadu_ps(xs[m] + b * 16);
                            __m256i xsi;
                            if constexpr (RATIO != 0) xsi = _mm256_loadu_si256((const __m256i*)(xs16[m] + b * 16));
                            for (int r = 0; r < NR; ++r) {
                                __m512i v = is[m][r];
                                if constexpr (RATIO != 0) {  // v -= RATIO * sum_g mn_g * xs_g (exact)
                                    __m256i ms = _mm256_madd_epi16(ibuf[r * KB + b], xsi);
                                    if constexpr (RATIO == 32) ms = _mm256_slli_epi32(ms, 5);
                                    else if constexpr (RATIO != 1) ms = _mm256_mullo_epi32(ms, _mm256_set1_epi32(RATIO));
                                    v = _mm512_sub_epi32(v, zext512(ms));
                                }
                                acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(dbuf[r * KB + b] * dx), acc[m][r]);
                                if constexpr (FMIN) acc[m][r] = _mm512_fnmadd_ps(mbuf[r * KB + b], xsv, acc[m][r]);
                            }
                        }
                    }
                    for (int m = 0; m < mr; ++m)
                        for (int r = 0; r < nr; ++r) {
                            const float v = hsum16(acc[m][r]);
                            float* dst = y + (mt + m) * ldy + nt + r;
                            *dst = kp == 0 ? v : *dst + v;
                        }
                }
            }
        }
    }
    free(qbuf); free(sbuf); free(ibuf); free(mbuf); free(dbuf);
}

template <class T>
static void gemm512_32(const uint8_t* W, int64_t rb, int64_t n0, int64_t n1, const HzAct* a, int64_t M,
                       float* y, int64_t ldy) {
    typedef Hooks<T> H;
    constexpr int MR = HZ_GEMM_MR, NR = HZ_GEMM_NR;
    constexpr int OFF = H::SIGNED ? 128 : (H::S8 ? H::U_OFF : 0);
    constexpr bool FMIN = H::HAS_MIN && OFF == 0;  // Q4_1, Q5_1: the min as float FMAs
    static_assert(!(H::SIGNED && H::HAS_MIN), "a signed 32-value format with a min term");
    const int64_t K = a->K, nb = K / 32;
    const int64_t KB = hz_min<int64_t>(nb, hz_gemm_kc / 32);
    const int64_t KP = (KB + 1) / 2;  // block pairs per panel
    __m256i* qbuf = (__m256i*)aligned_alloc(64, sizeof(__m256i) * NR * KP * 2);
    __m512* dvbuf = (__m512*)aligned_alloc(64, sizeof(__m512) * NR * KP);  // [d_b x8 | d_b+1 x8]
    __m512* mvbuf = (__m512*)aligned_alloc(64, sizeof(__m512) * NR * KP);  // FMIN: [dmin_b, 0 x7 | dmin_b+1, 0 x7]
    // Per activation row of an M block and block of a K panel (zero past the panel's last block),
    // made once per (M block, K panel) for all weight tiles: the block's scale, -OFF * its int8 sum,
    // its float sum. A tile loads each pair with one 64-bit load and spreads it to lanes 0-7 / 8-15.
    const int64_t KB2 = 2 * KP;
    float* xdb = (float*)aligned_alloc(64, sizeof(float) * ((hz_gemm_mc * KB2 + 15) / 16 * 16));
    int32_t* xcb = (int32_t*)aligned_alloc(64, sizeof(int32_t) * ((hz_gemm_mc * KB2 + 15) / 16 * 16));
    float* xsb = (float*)aligned_alloc(64, sizeof(float) * ((hz_gemm_mc * KB2 + 15) / 16 * 16));
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t mc = 0; mc < M; mc += hz_gemm_mc) {
        const int64_t me = hz_min<int64_t>(M, mc + hz_gemm_mc);
        for (int64_t kp = 0; kp < nb; kp += KB) {
            const int64_t kb = hz_min<int64_t>(KB, nb - kp), kpairs = (kb + 1) / 2;
            for (int64_t mm = mc; mm < me; ++mm) {
                const float* pd = a->d + mm * nb + kp;
                const int16_t* ps = a->s + mm * (K / 16) + kp * 2;
                const float* pf = a->sf + mm * (K / 16) + kp * 2;
                for (int64_t b = 0; b < KB2; ++b) {
                    const bool in = b < kb;
                    xdb[(mm - mc) * KB2 + b] = in ? pd[b] : 0.f;
                    xcb[(mm - mc) * KB2 + b] = in ? -OFF * ((int)ps[2 * b] + ps[2 * b + 1]) : 0;
                    xsb[(mm - mc) * KB2 + b] = in ? pf[2 * b] + pf[2 * b + 1] : 0.f;
                }
            }
            for (int64_t nt = n0; nt < n1; nt += NR) {
                const int nr = (int)hz_min<int64_t>(NR, n1 - nt);
                for (int r = 0; r < NR; ++r) {
                    const uint8_t* row = W + (nt + (r < nr ? r : nr - 1)) * rb + kp * T::BYTES;
                    alignas(64) float d[16], dm[16];
                    for (int64_t j = 0; j < kpairs; ++j) {
                        for (int h = 0; h < 2; ++h) {
                            const int64_t b = 2 * j + h;
                            __m256i q = _mm256_setzero_si256();
                            float db = 0.f, dmb = 0.f;
                            if (b < kb) {  // an odd panel's last pair has one block: zeros, scale 0
                                const uint8_t* blk = row + b * T::BYTES;
                                typename H::Prep p;
                                H::prep(blk, p);
                                q = H::chunk(blk, p, 0);
                                if constexpr (H::SIGNED) q = _mm256_xor_si256(q, flip);
                                db = p.d;
                                dmb = p.dmin;
                            }
                            qbuf[(r * KP + j) * 2 + h] = q;
                            for (int l = 0; l < 8; ++l) { d[8 * h + l] = db; dm[8 * h + l] = l == 0 ? dmb : 0.f; }
                        }
                        dvbuf[r * KP + j] = _mm512_load_ps(d);
                        if constexpr (FMIN) mvbuf[r * KP + j] = _mm512_load_ps(dm);
                    }
                }
                for (int64_t mt = mc; mt < me; mt += MR) {
                    const int mr = (int)hz_min<int64_t>(MR, me - mt);
                    const TileRows<T, MR> tr(a, mt, mr, kp);
                    const int8_t* const (&xq)[MR] = tr.q;
                    int64_t lm[MR];  // the rows' places in the M block's per-block arrays
                    for (int m = 0; m < MR; ++m) lm[m] = (mt + (m < mr ? m : mr - 1) - mc) * KB2;
                    __m512 acc[MR][NR];
                    for (int m = 0; m < MR; ++m)
                        for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
                    for (int64_t j = 0; j < kpairs; ++j) {
                        const bool two = 2 * j + 1 < kb;
                        __m512i x[MR], c0[MR];
                        __m512 dxv[MR], sxv[MR];
                        for (int m = 0; m < MR; ++m) {
                            const int8_t* px = xq[m] + 64 * j;
                            const int64_t o = lm[m] + 2 * j;
                            x[m] = two ? _mm512_loadu_si512((const void*)px) : zext512(_mm256_loadu_si256((const __m256i*)px));
                            dxv[m] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i*)(xdb + o)))));
                            // lanes 0 and 8: -OFF * (int8 sum of x over block 2j, 2j+1)
                            if constexpr (OFF != 0)
                                c0[m] = _mm512_maskz_permutexvar_epi32((__mmask16)0x0101, spread, _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i*)(xcb + o))));
                            else
                                c0[m] = zero;
                            // the float sums of x over the two blocks (read in lanes 0 and 8 only)
                            if constexpr (FMIN)
                                sxv[m] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i*)(xsb + o)))));
                        }
                        for (int r = 0; r < NR; ++r) {
                            const __m512i q = hz_load512(qbuf + (r * KP + j) * 2);
                            const __m512 dv = dvbuf[r * KP + j];
                            for (int m = 0; m < MR; ++m) {
                                const __m512i v = _mm512_dpbusd_epi32(c0[m], q, x[m]);
                                acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(dv, dxv[m]), acc[m][r]);
                                if constexpr (FMIN) acc[m][r] = _mm512_fnmadd_ps(mvbuf[r * KP + j], sxv[m], acc[m][r]);
                            }
                        }
                    }
                    for (int m = 0; m < mr; ++m)
                        for (int r = 0; r < nr; ++r) {
                            const float v = hsum16(acc[m][r]);
                            float* dst = y + (mt + m) * ldy + nt + r;
                            *dst = kp == 0 ? v : *dst + v;
                        }
                }
            }
        }
    }
    free(qbuf); free(dvbuf); free(mvbuf); free(xdb); free(xcb); free(xsb);
}
