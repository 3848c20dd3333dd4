// Mat-vec (decode, small M) kernels over the Hooks of kernels.h. Included by kernels.h inside
// namespace hz_<isa>, SIMD path only (HZ_ISA >= 1).

// One activation row (M == 1, the decode case), one weight row at a time (two interleaved rows
// measured no faster for Q4_0 and 30% slower for Q8_0 from DRAM, and spill registers for the
// K-quants). 32-value formats with signed integers (Hooks::S8) need no min term: Q4_0/Q5_0 dot
// maddubs(q, x) with off * sum(x) subtracted per 4 blocks, the others |x| * sign(q, x) (Q8_0:
// |q| * sign(x, q), as q can be -128); 4 blocks per step share one float fix-up (see the loop;
// A/B 1 thread, Zen 3, L2-resident: Q4_0 1.58x, IQ4_NL 1.40x, Q5_0 1.31x, Q8_0 1.19x).
// K-quants: scales by immediate vpshufd (scale_q), the min folded into int32 when dmin = 2^k d
// (Q6_K, Q3_K), d and dmin converted together (Q4_K, Q5_K).

// Scales of 4 consecutive blocks (S8 formats), as floats.
template <class T>
static inline __m128 dval4(const uint8_t* b) {
    typedef Hooks<T> H;
    if constexpr (H::D16) {
        const uint64_t h = (uint64_t)rd_u16(b) | (uint64_t)rd_u16(b + T::BYTES) << 16 |
                           (uint64_t)rd_u16(b + 2 * T::BYTES) << 32 | (uint64_t)rd_u16(b + 3 * T::BYTES) << 48;
        return _mm_cvtph_ps(_mm_cvtsi64_si128((long long)h));
    } else {
        return _mm_setr_ps(H::dval(b), H::dval(b + T::BYTES), H::dval(b + 2 * T::BYTES), H::dval(b + 3 * T::BYTES));
    }
}

template <class T>
static inline float matvec_row(const uint8_t* row, const HzAct* a, int64_t m) {
    typedef Hooks<T> H;
    const int64_t K = a->K, nb = K / T::QK;
    const int8_t* xq = a->q + m * K; const float* xd = a->d + m * nb; const int16_t* xs = a->s + m * (K / 16);
    const __m256i ones = _mm256_load_si256(hz_ones16());
    __m256 acc = _mm256_setzero_ps();
    if constexpr (T::QK == 32) {
      if constexpr (H::S8) {
        // Four blocks per step: their int32 dot vectors fold (unpack + add) into one vector that
        // holds, in each 128-bit lane, a partial sum of each of the 4 blocks, so one conversion and
        // one fmadd with the 4 scales d_w * d_x (dval4, in both lanes) replace four of each.
        // off_later: Q4_0/Q5_0 dot q * x only; the 4-block step subtracts off * sum(x) per block
        // in int32 from the activation's sums per 16 (xs), a quarter of the work of maddubs(off, x).
        auto idot = [&](const uint8_t* blk, int64_t b, bool off_later) -> __m256i {
            const __m256i x = _mm256_loadu_si256((const __m256i*)(xq + b * 32));
            __m256i p;
            if constexpr (H::U_OFF != 0) {  // sum (q - off) x = maddubs(q, x) - maddubs(off, x)
                p = _mm256_maddubs_epi16(H::chunk(blk, typename H::Prep(), 0), x);
                if (!off_later) p = _mm256_sub_epi16(p, _mm256_maddubs_epi16(_mm256_set1_epi8((char)H::U_OFF), x));
            } else {
                const __m256i q = H::qs8(blk);
                p = H::Q_MIN128 ? _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q))
                                : _mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(q, x));
            }
            return _mm256_madd_epi16(p, ones);
        };
        int64_t b = 0;
        for (; b + 4 <= nb; b += 4) {
            const uint8_t* blk = row + b * T::BYTES;
            hz_prefetch_stream(a, blk, 4 * T::BYTES);
            const __m256i v0 = idot(blk, b, true), v1 = idot(blk + T::BYTES, b + 1, true);
            const __m256i v2 = idot(blk + 2 * T::BYTES, b + 2, true), v3 = idot(blk + 3 * T::BYTES, b + 3, true);
            const __m256i t01 = _mm256_add_epi32(_mm256_unpacklo_epi32(v0, v1), _mm256_unpackhi_epi32(v0, v1));
            const __m256i t23 = _mm256_add_epi32(_mm256_unpacklo_epi32(v2, v3), _mm256_unpackhi_epi32(v2, v3));
            __m256i t = _mm256_add_epi32(_mm256_unpacklo_epi64(t01, t23), _mm256_unpackhi_epi64(t01, t23));
            if constexpr (H::U_OFF != 0) {  // - off * [sum x of blocks b..b+3], in the low lane only
                static_assert((H::U_OFF & (H::U_OFF - 1)) == 0, "U_OFF must be a power of two");
                const __m128i sx = _mm_madd_epi16(_mm_loadu_si128((const __m128i*)(xs + 2 * b)), _mm_set1_epi16(1));
                t = _mm256_sub_epi32(t, _mm256_set_m128i(_mm_setzero_si128(), _mm_slli_epi32(sx, __builtin_ctz(H::U_OFF))));
            }
            const __m128 s4 = _mm_mul_ps(dval4<T>(blk), _mm_loadu_ps(xd + b));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set_m128(s4, s4), acc);
        }
        for (; b < nb; ++b) {
            const uint8_t* blk = row + b * T::BYTES;
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot(blk, b, false)), _mm256_set1_ps(H::dval(blk) * xd[b]), acc);
        }
      } else {  // 32-value formats with a float min (Q4_1, Q5_1): two blocks per iteration, two accumulators
        __m256 acc2 = _mm256_setzero_ps();
        float accs[2] = {0.f, 0.f};
        auto block = [&](int64_t b, __m256& ac, float& as, bool pf) {
            const uint8_t* blk = row + b * T::BYTES;
            if (pf)
                hz_prefetch_stream(a, blk, 2 * T::BYTES);
            const __m256i x = _mm256_loadu_si256((const __m256i*)(xq + b * 32));
            const float dx = xd[b];
            typename H::Prep p;
            H::prep(blk, p);
            const __m256i is = dot_acc<H::SIGNED>(_mm256_setzero_si256(), H::chunk(blk, p, 0), x, ones);
            ac = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_set1_ps(p.d * dx), ac);
            if constexpr (H::HAS_MIN) as += p.dmin * dx * (float)(xs[2 * b] + xs[2 * b + 1]);
        };
        int64_t b = 0;
        for (; b + 2 <= nb; b += 2) { block(b, acc, accs[0], true); block(b + 1, acc2, accs[1], false); }
        if (b < nb) block(b, acc, accs[0], true);
        return hsum8(_mm256_add_ps(acc, acc2)) - (accs[0] + accs[1]);
      }
    } else {
        // the min terms read 16 activation sums per block (xs + b * 16)
        static_assert(T::QK == 256 || !H::HAS_MIN, "a min term needs 32- or 256-value blocks");
        typename H::Prep pn;
        if (H::PREP_AHEAD && nb > 0) H::prep(row, pn);
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = row + b * T::BYTES;
            hz_prefetch_stream(a, blk, T::BYTES);
            typename H::Prep p;
            if constexpr (H::PREP_AHEAD) {  // next block's scales, off this block's critical path
                p = pn;
                if (b + 1 < nb) H::prep(blk + T::BYTES, pn);
            } else {
                H::prep(blk, p);
            }
            __m256i is = _mm256_setzero_si256();
            const ScaleQ sq = scale_q<H::SC_PAIRS>(p.sc16);
            for (int c = 0; c < T::QK / 32; ++c)
                is = dot_acc<H::SIGNED>(is, H::chunk(blk, p, c), _mm256_loadu_si256((const __m256i*)(xq + b * T::QK + 32 * c)), scq(sq, c));
            if constexpr (H::HAS_MIN && H::MIN_LOG2 >= 0) {  // min in int32, one float fix-up
                const __m256i mm = _mm256_madd_epi16(p.mn16, _mm256_loadu_si256((const __m256i*)(xs + b * 16)));
                is = _mm256_sub_epi32(is, _mm256_slli_epi32(mm, H::MIN_LOG2));
            }
            if constexpr (H::DM_F16) {  // [d, dmin] * dx in one conversion
                const __m128 dm = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128((int)rd_u32(blk))), _mm_set1_ps(xd[b]));
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_broadcastss_ps(dm), acc);
                const __m256i mm = _mm256_madd_epi16(p.mn16, _mm256_loadu_si256((const __m256i*)(xs + b * 16)));
                acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mm), _mm256_broadcastss_ps(_mm_movehdup_ps(dm)), acc);
            } else {
                const float dx = xd[b];
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_set1_ps(p.d * dx), acc);
                if constexpr (H::HAS_MIN && H::MIN_LOG2 < 0) {
                    const __m256i mm = _mm256_madd_epi16(p.mn16, _mm256_loadu_si256((const __m256i*)(xs + b * 16)));
                    acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mm), _mm256_set1_ps(p.dmin * dx), acc);
                }
            }
        }
    }
    return hsum8(acc);
}

// Mat-vec for MR (1..4) activation rows: each weight block is unpacked once and dotted with
// all MR rows. Rows n0..n1 of W.
template <class T, int MR>
static void matvec_tile(const uint8_t* W, int64_t rb, int64_t n0, int64_t n1, const HzAct* a, int64_t m0,
                        float* y, int64_t ldy) {
    typedef Hooks<T> H;
    const int64_t K = a->K, nb = K / T::QK;
    const int8_t* xq[MR]; const float* xd[MR]; const int16_t* xs[MR];
    for (int m = 0; m < MR; ++m) {
        xq[m] = a->q + (m0 + m) * K; xd[m] = a->d + (m0 + m) * nb; xs[m] = a->s + (m0 + m) * (K / 16);
    }
    const __m256i ones = _mm256_load_si256(hz_ones16());
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = W + n * rb;
        __m256 acc[MR];
        float accs[MR];
        for (int m = 0; m < MR; ++m) { acc[m] = _mm256_setzero_ps(); accs[m] = 0.f; }
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = row + b * T::BYTES;
            hz_prefetch_stream(a, blk, T::BYTES);
            typename H::Prep p;
            H::prep(blk, p);
            if constexpr (T::QK == 32) {
                __m256i q = H::chunk(blk, p, 0);
                for (int m = 0; m < MR; ++m) {
                    __m256i x = _mm256_loadu_si256((const __m256i*)(xq[m] + b * 32));
                    __m256i is = dot_acc<H::SIGNED>(_mm256_setzero_si256(), q, x, ones);
                    float dx = xd[m][b];
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_set1_ps(p.d * dx), acc[m]);
                    if constexpr (H::HAS_MIN) accs[m] += p.dmin * dx * (float)(xs[m][2 * b] + xs[m][2 * b + 1]);
                }
            } else {
                __m256i is[MR];
                for (int m = 0; m < MR; ++m) is[m] = _mm256_setzero_si256();
                const ScaleQ sq = scale_q<H::SC_PAIRS>(p.sc16);
                for (int c = 0; c < T::QK / 32; ++c) {
                    __m256i q = H::chunk(blk, p, c);
                    __m256i s = scq(sq, c);
                    for (int m = 0; m < MR; ++m)
                        is[m] = dot_acc<H::SIGNED>(is[m], q, _mm256_loadu_si256((const __m256i*)(xq[m] + b * T::QK + 32 * c)), s);
                }
                for (int m = 0; m < MR; ++m) {
                    float dx = xd[m][b];
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[m]), _mm256_set1_ps(p.d * dx), acc[m]);
                    if constexpr (H::HAS_MIN) {
                        __m256i mm = _mm256_madd_epi16(p.mn16, _mm256_loadu_si256((const __m256i*)(xs[m] + b * 16)));
                        acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mm), _mm256_set1_ps(p.dmin * dx), acc[m]);
                    }
                }
            }
        }
        for (int m = 0; m < MR; ++m) y[(m0 + m) * ldy + n] = hsum8(acc[m]) - accs[m];
    }
}

#if HZ_ISA >= 2
// AVX-512 mat-vec rows of Q4_K and Q6_K (hz_matvec512, HANZO_CPU_MATVEC512): each 512-bit step
// covers two 32-value chunks, 64 consecutive activations, so a block takes 4 maddubs + 4 dpwssd
// and about half the vector instructions of the 256-bit row above; the 16 int32 partial sums fold
// to 8 (lane i + lane i+8 = what lane i of the 256-bit row sums), and the float fix-up is that
// row's, so the results are the same bits.
template <class T> struct Mv512 { static constexpr bool ON = false, Q4K = false; };
template <> struct Mv512<FQ4_K> { static constexpr bool ON = true, Q4K = true; };
template <> struct Mv512<FQ6_K> { static constexpr bool ON = true, Q4K = false; };

// int16 word w of the result: base + w / 8 (the 16-value group of each 128-bit lane)
static inline __m512i lane_idx16(int base) {
    const int v = base | base << 16, one = 1 | 1 << 16;
    return _mm512_setr_epi32(v, v, v, v, v + one, v + one, v + one, v + one, v + 2 * one, v + 2 * one, v + 2 * one,
                             v + 2 * one, v + 3 * one, v + 3 * one, v + 3 * one, v + 3 * one);
}

// GF2P8AFFINEQB with b = 0: byte k of each 64-bit lane of x through the 8x8 bit matrix of the same
// lane of A (byte 7 - i of A's lane selects the input bits whose parity is output bit i). The
// native unit emits it as inline assembly, so only this instruction needs GFNI (the avx512 level
// also runs on AVX-512 CPUs without it: callers check hz_gfni_ok); avx512-sim takes SIMDe's.
static inline __m512i hz_gf2p8affine(__m512i x, __m512i A) {
#if defined(SIMDE_VERSION) && defined(HZ_SIM_GFNI)
    return _mm512_gf2p8affine_epi64_epi8(x, A, 0);
#elif defined(SIMDE_VERSION)
    (void)A;
    return x;  // not reached: hz_gfni_ok() is false without SIMDe's gfni.h
#else
    __m512i r;
    __asm__("vgf2p8affineqb $0, %[a], %[x], %[r]" : [r] "=v"(r) : [x] "v"(x), [a] "v"(A));
    return r;
#endif
}

static inline bool hz_gfni_ok() {
#if defined(SIMDE_VERSION) && defined(HZ_SIM_GFNI)
    return hz_matvec_gfni != 0;
#elif defined(SIMDE_VERSION)
    return false;
#else
    static const bool cpu = (__builtin_cpu_init(), __builtin_cpu_supports("gfni"));
    return hz_matvec_gfni != 0 && cpu;
#endif
}

// The matrix that moves bits 2k, 2k + 1 of each byte to bits 4, 5 (the top bits of Q6_K chunk k
// in its qh byte) and clears the others.
static constexpr long long q6_top_bits(int k) {
    return (long long)((1ull << (2 * k)) << 24 | (1ull << (2 * k + 1)) << 16);
}

static inline __m256i fold512(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

template <class T, bool GF = false>
static inline float matvec_row512(const uint8_t* row, const HzAct* a, int64_t m) {
    typedef Hooks<T> H;
    const int64_t K = a->K, nb = K / T::QK;
    const int8_t* xq = a->q + m * K; const float* xd = a->d + m * nb; const int16_t* xs = a->s + m * (K / 16);
    __m256 acc = _mm256_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(15);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * T::BYTES;
        hz_prefetch_stream(a, blk, T::BYTES);
        typename H::Prep p;
        H::prep(blk, p);
        const int8_t* x = xq + b * T::QK;
        __m512i is0 = _mm512_setzero_si512(), is1 = _mm512_setzero_si512();
        if constexpr (Mv512<T>::Q4K) {
            // qs bytes 32j..32j+31: low nibbles chunk 2j, high nibbles chunk 2j+1 (upper 256 bits,
            // shifted by 4 within 64-bit lanes); sc16 dword c holds chunk c's scale twice
            const __m512i sh = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
            const __m512i sc = _mm512_castsi256_si512(p.sc16);
            const uint8_t* qs = blk + HZ_OFF(FQ4_K, qs);
            for (int j = 0; j < 4; ++j) {
                const __m512i q = _mm512_and_si512(
                    _mm512_srlv_epi64(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(qs + 32 * j))), sh), m4);
                const __m512i s = _mm512_permutexvar_epi32(
                    _mm512_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1,
                                      2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1), sc);
                const __m512i pr = _mm512_maddubs_epi16(q, _mm512_loadu_si512((const void*)(x + 64 * j)));
                if (j & 1) is1 = _mm512_dpwssd_epi32(is1, pr, s);
                else is0 = _mm512_dpwssd_epi32(is0, pr, s);
            }
        } else {
            // half h (128 values): ql bytes 64h..64h+63 give chunks 4h, 4h+1 (low nibbles) and
            // 4h+2, 4h+3 (high); qh bytes 32h..32h+31 bits 2k..2k+1 are chunk 4h+k's top bits;
            // every 16 values have their own int8 scale (128-bit lane L of step i: scale 4i + L)
            const __m512i sc = _mm512_castsi256_si512(p.sc16);
            const __m512i m30 = _mm512_set1_epi8(0x30);
            for (int h = 0; h < 2; ++h) {
                const __m512i ql = _mm512_loadu_si512((const void*)(blk + HZ_OFF(FQ6_K, ql) + 64 * h));
                const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(blk + HZ_OFF(FQ6_K, qh) + 32 * h)));
                __m512i q0, q1;
                if constexpr (GF) {
                    // the top bits of each half's two chunks to bits 4-5 by one affine each (per
                    // 256-bit half: chunk 4h / 4h + 1 for q0, 4h + 2 / 4h + 3 for q1), then
                    // vpternlogq's bit select (imm 0xE4: the nibble of ql where m4 has ones, else g)
                    const __m512i g0 = hz_gf2p8affine(qh, _mm512_setr_epi64(q6_top_bits(0), q6_top_bits(0), q6_top_bits(0), q6_top_bits(0),
                                                                             q6_top_bits(1), q6_top_bits(1), q6_top_bits(1), q6_top_bits(1)));
                    const __m512i g1 = hz_gf2p8affine(qh, _mm512_setr_epi64(q6_top_bits(2), q6_top_bits(2), q6_top_bits(2), q6_top_bits(2),
                                                                             q6_top_bits(3), q6_top_bits(3), q6_top_bits(3), q6_top_bits(3)));
                    q0 = _mm512_ternarylogic_epi64(ql, g0, m4, 0xE4);
                    q1 = _mm512_ternarylogic_epi64(_mm512_srli_epi16(ql, 4), g1, m4, 0xE4);
                } else {
                    q0 = _mm512_or_si512(_mm512_and_si512(ql, m4),
                                         _mm512_and_si512(_mm512_sllv_epi64(qh, _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2)), m30));
                    q1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                         _mm512_and_si512(_mm512_srlv_epi64(qh, _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2)), m30));
                }
                const int i0 = 8 * h, i1 = 8 * h + 4;  // scale index of each step's lane 0
                const __m512i s0 = _mm512_permutexvar_epi16(lane_idx16(i0), sc);
                const __m512i s1 = _mm512_permutexvar_epi16(lane_idx16(i1), sc);
                is0 = _mm512_dpwssd_epi32(is0, _mm512_maddubs_epi16(q0, _mm512_loadu_si512((const void*)(x + 128 * h))), s0);
                is1 = _mm512_dpwssd_epi32(is1, _mm512_maddubs_epi16(q1, _mm512_loadu_si512((const void*)(x + 128 * h + 64))), s1);
            }
        }
        __m256i is = fold512(_mm512_add_epi32(is0, is1));
        if constexpr (H::HAS_MIN && H::MIN_LOG2 >= 0) {  // as matvec_row
            const __m256i mm = _mm256_madd_epi16(p.mn16, _mm256_loadu_si256((const __m256i*)(xs + b * 16)));
            is = _mm256_sub_epi32(is, _mm256_slli_epi32(mm, H::MIN_LOG2));
        }
        if constexpr (H::DM_F16) {
            const __m128 dm = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128((int)rd_u32(blk))), _mm_set1_ps(xd[b]));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_broadcastss_ps(dm), acc);
            const __m256i mm = _mm256_madd_epi16(p.mn16, _mm256_loadu_si256((const __m256i*)(xs + b * 16)));
            acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mm), _mm256_broadcastss_ps(_mm_movehdup_ps(dm)), acc);
        } else {
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_set1_ps(p.d * xd[b]), acc);
        }
    }
    return hsum8(acc);
}
#endif

template <class T>
static void matvec_simd(const uint8_t* W, int64_t rb, int64_t n0, int64_t n1, const HzAct* a, int64_t M,
                        float* y, int64_t ldy) {
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) matvec_tile<T, 4>(W, rb, n0, n1, a, m0, y, ldy);
    switch (M - m0) {
        case 3: matvec_tile<T, 3>(W, rb, n0, n1, a, m0, y, ldy); break;
        case 2: matvec_tile<T, 2>(W, rb, n0, n1, a, m0, y, ldy); break;
        case 1:
#if HZ_ISA >= 2
            if constexpr (Mv512<T>::ON) {
                if (hz_matvec512) {
                    if constexpr (T::ID == FQ6_K::ID) {
                        if (hz_gfni_ok()) {
                            for (int64_t n = n0; n < n1; ++n) y[m0 * ldy + n] = matvec_row512<T, true>(W + n * rb, a, m0);
                            break;
                        }
                    }
                    for (int64_t n = n0; n < n1; ++n) y[m0 * ldy + n] = matvec_row512<T>(W + n * rb, a, m0);
                    break;
                }
            }
#endif
            for (int64_t n = n0; n < n1; ++n) y[m0 * ldy + n] = matvec_row<T>(W + n * rb, a, m0);
            break;
        default: break;
    }
}
