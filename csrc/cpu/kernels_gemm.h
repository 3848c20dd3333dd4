// Tiled int8 GEMM (prefill, large M) over the Hooks of kernels.h. Included by kernels.h inside
// namespace hz_<isa>, SIMD path only (HZ_ISA >= 1).

// GEMM: for a tile of NR weight rows and a K panel, unpack the weights ONCE into an
// L1/L2-resident buffer (int8 values + pre-shuffled scale vectors), then sweep all activation
// rows of an M block with an MR x NR register tile of int32 accumulators.
#if HZ_ISA >= 2
#define HZ_GEMM_MR 4
#define HZ_GEMM_NR 3
#else
#define HZ_GEMM_MR 3
#define HZ_GEMM_NR 3
#endif
static const int64_t HZ_KC = 2048;  // K panel (values): NR*KC bytes of weights stay in L1
static const int64_t HZ_MC = 64;    // M block (rows): MC*KC activation bytes stay in L2

template <class T>
static void gemm_simd(const uint8_t* W, int64_t rb, int64_t n0, int64_t n1, const HzAct* a, int64_t M,
                      float* y, int64_t ldy) {
    typedef Hooks<T> H;
    constexpr int MR = HZ_GEMM_MR, NR = HZ_GEMM_NR, NC = T::QK / 32;
    constexpr bool K256 = T::QK != 32;
    const int64_t K = a->K, nb = K / T::QK;
    const int64_t KB = hz_min<int64_t>(nb, HZ_KC / T::QK > 0 ? HZ_KC / T::QK : 1);
    // per-thread scratch: NR rows x KB blocks
    __m256i* qbuf = (__m256i*)aligned_alloc(32, sizeof(__m256i) * NR * KB * NC);
    __m256i* sbuf = (__m256i*)aligned_alloc(32, sizeof(__m256i) * NR * KB * NC);
    __m256* mbuf = (__m256*)aligned_alloc(32, sizeof(__m256) * NR * KB * 2);  // dmin * mn per 16, as float
    float* dbuf = (float*)aligned_alloc(32, sizeof(float) * ((NR * KB * 2 + 7) / 8 * 8));
    float* dmbuf = dbuf + NR * KB;
    const __m256i ones = _mm256_load_si256(hz_ones16());
    for (int64_t mc = 0; mc < M; mc += HZ_MC) {
        const int64_t me = hz_min<int64_t>(M, mc + HZ_MC);
        for (int64_t kp = 0; kp < nb; kp += KB) {
            const int64_t kb = hz_min<int64_t>(KB, nb - kp);
            for (int64_t nt = n0; nt < n1; nt += NR) {
                const int nr = (int)hz_min<int64_t>(NR, n1 - nt);
                for (int r = 0; r < NR; ++r) {
                    const uint8_t* row = W + (nt + (r < nr ? r : nr - 1)) * rb + kp * T::BYTES;
                    for (int64_t b = 0; b < kb; ++b) {
                        const uint8_t* blk = row + b * T::BYTES;
                        typename H::Prep p;
                        H::prep(blk, p);
                        for (int c = 0; c < NC; ++c) {
                            qbuf[(r * KB + b) * NC + c] = H::chunk(blk, p, c);
                            if constexpr (K256) sbuf[(r * KB + b) * NC + c] = scvec(p.sc16, c);
                        }
                        dbuf[r * KB + b] = p.d;
                        dmbuf[r * KB + b] = p.dmin;
                        if constexpr (K256 && H::HAS_MIN) {
                            const __m256 dm = _mm256_set1_ps(p.dmin);
                            mbuf[(r * KB + b) * 2] = _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(p.mn16))));
                            mbuf[(r * KB + b) * 2 + 1] = _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(p.mn16, 1))));
                        }
                    }
                }
                for (int64_t mt = mc; mt < me; mt += MR) {
                    const int mr = (int)hz_min<int64_t>(MR, me - mt);
                    const int8_t* xq[MR]; const float* xd[MR]; const float* xs[MR];
                    for (int m = 0; m < MR; ++m) {
                        int64_t mm = mt + (m < mr ? m : mr - 1);
                        xq[m] = a->q + mm * K + kp * T::QK; xd[m] = a->d + mm * nb + kp; xs[m] = a->sf + mm * (K / 16) + kp * (T::QK / 16);
                    }
                    __m256 acc[MR][NR];
                    float accs[MR][NR];
                    for (int m = 0; m < MR; ++m)
                        for (int r = 0; r < NR; ++r) { acc[m][r] = _mm256_setzero_ps(); accs[m][r] = 0.f; }
                    for (int64_t b = 0; b < kb; ++b) {
                        __m256i is[MR][NR];
                        for (int m = 0; m < MR; ++m)
                            for (int r = 0; r < NR; ++r) is[m][r] = _mm256_setzero_si256();
                        for (int c = 0; c < NC; ++c) {
                            __m256i x[MR];
                            for (int m = 0; m < MR; ++m) x[m] = _mm256_loadu_si256((const __m256i*)(xq[m] + b * T::QK + 32 * c));
                            for (int r = 0; r < NR; ++r) {
                                __m256i q = qbuf[(r * KB + b) * NC + c];
                                __m256i s = K256 ? sbuf[(r * KB + b) * NC + c] : ones;
                                for (int m = 0; m < MR; ++m) is[m][r] = dot_acc<H::SIGNED>(is[m][r], q, x[m], s);
                            }
                        }
                        for (int m = 0; m < MR; ++m) {
                            const float dx = xd[m][b];
                            for (int r = 0; r < NR; ++r) {
                                acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[m][r]), _mm256_set1_ps(dbuf[r * KB + b] * dx), acc[m][r]);
                                if constexpr (H::HAS_MIN) {
                                    if constexpr (K256) {
                                        acc[m][r] = _mm256_fnmadd_ps(mbuf[(r * KB + b) * 2], _mm256_loadu_ps(xs[m] + b * 16), acc[m][r]);
                                        acc[m][r] = _mm256_fnmadd_ps(mbuf[(r * KB + b) * 2 + 1], _mm256_loadu_ps(xs[m] + b * 16 + 8), acc[m][r]);
                                    } else {
                                        accs[m][r] += dmbuf[r * KB + b] * (xs[m][2 * b] + xs[m][2 * b + 1]);
                                    }
                                }
                            }
                        }
                    }
                    for (int m = 0; m < mr; ++m)
                        for (int r = 0; r < nr; ++r) {
                            float v = hsum8(acc[m][r]) - accs[m][r];
                            float* dst = y + (mt + m) * ldy + nt + r;
                            *dst = kp == 0 ? v : *dst + v;
                        }
                }
            }
        }
    }
    free(qbuf); free(sbuf); free(mbuf); free(dbuf);
}
