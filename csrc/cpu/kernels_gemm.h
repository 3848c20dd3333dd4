// Tiled int8 GEMM (prefill, large M) over the Hooks of kernels.h. Included by kernels.h inside
// namespace hz_<isa>, SIMD path only (HZ_ISA >= 1).
//
// For a tile of NR weight rows and a K panel, the weights are unpacked ONCE into an L1/L2-resident
// buffer (int8 values + pre-shuffled scale vectors); then all activation rows of an M block meet
// them in an MR x NR register tile of int32 accumulators (maddubs + madd per 32 values and entry).
// After each weight block the entries get a float fix-up (d * dx, and the min term of formats
// with one): ~20% of the kernel's time, so two variants, chosen per format by measurement:
//   gemm_simd_pairs  the int32 vectors of two weight rows are folded into one (unpack + add on
//                    the shuffle ports) and converted, scaled and accumulated together; a min
//                    that is an exact integer multiple of the scale (GemmMinRatio: Q6_K, Q3_K)
//                    is subtracted in int32 first. The 32-value formats, Q6_K, Q3_K and the
//                    256-value formats without a min (IQ*). Measured against the previous
//                    single kernel (= gemm_simd_rows), M=512, K=N=1536, 1 thread, best of
//                    runs: Q8_0 ~74-76 vs ~62-66 GFLOP/s, Q6_K ~102-110 vs ~99-104.
//   gemm_simd_rows   one float accumulator per entry, the min term as float FMAs of
//                    dmin * mn against dx * sum(x) per 16 values. 256-value formats whose min
//                    has its own float scale (Q2_K, Q4_K, Q5_K, TQ1_0, TQ2_0): faster for them
//                    than folding the mins in int32 with a second conversion (Q4_K: ~101-107
//                    vs ~94-100 GFLOP/s).
#if HZ_ISA >= 2
#define HZ_GEMM_MR 4
#define HZ_GEMM_NR 3
#else
#define HZ_GEMM_MR 3
#define HZ_GEMM_NR 3
#endif
// K panel (hz_gemm_kc values: NR*KC bytes of unpacked weights stay in L1) and M block (hz_gemm_mc
// rows: MC*KC activation bytes stay in L2): hz_api.h.

// dmin == R * d exactly in every block of these formats' Hooks (kernels.h), so the min term
// R * d * dx * sum_g mn_g * xs_g folds into the int32 dot. 0: no such relation.
template <class T> struct GemmMinRatio { static constexpr int value = 0; };
template <> struct GemmMinRatio<FQ6_K> { static constexpr int value = 32; };  // unsigned q6, min 32 * sc, dmin = 32 * d
template <> struct GemmMinRatio<FQ3_K> { static constexpr int value = 1; };   // min 4 * sc, dmin = d

// The integer part of one MR x NR register tile: is[m][r] = the int32 dot products of weight
// block b of tile row r (unpacked in qbuf, its per-16 scales in sbuf) with activation rows xq[m],
// chunk by 32-value chunk. Shared by both GEMM variants; always inlined into their loops.
template <class T, int MR, int NR>
static inline __attribute__((always_inline)) void gemm_int_tile(__m256i (&is)[MR][NR], const int8_t* const (&xq)[MR],
                                                                int64_t b, const __m256i* qbuf, const __m256i* sbuf,
                                                                int64_t KB, __m256i ones) {
    constexpr int NC = T::QK / 32;
    constexpr bool K256 = T::QK != 32;
    for (int m = 0; m < MR; ++m)
        for (int r = 0; r < NR; ++r) is[m][r] = _mm256_setzero_si256();
    for (int c = 0; c < NC; ++c) {
        __m256i x[MR];
        for (int m = 0; m < MR; ++m) x[m] = _mm256_loadu_si256((const __m256i*)(xq[m] + b * T::QK + 32 * c));
        for (int r = 0; r < NR; ++r) {
            const __m256i q = qbuf[(r * KB + b) * NC + c];
            const __m256i s = K256 ? sbuf[(r * KB + b) * NC + c] : ones;
            for (int m = 0; m < MR; ++m) is[m][r] = dot_acc<Hooks<T>::SIGNED>(is[m][r], q, x[m], s);
        }
    }
}

// Unpack one weight block into the panel buffers: its NC chunks of 32 int8 values at q[0..NC),
// and for 256-value blocks their int16 scale vectors at s[0..NC). Returns the block's Prep (d,
// dmin, mins) for the variant's fix-up data.
template <class T>
static inline __attribute__((always_inline)) typename Hooks<T>::Prep unpack_block(const uint8_t* blk, __m256i* q, __m256i* s) {
    typename Hooks<T>::Prep p;
    Hooks<T>::prep(blk, p);
    for (int c = 0; c < T::QK / 32; ++c) {
        q[c] = Hooks<T>::chunk(blk, p, c);
        if constexpr (T::QK != 32) s[c] = scvec(p.sc16, c);
    }
    return p;
}

// The activation rows of a register tile: rows mt.. (mr of them, the last repeated up to MR) from
// K panel kp: int8 values, per-block scales, per-16 float and int16 sums.
template <class T, int MR>
struct TileRows {
    const int8_t* q[MR]; const float* d[MR]; const float* sf[MR]; const int16_t* s16[MR];
    TileRows(const HzAct* a, int64_t mt, int mr, int64_t kp) {
        const int64_t K = a->K, nb = K / T::QK;
        for (int m = 0; m < MR; ++m) {
            const int64_t mm = mt + (m < mr ? m : mr - 1);
            q[m] = a->q + mm * K + kp * T::QK; d[m] = a->d + mm * nb + kp;
            sf[m] = a->sf + mm * (K / 16) + kp * (T::QK / 16); s16[m] = a->s + mm * (K / 16) + kp * (T::QK / 16);
        }
    }
};

template <class T>
static void gemm_simd_rows(const uint8_t* W, int64_t rb, int64_t n0, int64_t n1, const HzAct* a, int64_t M,
                      float* y, int64_t ldy) {
    typedef Hooks<T> H;
    constexpr int MR = HZ_GEMM_MR, NR = HZ_GEMM_NR, NC = T::QK / 32;
    constexpr bool K256 = T::QK != 32;
    const int64_t K = a->K, nb = K / T::QK;
    const int64_t KB = hz_min<int64_t>(nb, hz_gemm_kc / T::QK > 0 ? hz_gemm_kc / T::QK : 1);
    // per-thread scratch: NR rows x KB blocks
    __m256i* qbuf = (__m256i*)aligned_alloc(32, sizeof(__m256i) * NR * KB * NC);
    __m256i* sbuf = (__m256i*)aligned_alloc(32, sizeof(__m256i) * NR * KB * NC);
    __m256* mbuf = (__m256*)aligned_alloc(32, sizeof(__m256) * NR * KB * 2);  // dmin * mn per 16, as float
    float* dbuf = (float*)aligned_alloc(32, sizeof(float) * ((NR * KB * 2 + 7) / 8 * 8));
    float* dmbuf = dbuf + NR * KB;
    const __m256i ones = _mm256_load_si256(hz_ones16());
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
                    const TileRows<T, MR> tr(a, mt, mr, kp);
                    const int8_t* const (&xq)[MR] = tr.q; const float* const (&xd)[MR] = tr.d; const float* const (&xs)[MR] = tr.sf;
                    __m256 acc[MR][NR];
                    float accs[MR][NR];
                    for (int m = 0; m < MR; ++m)
                        for (int r = 0; r < NR; ++r) { acc[m][r] = _mm256_setzero_ps(); accs[m][r] = 0.f; }
                    for (int64_t b = 0; b < kb; ++b) {
                        __m256i is[MR][NR];
                        gemm_int_tile<T, MR, NR>(is, xq, b, qbuf, sbuf, KB, ones);
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

template <class T>
static void gemm_simd_pairs(const uint8_t* W, int64_t rb, int64_t n0, int64_t n1, const HzAct* a, int64_t M,
                      float* y, int64_t ldy) {
    typedef Hooks<T> H;
    constexpr int MR = HZ_GEMM_MR, NR = HZ_GEMM_NR, NC = T::QK / 32, NP = NR / 2;  // NP row pairs
    constexpr bool K256 = T::QK != 32;
    constexpr int RATIO = K256 && H::HAS_MIN ? GemmMinRatio<T>::value : 0;
    static_assert(!(K256 && H::HAS_MIN && RATIO == 0), "K-quant mins without an integer ratio: gemm_simd_rows");
    const int64_t K = a->K, nb = K / T::QK;
    const int64_t KB = hz_min<int64_t>(nb, hz_gemm_kc / T::QK > 0 ? hz_gemm_kc / T::QK : 1);
    // per-thread scratch: NR rows x KB blocks
    __m256i* qbuf = (__m256i*)aligned_alloc(32, sizeof(__m256i) * NR * KB * NC);
    __m256i* sbuf = (__m256i*)aligned_alloc(32, sizeof(__m256i) * NR * KB * NC);
    __m256i* ibuf = (__m256i*)aligned_alloc(32, sizeof(__m256i) * NR * KB);   // RATIO: int16 mn per 16
    __m256* pbuf = (__m256*)aligned_alloc(32, sizeof(__m256) * (NP + 1) * KB);  // [d_r d_r+1 x4] per pair, [d_r x8]
    float* dmbuf = (float*)aligned_alloc(32, sizeof(float) * ((NR * KB + 7) / 8 * 8));
    const __m256i ones = _mm256_load_si256(hz_ones16());
    for (int64_t mc = 0; mc < M; mc += hz_gemm_mc) {
        const int64_t me = hz_min<int64_t>(M, mc + hz_gemm_mc);
        for (int64_t kp = 0; kp < nb; kp += KB) {
            const int64_t kb = hz_min<int64_t>(KB, nb - kp);
            for (int64_t nt = n0; nt < n1; nt += NR) {
                const int nr = (int)hz_min<int64_t>(NR, n1 - nt);
                for (int64_t b = 0; b < kb; ++b) {
                    float d[NR];
                    for (int r = 0; r < NR; ++r) {
                        const uint8_t* blk = W + (nt + (r < nr ? r : nr - 1)) * rb + (kp + b) * T::BYTES;
                        const typename H::Prep p = unpack_block<T>(blk, qbuf + (r * KB + b) * NC, sbuf + (r * KB + b) * NC);
                        d[r] = p.d;
                        dmbuf[r * KB + b] = p.dmin;
                        if constexpr (RATIO != 0) ibuf[r * KB + b] = p.mn16;
                    }
                    for (int j = 0; j < NP; ++j)
                        pbuf[b * (NP + 1) + j] = _mm256_setr_ps(d[2 * j], d[2 * j + 1], d[2 * j], d[2 * j + 1],
                                                                d[2 * j], d[2 * j + 1], d[2 * j], d[2 * j + 1]);
                    pbuf[b * (NP + 1) + NP] = _mm256_set1_ps(d[NR - 1]);
                }
                for (int64_t mt = mc; mt < me; mt += MR) {
                    const int mr = (int)hz_min<int64_t>(MR, me - mt);
                    const TileRows<T, MR> tr(a, mt, mr, kp);
                    const int8_t* const (&xq)[MR] = tr.q; const float* const (&xd)[MR] = tr.d;
                    const float* const (&xs)[MR] = tr.sf; const int16_t* const (&xs16)[MR] = tr.s16;
                    // accp[m][j]: rows 2j (even lanes) and 2j+1 (odd lanes); acc1[m]: row NR-1 when NR is odd;
                    // accs[m][r]: QK 32 mins
                    __m256 accp[MR][NP > 0 ? NP : 1], acc1[MR];
                    float accs[MR][NR];
                    for (int m = 0; m < MR; ++m) {
                        for (int j = 0; j < NP; ++j) accp[m][j] = _mm256_setzero_ps();
                        acc1[m] = _mm256_setzero_ps();
                        for (int r = 0; r < NR; ++r) accs[m][r] = 0.f;
                    }
                    for (int64_t b = 0; b < kb; ++b) {
                        __m256i is[MR][NR];
                        gemm_int_tile<T, MR, NR>(is, xq, b, qbuf, sbuf, KB, ones);
                        for (int m = 0; m < MR; ++m) {
                            const __m256 dx = _mm256_broadcast_ss(xd[m] + b);
                            if constexpr (RATIO != 0) {  // is -= RATIO * sum_g mn_g * xs_g (exact)
                                const __m256i xsv = _mm256_loadu_si256((const __m256i*)(xs16[m] + b * 16));
                                for (int r = 0; r < NR; ++r) {
                                    __m256i ms = _mm256_madd_epi16(ibuf[r * KB + b], xsv);
                                    if constexpr (RATIO == 32) ms = _mm256_slli_epi32(ms, 5);
                                    else if constexpr (RATIO != 1) ms = _mm256_mullo_epi32(ms, _mm256_set1_epi32(RATIO));
                                    is[m][r] = _mm256_sub_epi32(is[m][r], ms);
                                }
                            }
                            for (int j = 0; j < NP; ++j) {
                                const __m256i u = is[m][2 * j], v = is[m][2 * j + 1];
                                const __m256i t = _mm256_add_epi32(_mm256_unpacklo_epi32(u, v), _mm256_unpackhi_epi32(u, v));
                                accp[m][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(pbuf[b * (NP + 1) + j], dx), accp[m][j]);
                            }
                            if constexpr (NR % 2 == 1)
                                acc1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[m][NR - 1]), _mm256_mul_ps(pbuf[b * (NP + 1) + NP], dx), acc1[m]);
                            if constexpr (!K256 && H::HAS_MIN) {
                                const float sx = xs[m][2 * b] + xs[m][2 * b + 1];
                                for (int r = 0; r < NR; ++r) accs[m][r] += dmbuf[r * KB + b] * sx;
                            }
                        }
                    }
                    for (int m = 0; m < mr; ++m) {
                        float o[NR];
                        for (int j = 0; j < NP; ++j) {
                            alignas(32) float l[8];
                            _mm256_store_ps(l, accp[m][j]);
                            o[2 * j] = (l[0] + l[2]) + (l[4] + l[6]);
                            o[2 * j + 1] = (l[1] + l[3]) + (l[5] + l[7]);
                        }
                        if constexpr (NR % 2 == 1) o[NR - 1] = hsum8(acc1[m]);
                        for (int r = 0; r < nr; ++r) {
                            float v = o[r] - accs[m][r];
                            float* dst = y + (mt + m) * ldy + nt + r;
                            *dst = kp == 0 ? v : *dst + v;
                        }
                    }
                }
            }
        }
    }
    free(qbuf); free(sbuf); free(ibuf); free(pbuf); free(dmbuf);
}

// Row-interleaved GEMM of Q4_K (the 256-bit path; HANZO_CPU_REPACK=0 / hz_cpu_repack = 0 turns it
// off). Each K panel of 8 weight rows is repacked once per M block so that one vector holds 4
// consecutive values of all 8 rows (32-bit lane r = row r): one broadcast of 4 activation bytes
// then feeds 8 rows in one vpmaddubsw, and the accumulator lanes are output rows. Within a
// 32-value sub-block the scale is constant along K, so its 8 vpmaddubsw results add up in int16
// (|sum| <= 8 * 2 * 15 * 128 = 30720: exact) before one vpmaddwd applies the 8 rows' scales:
// 9 multiplies per 256 products and row group instead of the 16 of gemm_simd_rows. The float
// fix-up (d, and dmin times the mins against the activation's per-32 sums, both in int32 first)
// runs once per block on 8 rows at a time. Same integers as gemm_simd_rows; only the float32
// summation order differs.
#define HZ_IL_ROWS 8
#define HZ_IL_MR 4
#define HZ_IL_MIN_M 16  // fewer activation rows: the repack is not amortized, gemm_simd_rows runs

// out[g], lane r = 32-bit element g of in[r] (an 8 x 8 transpose of 32-bit elements).
static inline __attribute__((always_inline)) void transpose8x32(const __m256i (&in)[8], __m256i* out) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
    }
    for (int h = 0; h < 2; ++h) {  // rows 4h..4h+3
        u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);      // elements 0 | 4
        u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);      // 1 | 5
        u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);  // 2 | 6
        u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);  // 3 | 7
    }
    for (int g = 0; g < 4; ++g) {
        out[g] = _mm256_permute2x128_si256(u[g], u[4 + g], 0x20);
        out[g + 4] = _mm256_permute2x128_si256(u[g], u[4 + g], 0x31);
    }
}

static void gemm_il_q4k(const uint8_t* W, int64_t rb, int64_t n0, int64_t n1, const HzAct* a, int64_t M,
                        float* y, int64_t ldy) {
    typedef Hooks<FQ4_K> H;
    constexpr int NR = HZ_IL_ROWS, MR = HZ_IL_MR;
    const int64_t K = a->K, nb = K / 256;
    const int64_t KB = hz_min<int64_t>(nb, hz_gemm_kc / 256 > 0 ? hz_gemm_kc / 256 : 1);
    const int64_t MC = hz_min<int64_t>(M, hz_gemm_mc);
    // panel: per block 64 value vectors [sub-block j][group g], 8 scale vectors, 4 min vectors, d, dmin
    __m256i* qbuf = (__m256i*)aligned_alloc(32, sizeof(__m256i) * KB * 64);
    __m256i* sbuf = (__m256i*)aligned_alloc(32, sizeof(__m256i) * KB * 8);
    __m256i* mbuf = (__m256i*)aligned_alloc(32, sizeof(__m256i) * KB * 4);
    __m256* dbuf = (__m256*)aligned_alloc(32, sizeof(__m256) * KB * 2);
    // activation rows of the M block: per block 4 int32, each two per-32 sums as int16
    // (sub-blocks 2p, 2p + 1; |sum| <= 32 * 127), against the min vectors' lanes
    int32_t* xpb = (int32_t*)aligned_alloc(32, (sizeof(int32_t) * MC * KB * 4 + 31) / 32 * 32);
    const __m256i ones = _mm256_load_si256(hz_ones16());
    const int64_t mtiles = (MC + MR - 1) / MR;
    const __m256i mnpick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                            0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    for (int64_t mc = 0; mc < M; mc += hz_gemm_mc) {
        const int64_t me = hz_min<int64_t>(M, mc + hz_gemm_mc);
        for (int64_t kp = 0; kp < nb; kp += KB) {
            const int64_t kb = hz_min<int64_t>(KB, nb - kp);
            for (int64_t m = mc; m < me; ++m)
                for (int64_t b = 0; b < kb; ++b) {
                    const __m256i t = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(a->s + m * (K / 16) + (kp + b) * 16)), ones);
                    const __m256i pk = _mm256_permute4x64_epi64(_mm256_packs_epi32(t, t), 0x08);
                    _mm_storeu_si128((__m128i*)(xpb + ((m - mc) * KB + b) * 4), _mm256_castsi256_si128(pk));
                }
            // the next panel's weight rows, spread over this panel's register tiles (its repack would
            // otherwise wait on memory with nothing to overlap): ~8% on [1536, 8960] and [8960, 1536]
            const int64_t plines = (kb * FQ4_K::BYTES + 63) / 64, per = (NR * plines + mtiles - 1) / mtiles;
            for (int64_t nt = n0; nt < n1; nt += NR) {
                const int nr = (int)hz_min<int64_t>(NR, n1 - nt);
                for (int64_t b = 0; b < kb; ++b) {
                    const uint8_t* blk[NR];
                    H::Prep p[NR];
                    __m256i v[NR], tm[8];
                    alignas(32) float d[NR], dm[NR];
                    for (int r = 0; r < NR; ++r) {
                        blk[r] = W + (nt + (r < nr ? r : nr - 1)) * rb + (kp + b) * FQ4_K::BYTES;
                        H::prep(blk[r], p[r]);
                        d[r] = p[r].d;
                        dm[r] = p[r].dmin;
                        v[r] = p[r].sc16;  // 32-bit element j: sc_j in both halves
                    }
                    transpose8x32(v, sbuf + b * 8);
                    for (int r = 0; r < NR; ++r)  // 32-bit element q: mn_2q, mn_2q+1
                        v[r] = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(p[r].mn16, mnpick), 0x08);
                    transpose8x32(v, tm);
                    for (int q = 0; q < 4; ++q) mbuf[b * 4 + q] = tm[q];
                    dbuf[2 * b] = _mm256_load_ps(d);
                    dbuf[2 * b + 1] = _mm256_load_ps(dm);
                    for (int j = 0; j < 8; ++j) {
                        for (int r = 0; r < NR; ++r) v[r] = H::chunk(blk[r], p[r], j);
                        transpose8x32(v, qbuf + (b * 8 + j) * 8);
                    }
                }
                int64_t pl = 0;  // next panel's cache lines prefetched so far
                for (int64_t mt = mc; mt < me; mt += MR) {
                    if (nt + NR < n1)
                        for (const int64_t e = hz_min<int64_t>(pl + per, NR * plines); pl < e; ++pl) {
                            const int64_t row = hz_min<int64_t>(nt + NR + pl / plines, n1 - 1);
                            _mm_prefetch((const char*)(W + row * rb + kp * FQ4_K::BYTES + 64 * (pl % plines)), _MM_HINT_T0);
                        }
                    const int mr = (int)hz_min<int64_t>(MR, me - mt);
                    const int8_t* xq[MR]; const float* xd[MR]; const int32_t* xp[MR];
                    for (int m = 0; m < MR; ++m) {
                        const int64_t mm = mt + (m < mr ? m : mr - 1);
                        xq[m] = a->q + mm * K + kp * 256;
                        xd[m] = a->d + mm * nb + kp;
                        xp[m] = xpb + (mm - mc) * KB * 4;
                    }
                    __m256 acc[MR];
                    for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
                    for (int64_t b = 0; b < kb; ++b) {
                        __m256i is[MR];
                        for (int m = 0; m < MR; ++m) is[m] = _mm256_setzero_si256();
                        for (int j = 0; j < 8; ++j) {
                            const __m256i* wq = qbuf + (b * 8 + j) * 8;
#if HZ_ISA >= 2
                            // VNNI: vpdpbusd sums each lane's 4 products in int32 (the integers of the
                            // vpmaddubsw chain below, which is exact), then the 6-bit scale in int32
                            __m256i s32[MR];
                            for (int m = 0; m < MR; ++m) s32[m] = _mm256_setzero_si256();
                            for (int g = 0; g < 8; ++g) {
                                const __m256i w = _mm256_load_si256(wq + g);
                                for (int m = 0; m < MR; ++m)
                                    s32[m] = _mm256_dpbusd_epi32(s32[m], w, _mm256_set1_epi32((int)rd_u32((const uint8_t*)(xq[m] + b * 256 + 32 * j + 4 * g))));
                            }
                            const __m256i sc = _mm256_and_si256(sbuf[b * 8 + j], _mm256_set1_epi32(0xFFFF));
                            for (int m = 0; m < MR; ++m) is[m] = _mm256_add_epi32(is[m], _mm256_mullo_epi32(s32[m], sc));
#else
                            __m256i s16[MR];
                            for (int m = 0; m < MR; ++m) s16[m] = _mm256_setzero_si256();
                            for (int g = 0; g < 8; ++g) {
                                const __m256i w = _mm256_load_si256(wq + g);
                                for (int m = 0; m < MR; ++m) {
                                    const __m256i x = _mm256_set1_epi32((int)rd_u32((const uint8_t*)(xq[m] + b * 256 + 32 * j + 4 * g)));
                                    s16[m] = _mm256_add_epi16(s16[m], _mm256_maddubs_epi16(w, x));
                                    // keeps the sums chained: GCC otherwise reassociates the 32 adds into a tree of
                                    // 32 live products, spilled to the stack (measured ~40% slower)
                                    __asm__("" : "+x"(s16[m]));
                                }
                            }
                            const __m256i sc = sbuf[b * 8 + j];
                            for (int m = 0; m < MR; ++m) is[m] = _mm256_add_epi32(is[m], _mm256_madd_epi16(s16[m], sc));
#endif
                        }
                        for (int m = 0; m < MR; ++m) {
                            __m256i ms = _mm256_madd_epi16(mbuf[b * 4], _mm256_set1_epi32(xp[m][b * 4]));
                            for (int q = 1; q < 4; ++q)
                                ms = _mm256_add_epi32(ms, _mm256_madd_epi16(mbuf[b * 4 + q], _mm256_set1_epi32(xp[m][b * 4 + q])));
                            const __m256 dx = _mm256_broadcast_ss(xd[m] + b);
                            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[m]), _mm256_mul_ps(dbuf[2 * b], dx), acc[m]);
                            acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_mul_ps(dbuf[2 * b + 1], dx), acc[m]);
                        }
                    }
                    for (int m = 0; m < mr; ++m) {
                        alignas(32) float o[NR];
                        _mm256_store_ps(o, acc[m]);
                        float* dst = y + (mt + m) * ldy + nt;
                        for (int r = 0; r < nr; ++r) dst[r] = kp == 0 ? o[r] : dst[r] + o[r];
                    }
                }
            }
        }
    }
    free(qbuf); free(sbuf); free(mbuf); free(dbuf); free(xpb);
}

// Row-interleaved GEMM of Q6_K, the same panel layout as gemm_il_q4k (32-bit lane r = 4
// consecutive values of row r). vpmaddubsw takes the activations as its unsigned operand, offset
// by 128 (x + 128 in 0..255, an M-block copy), and the weights as the signed one, q6 - 32 in
// -32..31, so no per-activation-row min term is left: sum (x + 128) w = sum x w + 128 sum w, and
// 128 * sum_g sc_g * sum w of each row and block comes from the repack. A 16-value sub-block has
// its own scale, and 4 vpmaddubsw results of one could reach 8 * 255 * 32 = 65280 in an int16 lane,
// so every 2 of them (at most 4 * 255 * 32 = 32640: exact) go through one vpmaddwd with the 8
// rows' scales: 12 multiplies per 256 products and 8 rows, the row tiles take 16. The next
// panel's weights are prefetched while this one meets the activations (its repack would
// otherwise wait on memory). Same integers as the row tiles (gemm_simd_pairs); only the float32
// summation order differs.
static void gemm_il_q6k(const uint8_t* W, int64_t rb, int64_t n0, int64_t n1, const HzAct* a, int64_t M,
                        float* y, int64_t ldy) {
    typedef Hooks<FQ6_K> H;
    constexpr int NR = HZ_IL_ROWS, MR = HZ_IL_MR;
    const int64_t K = a->K, nb = K / 256;
    const int64_t KB = hz_min<int64_t>(nb, hz_gemm_kc / 256 > 0 ? hz_gemm_kc / 256 : 1);
    const int64_t MC = hz_min<int64_t>(M, hz_gemm_mc);
    // panel: per block 64 value vectors [chunk c][group e], 16 scale vectors (lane r: sc_g twice),
    // the offset correction (lane r: 128 * sum_g sc_g * sum w), d
    __m256i* qbuf = (__m256i*)aligned_alloc(32, sizeof(__m256i) * KB * 64);
    __m256i* sbuf = (__m256i*)aligned_alloc(32, sizeof(__m256i) * KB * 16);
    __m256i* cbuf = (__m256i*)aligned_alloc(32, sizeof(__m256i) * KB);
    __m256* dbuf = (__m256*)aligned_alloc(32, sizeof(__m256) * KB);
    uint8_t* xu = (uint8_t*)aligned_alloc(32, MC * KB * 256);  // x + 128 of the M block's K panel
    const __m256i k32 = _mm256_set1_epi8(32), k80 = _mm256_set1_epi8((char)0x80), ones8 = _mm256_set1_epi8(1);
    const int64_t mtiles = (MC + MR - 1) / MR;
    for (int64_t mc = 0; mc < M; mc += hz_gemm_mc) {
        const int64_t me = hz_min<int64_t>(M, mc + hz_gemm_mc);
        for (int64_t kp = 0; kp < nb; kp += KB) {
            const int64_t kb = hz_min<int64_t>(KB, nb - kp);
            for (int64_t m = mc; m < me; ++m)
                for (int64_t i = 0; i < kb * 256; i += 32)
                    _mm256_store_si256((__m256i*)(xu + (m - mc) * KB * 256 + i),
                                       _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(a->q + m * K + kp * 256 + i)), k80));
            const int64_t plines = (kb * FQ6_K::BYTES + 63) / 64, per = (NR * plines + mtiles - 1) / mtiles;
            for (int64_t nt = n0; nt < n1; nt += NR) {
                const int nr = (int)hz_min<int64_t>(NR, n1 - nt);
                for (int64_t b = 0; b < kb; ++b) {
                    const uint8_t* blk[NR];
                    H::Prep p[NR];
                    __m256i v[NR], t[8];
                    alignas(32) float d[NR];
                    for (int r = 0; r < NR; ++r) {
                        blk[r] = W + (nt + (r < nr ? r : nr - 1)) * rb + (kp + b) * FQ6_K::BYTES;
                        H::prep(blk[r], p[r]);
                        d[r] = p[r].d;
                        v[r] = _mm256_unpacklo_epi16(p[r].sc16, p[r].sc16);  // 32-bit elements: sc_0..3 | sc_8..11, each twice
                    }
                    transpose8x32(v, t);
                    for (int e = 0; e < 4; ++e) { sbuf[b * 16 + e] = t[e]; sbuf[b * 16 + 8 + e] = t[4 + e]; }
                    for (int r = 0; r < NR; ++r) v[r] = _mm256_unpackhi_epi16(p[r].sc16, p[r].sc16);  // sc_4..7 | sc_12..15
                    transpose8x32(v, t);
                    for (int e = 0; e < 4; ++e) { sbuf[b * 16 + 4 + e] = t[e]; sbuf[b * 16 + 12 + e] = t[4 + e]; }
                    dbuf[b] = _mm256_load_ps(d);
                    __m256i cs = _mm256_setzero_si256();
                    for (int c = 0; c < 8; ++c) {
                        for (int r = 0; r < NR; ++r) v[r] = _mm256_sub_epi8(H::chunk(blk[r], p[r], c), k32);
                        __m256i* o = qbuf + (b * 8 + c) * 8;
                        transpose8x32(v, o);
                        for (int h = 0; h < 2; ++h) {  // sub-block 2c + h: sum w per row (|.| <= 512), times sc_g
                            __m256i sw = _mm256_maddubs_epi16(ones8, o[4 * h]);
                            for (int e = 1; e < 4; ++e) sw = _mm256_add_epi16(sw, _mm256_maddubs_epi16(ones8, o[4 * h + e]));
                            cs = _mm256_add_epi32(cs, _mm256_madd_epi16(sw, sbuf[b * 16 + 2 * c + h]));
                        }
                    }
                    cbuf[b] = _mm256_slli_epi32(cs, 7);  // |128 * sum| <= 128 * 16 * 128 * 512 < 2^31
                }
                int64_t pl = 0;  // next panel's cache lines prefetched so far
                for (int64_t mt = mc; mt < me; mt += MR) {
                    if (nt + NR < n1)
                        for (const int64_t e = hz_min<int64_t>(pl + per, NR * plines); pl < e; ++pl) {
                            const int64_t row = hz_min<int64_t>(nt + NR + pl / plines, n1 - 1);
                            _mm_prefetch((const char*)(W + row * rb + kp * FQ6_K::BYTES + 64 * (pl % plines)), _MM_HINT_T0);
                        }
                    const int mr = (int)hz_min<int64_t>(MR, me - mt);
                    const uint8_t* xq[MR]; const float* xd[MR];
                    for (int m = 0; m < MR; ++m) {
                        const int64_t mm = mt + (m < mr ? m : mr - 1);
                        xq[m] = xu + (mm - mc) * KB * 256;
                        xd[m] = a->d + mm * nb + kp;
                    }
                    __m256 acc[MR];
                    for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
                    for (int64_t b = 0; b < kb; ++b) {
                        __m256i is[MR];
                        for (int m = 0; m < MR; ++m) is[m] = _mm256_setzero_si256();
                        for (int c = 0; c < 8; ++c) {
                            const __m256i* wq = qbuf + (b * 8 + c) * 8;
#if HZ_ISA >= 2
                            // VNNI: per 16-value sub-block, vpdpbusd sums each lane's products in int32
                            // (|.| <= 16 * 255 * 32), then its int8 scale (the high int16 of the lane,
                            // sign-extended) in int32: the integers of the vpmaddubsw pairs below
                            for (int sb = 0; sb < 2; ++sb) {
                                const __m256i sc = _mm256_srai_epi32(sbuf[b * 16 + 2 * c + sb], 16);
                                for (int m = 0; m < MR; ++m) {
                                    const uint8_t* x = xq[m] + b * 256 + 32 * c + 16 * sb;
                                    __m256i s32 = _mm256_setzero_si256();
                                    for (int e = 0; e < 4; ++e)
                                        s32 = _mm256_dpbusd_epi32(s32, _mm256_set1_epi32((int)rd_u32(x + 4 * e)), _mm256_load_si256(wq + 4 * sb + e));
                                    is[m] = _mm256_add_epi32(is[m], _mm256_mullo_epi32(s32, sc));
                                }
                            }
#else
                            for (int h = 0; h < 4; ++h) {  // 8 values: groups 2h, 2h + 1 of chunk c
                                const __m256i sc = sbuf[b * 16 + 2 * c + (h >> 1)];
                                const __m256i w0 = _mm256_load_si256(wq + 2 * h), w1 = _mm256_load_si256(wq + 2 * h + 1);
                                for (int m = 0; m < MR; ++m) {
                                    const uint8_t* x = xq[m] + b * 256 + 32 * c + 8 * h;
                                    const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_set1_epi32((int)rd_u32(x)), w0),
                                                                         _mm256_maddubs_epi16(_mm256_set1_epi32((int)rd_u32(x + 4)), w1));
                                    is[m] = _mm256_add_epi32(is[m], _mm256_madd_epi16(s16, sc));
                                    __asm__("" : "+x"(is[m]));  // chained: as in gemm_il_q4k, GCC otherwise spills a tree of products
                                }
                            }
#endif
                        }
                        for (int m = 0; m < MR; ++m) {
                            const __m256 dx = _mm256_broadcast_ss(xd[m] + b);
                            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(is[m], cbuf[b])), _mm256_mul_ps(dbuf[b], dx), acc[m]);
                        }
                    }
                    for (int m = 0; m < mr; ++m) {
                        alignas(32) float o[NR];
                        _mm256_store_ps(o, acc[m]);
                        float* dst = y + (mt + m) * ldy + nt;
                        for (int r = 0; r < nr; ++r) dst[r] = kp == 0 ? o[r] : dst[r] + o[r];
                    }
                }
            }
        }
    }
    free(qbuf); free(sbuf); free(cbuf); free(dbuf); free(xu);
}

#if HZ_ISA >= 2
#include "kernels_gemm512.h"
#endif

template <class T>
static void gemm_simd(const uint8_t* W, int64_t rb, int64_t n0, int64_t n1, const HzAct* a, int64_t M,
                      float* y, int64_t ldy) {
    // Q4_K and Q6_K run on the interleaved panels on every SIMD level: on AVX-512 (Zen 4) the
    // 256-bit panel kernels measure 1.6x the 512-bit row tiles (benchmarks/RESULTS.md)
    if constexpr (T::ID == FQ4_K::ID) {
        if (hz_cpu_repack && M >= HZ_IL_MIN_M) {
            gemm_il_q4k(W, rb, n0, n1, a, M, y, ldy);
            return;
        }
    }
    if constexpr (T::ID == FQ6_K::ID) {
        if (hz_cpu_repack && M >= HZ_IL_MIN_M) {
            gemm_il_q6k(W, rb, n0, n1, a, M, y, ldy);
            return;
        }
    }
#if HZ_ISA >= 2
    if (hz_gemm512) {
        if constexpr (T::QK == 32) gemm512_32<T>(W, rb, n0, n1, a, M, y, ldy);
        else gemm512_k<T>(W, rb, n0, n1, a, M, y, ldy);
        return;
    }
#endif
    // the min terms of blocks other than 32 values read 16 sums per block (xs + b * 16)
    static_assert(T::QK == 32 || T::QK == 256 || !Hooks<T>::HAS_MIN, "a min term needs 32- or 256-value blocks");
    if constexpr (T::QK != 32 && Hooks<T>::HAS_MIN && GemmMinRatio<T>::value == 0)
        gemm_simd_rows<T>(W, rb, n0, n1, a, M, y, ldy);
    else
        gemm_simd_pairs<T>(W, rb, n0, n1, a, M, y, ldy);
}
