// Generic contraction kernels, written once and instantiated per format trait (formats.h) and
// per instruction set. Included INSIDE namespace hz_<isa> by isa_*.cpp with HZ_ISA set to
// 0 (portable scalar), 1 (AVX2 + FMA + F16C) or 2 (AVX-512 VL/BW + VNNI on 256-bit vectors).
//
// Maths (all formats): weight value p of a block = (D*sc[g])*q[p] - Dmin*mn[g], g = p/16;
// activation x ~ xd * xq (int8, one scale per block of the weight's block size). So per block
//     dot = xd * (D * sum_g sc[g] * dot_int(q_g, xq_g)  -  Dmin * sum_g mn[g] * sum(xq_g))
// where both sums are exact int32. Float rounding happens only once per block.

template <class...> using hz_void_t = void;
template <class T> static inline T hz_min(T a, T b) { return a < b ? a : b; }

// ------------------------------------------------------------------------------ scalar path
template <class T>
static inline int32_t block_int_dot(const Unpacked& u, const int8_t* xq, int g) {
    int32_t s = 0;
    if (T::SIGNED) {
        const int8_t* q = (const int8_t*)u.q + 16 * g;
        for (int i = 0; i < 16; ++i) s += (int32_t)q[i] * xq[16 * g + i];
    } else {
        const uint8_t* q = u.q + 16 * g;
        for (int i = 0; i < 16; ++i) s += (int32_t)q[i] * xq[16 * g + i];
    }
    return s;
}

template <class T>
static void matmul_scalar(const uint8_t* W, int64_t rb, int64_t n0, int64_t n1, const HzAct* a, int64_t M,
                          float* y, int64_t ldy) {
    const int64_t nb = a->K / T::QK, nbq = a->K / a->qa, ng = T::QK / 16;
    Unpacked u;
    for (int64_t n = n0; n < n1; ++n) {
        for (int64_t m = 0; m < M; ++m) y[m * ldy + n] = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
            T::unpack(W + n * rb + b * T::BYTES, u);
            for (int64_t m = 0; m < M; ++m) {
                const int8_t* xq = a->q + m * a->K + b * T::QK;
                const int16_t* xs = a->s + m * (a->K / 16) + b * ng;
                float xd = a->d[m * nbq + b];
                int32_t isum = 0, msum = 0;
                for (int g = 0; g < ng; ++g) {
                    isum += u.sc[g] * block_int_dot<T>(u, xq, g);
                    if (T::HAS_MIN) msum += u.mn[g] * xs[g];
                }
                y[m * ldy + n] += xd * (u.d * (float)isum - u.dmin * (float)msum);
            }
        }
    }
}

// value = (d * sc) * q - dmin * mn, each product rounded (gguf's order; no FMA contraction), one
// group of 16 values at a time so the inner loop vectorizes.
template <class T>
__attribute__((optimize("fp-contract=off"))) static void dequant_row(const uint8_t* row, int64_t K, float* out) {
    Unpacked u;
    for (int64_t b = 0; b < K / T::QK; ++b) {
        T::unpack(row + b * T::BYTES, u);
        float* o = out + b * T::QK;
        for (int g = 0; g < T::QK / 16; ++g) {
            const float s = u.d * (float)u.sc[g];
            const float m = T::HAS_MIN ? u.dmin * (float)u.mn[g] : 0.f;
            const uint8_t* q = u.q + 16 * g;
            float* og = o + 16 * g;
            for (int p = 0; p < 16; ++p) {
                const float qv = T::SIGNED ? (float)(int8_t)q[p] : (float)q[p];
                og[p] = T::HAS_MIN ? s * qv - m : s * qv;
            }
        }
    }
}

static void quantize_scalar(const float* x, int64_t M, int64_t K, int64_t qa, int8_t* q, float* d, int16_t* s, float* sf) {
    for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < K / qa; ++b) {
            const float* xb = x + m * K + b * qa;
            float amax = 0.f;
            for (int64_t i = 0; i < qa; ++i) { float v = xb[i] < 0 ? -xb[i] : xb[i]; amax = v > amax ? v : amax; }
            float id = amax > 0.f ? 127.f / amax : 0.f;
            d[m * (K / qa) + b] = amax / 127.f;
            int8_t* qb = q + m * K + b * qa;
            for (int64_t i = 0; i < qa; ++i) qb[i] = (int8_t)(int)nearbyintf(xb[i] * id);
            for (int64_t g = 0; g < qa / 16; ++g) {
                int sum = 0;
                for (int i = 0; i < 16; ++i) sum += qb[16 * g + i];
                s[m * (K / 16) + b * (qa / 16) + g] = (int16_t)sum;
                sf[m * (K / 16) + b * (qa / 16) + g] = d[m * (K / qa) + b] * (float)sum;
            }
        }
}

#if HZ_ISA >= 1
// ------------------------------------------------------------------------------ SIMD path
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline int hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
static inline float f16c(const uint8_t* p) { return _cvtsh_ss(rd_u16(p)); }

// acc += s16 * (pairwise sums of q*x): q uint8 (or int8 when SIGNED), x int8, s16 int16 scales.
template <bool SIGNED>
static inline __m256i dot_acc(__m256i acc, __m256i q, __m256i x, __m256i s16) {
    __m256i p = SIGNED ? _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q)) : _mm256_maddubs_epi16(q, x);
#if HZ_ISA >= 2
    return _mm256_dpwssd_epi32(acc, p, s16);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s16));
#endif
}
// Scale vectors of a 256-value block for the mat-vec: lo/hi hold, per 32-bit element k of the low / high lane, the
// scale of group 2k / 2k+1 (lo: chunks 0-3, hi: chunks 4-7) in both 16-bit halves, so chunk c's
// vector is one vpshufd with an immediate (no mask load). PAIRS: groups 2c and 2c+1 share one
// scale (Q4_K, Q5_K, IQ4_XS), then sc16's own lanes already have that layout.
struct ScaleQ { __m256i lo, hi; };
template <bool PAIRS>
static inline ScaleQ scale_q(__m256i sc16) {
    __m256i lo = _mm256_permute2x128_si256(sc16, sc16, 0x00), hi = _mm256_permute2x128_si256(sc16, sc16, 0x11);
    if constexpr (!PAIRS) {
        const __m256i m = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                           2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15);
        lo = _mm256_shuffle_epi8(lo, m);
        hi = _mm256_shuffle_epi8(hi, m);
    }
    return ScaleQ{lo, hi};
}
static inline __m256i scq(const ScaleQ& s, int c) {
    const __m256i v = c < 4 ? s.lo : s.hi;
    switch (c & 3) {
        case 0: return _mm256_shuffle_epi32(v, 0x00);
        case 1: return _mm256_shuffle_epi32(v, 0x55);
        case 2: return _mm256_shuffle_epi32(v, 0xaa);
        default: return _mm256_shuffle_epi32(v, 0xff);
    }
}
// int16 scale vector for 32-value chunk c of a 256-block: group 2c in the low lane, 2c+1 high.
static inline __m256i scvec(__m256i sc16, int c) {
    __m256i v = _mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(c));
    return _mm256_shuffle_epi8(v, _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                                   2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3));
}
static inline __m256i nibbles_lohi(__m128i v) {  // 16 bytes -> 32 nibbles: low nibbles first
    const __m128i m4 = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
}
// The same from memory: one 128-bit broadcast load, the high lane shifted by 4 (vpsrlvd), one
// mask: 2 vector ops instead of 4 (shift, 2 masks, lane insert).
static inline __m256i nibbles_lohi_mem(const uint8_t* p) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p));
    return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(15));
}
static inline __m256i bits_to_bytes(uint32_t bits, int value) {  // byte i = (bit i of bits) ? value : 0
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                    _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                     2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8((char)value));
}

static inline uint64_t rd_u64(const uint8_t* p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint64_t spread_nibbles(uint32_t x) {  // nibble i of x -> low nibble of byte i
    uint64_t y = x;
    y = (y | (y << 16)) & 0x0000ffff0000ffffULL;
    y = (y | (y << 8)) & 0x00ff00ff00ff00ffULL;
    return (y | (y << 4)) & 0x0f0f0f0f0f0f0f0fULL;
}
static inline uint64_t spread_2bits(uint32_t x) {  // bits 2i, 2i+1 of x (i < 8) -> bits 0-1 of byte i
    uint64_t y = x & 0xffffu;
    y = (y | (y << 24)) & 0x000000ff000000ffULL;
    y = (y | (y << 12)) & 0x000f000f000f000fULL;
    return (y | (y << 6)) & 0x0303030303030303ULL;
}

// Register-level hooks. Primary template: the generic rule, via the scalar unpack() into an
// L1-resident buffer (serves every format). Specializations below are the hot formats.
// QK == 32: d already includes the block's single scale, dmin its single min.
//
// PREP_AHEAD (256-value formats): the mat-vec preps block b+1 while dotting block b (measured
// +7-10% for Q4_K; neutral to -5% for Q5_K/Q6_K).
// DM_F16 (256-value formats): the block starts with d and dmin as two fp16 (Q4_K, Q5_K).
// MIN_LOG2 >= 0 (256-value formats with HAS_MIN): dmin == 2^MIN_LOG2 * d exactly, so the mat-vec
// subtracts the min term in int32 (is - (mn16 . xs) << MIN_LOG2) before one float fix-up.
// Mat-vec hooks of the 32-value formats whose values are d * (signed integer) with no separate
// min (S8 = true): dval(b) gives the block scale d, and the integers are
// either U_OFF > 0: chunk(b, p, 0) - U_OFF with chunk's uint8 q <= 31 (Q4_0, Q5_0), or
// U_OFF == 0: qs8(b) as int8 (Q_MIN128: qs8 can hold -128, then the dot takes |q|).
template <class T>
struct Hooks {
    static constexpr bool SIGNED = T::SIGNED, HAS_MIN = T::HAS_MIN, S8 = false, Q_MIN128 = false, SC_PAIRS = false, DM_F16 = false, PREP_AHEAD = false;
    static constexpr int U_OFF = 0, MIN_LOG2 = -1;
    struct Prep { float d, dmin; __m256i sc16, mn16; Unpacked u; };
    static inline void prep(const uint8_t* b, Prep& p) {
        T::unpack(b, p.u);
        if constexpr (T::QK == 32) {
            p.d = p.u.d * (float)p.u.sc[0];
            p.dmin = p.u.dmin * (float)p.u.mn[0];
        } else {
            p.d = p.u.d; p.dmin = p.u.dmin;
            p.sc16 = _mm256_load_si256((const __m256i*)p.u.sc);
            if constexpr (HAS_MIN) p.mn16 = _mm256_load_si256((const __m256i*)p.u.mn);
        }
    }
    static inline __m256i chunk(const uint8_t*, const Prep& p, int c) { return _mm256_load_si256((const __m256i*)(p.u.q + 32 * c)); }
};

struct PrepK { float d, dmin; __m256i sc16, mn16; };
struct Prep32 { float d, dmin; };

static inline void prep_k4_scales(const uint8_t* s, PrepK& p) {  // Q4_K/Q5_K 12-byte 6-bit scales
    uint32_t a = rd_u32(s), b = rd_u32(s + 4), c = rd_u32(s + 8);
    uint32_t sc_lo = a & 0x3f3f3f3fu, mn_lo = b & 0x3f3f3f3fu;
    uint32_t sc_hi = (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);
    uint32_t mn_hi = ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4);
    __m128i v = _mm_set_epi32((int)mn_hi, (int)mn_lo, (int)sc_hi, (int)sc_lo);
    p.sc16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(v, _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)));
    p.mn16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(v, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)));
}

template <> struct Hooks<FQ4_K> {
    static constexpr bool SIGNED = false, HAS_MIN = true, SC_PAIRS = true, DM_F16 = true, PREP_AHEAD = true;
    static_assert(HZ_OFF(FQ4_K, d) == 0 && HZ_OFF(FQ4_K, dmin) == 2, "DM_F16: d, dmin lead the block");
    static constexpr int MIN_LOG2 = -1;
    typedef PrepK Prep;
    static inline void prep(const uint8_t* b, Prep& p) { prep_k4_scales(b + HZ_OFF(FQ4_K, scales), p); p.d = f16c(b + HZ_OFF(FQ4_K, d)); p.dmin = f16c(b + HZ_OFF(FQ4_K, dmin)); }
    static inline __m256i chunk(const uint8_t* b, const Prep&, int c) {
        __m256i v = _mm256_loadu_si256((const __m256i*)(b + HZ_OFF(FQ4_K, qs) + 32 * (c >> 1)));
        if (c & 1) v = _mm256_srli_epi16(v, 4);
        return _mm256_and_si256(v, _mm256_set1_epi8(15));
    }
};
template <> struct Hooks<FQ5_K> {
    static constexpr bool SIGNED = false, HAS_MIN = true, SC_PAIRS = true, DM_F16 = true, PREP_AHEAD = false;
    static_assert(HZ_OFF(FQ5_K, d) == 0 && HZ_OFF(FQ5_K, dmin) == 2, "DM_F16: d, dmin lead the block");
    static constexpr int MIN_LOG2 = -1;
    typedef PrepK Prep;
    static inline void prep(const uint8_t* b, Prep& p) { prep_k4_scales(b + HZ_OFF(FQ5_K, scales), p); p.d = f16c(b + HZ_OFF(FQ5_K, d)); p.dmin = f16c(b + HZ_OFF(FQ5_K, dmin)); }
    static inline __m256i chunk(const uint8_t* b, const Prep&, int c) {
        __m256i v = _mm256_loadu_si256((const __m256i*)(b + HZ_OFF(FQ5_K, qs) + 32 * (c >> 1)));
        if (c & 1) v = _mm256_srli_epi16(v, 4);
        v = _mm256_and_si256(v, _mm256_set1_epi8(15));
        __m256i h = _mm256_loadu_si256((const __m256i*)(b + HZ_OFF(FQ5_K, qh)));
        h = c <= 4 ? _mm256_slli_epi16(h, 4 - c) : _mm256_srli_epi16(h, c - 4);
        return _mm256_or_si256(v, _mm256_and_si256(h, _mm256_set1_epi8(16)));
    }
};
template <> struct Hooks<FQ6_K> {  // unsigned q6 with min 32*sc: no sign fix-up in the dot
    static constexpr bool SIGNED = false, HAS_MIN = true, SC_PAIRS = false, DM_F16 = false, PREP_AHEAD = false;
    static constexpr int MIN_LOG2 = 5;
    typedef PrepK Prep;
    static inline void prep(const uint8_t* b, Prep& p) {
        p.sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + HZ_OFF(FQ6_K, scales))));
        p.mn16 = p.sc16;
        p.d = f16c(b + HZ_OFF(FQ6_K, d));
        p.dmin = 32.f * p.d;
    }
    static inline __m256i chunk(const uint8_t* b, const Prep&, int c) {
        const int h = c >> 2, k = c & 3;
        __m256i lo = _mm256_loadu_si256((const __m256i*)(b + HZ_OFF(FQ6_K, ql) + 64 * h + 32 * (k & 1)));
        if (k >= 2) lo = _mm256_srli_epi16(lo, 4);
        lo = _mm256_and_si256(lo, _mm256_set1_epi8(15));
        __m256i hb = _mm256_loadu_si256((const __m256i*)(b + HZ_OFF(FQ6_K, qh) + 32 * h));
        hb = k <= 2 ? _mm256_slli_epi16(hb, 4 - 2 * k) : _mm256_srli_epi16(hb, 2);
        return _mm256_or_si256(lo, _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
    }
};
// Q6_K planes (hz_panel_fn of the avx2 level, layout in kernels_panels.h): the rows' scales and d at
// their offsets, the six-bit values of chunks 0-2 of each half in bits 0-5 of three 32-byte planes
// and chunk 3's in their bits 6-7, two bits a plane. The same integers as the rows' hooks, so the
// mat-vec loops below give the rows' bits.
struct FQ6_KP : FQ6_K {};
template <> struct Hooks<FQ6_KP> {
    static constexpr bool SIGNED = false, HAS_MIN = true, SC_PAIRS = false, DM_F16 = false, PREP_AHEAD = false;
    static constexpr int MIN_LOG2 = 5;
    typedef PrepK Prep;
    static inline void prep(const uint8_t* b, Prep& p) { Hooks<FQ6_K>::prep(b, p); }
    static inline __m256i chunk(const uint8_t* b, const Prep&, int c) {
        const uint8_t* h = b + HZ_Q6K_PLANES_HALF * (c >> 2);
        if ((c & 3) < 3) return _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(h + 32 * (c & 3))), _mm256_set1_epi8(0x3f));
        // the top bit pairs, masked before the 16-bit shifts so no bit crosses into the next byte
        const __m256i top = _mm256_set1_epi8((char)0xc0);
        const __m256i t0 = _mm256_srli_epi16(_mm256_and_si256(_mm256_loadu_si256((const __m256i*)h), top), 6);
        const __m256i t1 = _mm256_srli_epi16(_mm256_and_si256(_mm256_loadu_si256((const __m256i*)(h + 32)), top), 4);
        const __m256i t2 = _mm256_srli_epi16(_mm256_and_si256(_mm256_loadu_si256((const __m256i*)(h + 64)), top), 2);
        return _mm256_or_si256(_mm256_or_si256(t0, t1), t2);
    }
};
template <> struct Hooks<FQ8_0> {
    static constexpr bool SIGNED = true, HAS_MIN = false;
    typedef Prep32 Prep;
    static inline void prep(const uint8_t* b, Prep& p) { p.d = f16c(b + HZ_OFF(FQ8_0, d)); p.dmin = 0.f; }
    static inline __m256i chunk(const uint8_t* b, const Prep&, int) { return _mm256_loadu_si256((const __m256i*)(b + HZ_OFF(FQ8_0, qs))); }
    static constexpr bool S8 = true, Q_MIN128 = true;
    static constexpr bool D16 = true;  // f16 d at byte 0 (dval4 converts 4 at once)
    static_assert(HZ_OFF(FQ8_0, d) == 0, "D16: d leads the block");
    static constexpr int U_OFF = 0;
    static inline float dval(const uint8_t* b) { return f16c(b + HZ_OFF(FQ8_0, d)); }
    static inline __m256i qs8(const uint8_t* b) { return _mm256_loadu_si256((const __m256i*)(b + HZ_OFF(FQ8_0, qs))); }
};
template <> struct Hooks<FQ4_0> {
    static constexpr bool SIGNED = false, HAS_MIN = true;
    typedef Prep32 Prep;
    static inline void prep(const uint8_t* b, Prep& p) { p.d = f16c(b + HZ_OFF(FQ4_0, d)); p.dmin = 8.f * p.d; }
    static inline __m256i chunk(const uint8_t* b, const Prep&, int) { return nibbles_lohi_mem(b + HZ_OFF(FQ4_0, qs)); }
    static constexpr bool S8 = true, Q_MIN128 = false;
    static constexpr bool D16 = true;  // f16 d at byte 0 (dval4 converts 4 at once)
    static_assert(HZ_OFF(FQ4_0, d) == 0, "D16: d leads the block");
    static constexpr int U_OFF = 8;
    static inline float dval(const uint8_t* b) { return f16c(b + HZ_OFF(FQ4_0, d)); }
};
template <> struct Hooks<FQ5_0> {
    static constexpr bool SIGNED = false, HAS_MIN = true;
    typedef Prep32 Prep;
    static inline void prep(const uint8_t* b, Prep& p) { p.d = f16c(b + HZ_OFF(FQ5_0, d)); p.dmin = 16.f * p.d; }
    static inline __m256i chunk(const uint8_t* b, const Prep&, int) {
        return _mm256_or_si256(nibbles_lohi_mem(b + HZ_OFF(FQ5_0, qs)), bits_to_bytes(rd_u32(b + HZ_OFF(FQ5_0, qh)), 16));
    }
    static constexpr bool S8 = true, Q_MIN128 = false;
    static constexpr bool D16 = true;  // f16 d at byte 0 (dval4 converts 4 at once)
    static_assert(HZ_OFF(FQ5_0, d) == 0, "D16: d leads the block");
    static constexpr int U_OFF = 16;
    static inline float dval(const uint8_t* b) { return f16c(b + HZ_OFF(FQ5_0, d)); }
};
template <> struct Hooks<FQ4_1> {  // value = d * nibble + m: min term with dmin = -m
    static constexpr bool SIGNED = false, HAS_MIN = true, S8 = false, Q_MIN128 = false;
    static constexpr int U_OFF = 0;
    typedef Prep32 Prep;
    static inline void prep(const uint8_t* b, Prep& p) { p.d = f16c(b + HZ_OFF(FQ4_1, d)); p.dmin = -f16c(b + HZ_OFF(FQ4_1, m)); }
    static inline __m256i chunk(const uint8_t* b, const Prep&, int) { return nibbles_lohi_mem(b + HZ_OFF(FQ4_1, qs)); }
};
template <> struct Hooks<FQ5_1> {  // value = d * (nibble | bit << 4) + m
    static constexpr bool SIGNED = false, HAS_MIN = true, S8 = false, Q_MIN128 = false;
    static constexpr int U_OFF = 0;
    typedef Prep32 Prep;
    static inline void prep(const uint8_t* b, Prep& p) { p.d = f16c(b + HZ_OFF(FQ5_1, d)); p.dmin = -f16c(b + HZ_OFF(FQ5_1, m)); }
    static inline __m256i chunk(const uint8_t* b, const Prep&, int) {
        return _mm256_or_si256(nibbles_lohi_mem(b + HZ_OFF(FQ5_1, qs)), bits_to_bytes(rd_u32(b + HZ_OFF(FQ5_1, qh)), 16));
    }
};
template <> struct Hooks<FIQ4_NL> {
    static constexpr bool SIGNED = true, HAS_MIN = false;
    typedef Prep32 Prep;
    static inline void prep(const uint8_t* b, Prep& p) { p.d = f16c(b + HZ_OFF(FIQ4_NL, d)); p.dmin = 0.f; }
    static inline __m256i chunk(const uint8_t* b, const Prep&, int) {
        const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)hz_kvalues_iq4_nl));
        return _mm256_shuffle_epi8(tab, nibbles_lohi_mem(b + HZ_OFF(FIQ4_NL, qs)));
    }
    static constexpr bool S8 = true, Q_MIN128 = false;
    static constexpr bool D16 = true;  // f16 d at byte 0 (dval4 converts 4 at once)
    static_assert(HZ_OFF(FIQ4_NL, d) == 0, "D16: d leads the block");
    static constexpr int U_OFF = 0;
    static inline float dval(const uint8_t* b) { return f16c(b + HZ_OFF(FIQ4_NL, d)); }
    static inline __m256i qs8(const uint8_t* b) { return chunk(b, Prep(), 0); }
};

template <> struct Hooks<FMXFP4> {
    static constexpr bool SIGNED = true, HAS_MIN = false;
    typedef Prep32 Prep;
    static inline void prep(const uint8_t* b, Prep& p) {
        uint32_t e = b[HZ_OFF(FMXFP4, e)], bits = e < 2 ? (0x00200000u << e) : ((e - 1) << 23);
        memcpy(&p.d, &bits, 4);
        p.dmin = 0.f;
    }
    static inline __m256i chunk(const uint8_t* b, const Prep&, int) {
        const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)hz_kvalues_mxfp4));
        return _mm256_shuffle_epi8(tab, nibbles_lohi_mem(b + HZ_OFF(FMXFP4, qs)));
    }
    static constexpr bool S8 = true, Q_MIN128 = false;
    static constexpr bool D16 = false;
    static constexpr int U_OFF = 0;
    static inline float dval(const uint8_t* b) { Prep p; prep(b, p); return p.d; }
    static inline __m256i qs8(const uint8_t* b) { return chunk(b, Prep(), 0); }
};
template <> struct Hooks<FIQ4_XS> {
    static constexpr bool SIGNED = true, HAS_MIN = false, SC_PAIRS = true, DM_F16 = false, PREP_AHEAD = false;
    static constexpr int MIN_LOG2 = -1;
    typedef PrepK Prep;
    static inline void prep(const uint8_t* b, Prep& p) {
        // 8 six-bit scales, sub-block ib in byte ib: low nibble from scales_l, 2 high bits from scales_h
        const uint64_t ls = spread_nibbles(rd_u32(b + HZ_OFF(FIQ4_XS, scales_l))) | (spread_2bits(rd_u16(b + HZ_OFF(FIQ4_XS, scales_h))) << 4);
        const __m128i v = _mm_shuffle_epi8(_mm_cvtsi64_si128((long long)ls), _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
        p.sc16 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(v), _mm256_set1_epi16(32));
        p.d = f16c(b + HZ_OFF(FIQ4_XS, d));
        p.dmin = 0.f;
    }
    static inline __m256i chunk(const uint8_t* b, const Prep&, int c) {
        const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)hz_kvalues_iq4_xs));
        return _mm256_shuffle_epi8(tab, nibbles_lohi_mem(b + HZ_OFF(FIQ4_XS, qs) + 16 * c));
    }
};
template <> struct Hooks<FQ2_K> {  // scales[16]: low nibble scale, high nibble min | qs[64] 2-bit | d | dmin
    static constexpr bool SIGNED = false, HAS_MIN = true, SC_PAIRS = false, DM_F16 = false, PREP_AHEAD = false;
    static constexpr int MIN_LOG2 = -1;
    typedef PrepK Prep;
    static inline void prep(const uint8_t* b, Prep& p) {
        const __m128i s = _mm_loadu_si128((const __m128i*)(b + HZ_OFF(FQ2_K, scales))), m4 = _mm_set1_epi8(15);
        p.sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(s, m4));
        p.mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, 4), m4));
        p.d = f16c(b + HZ_OFF(FQ2_K, d));
        p.dmin = f16c(b + HZ_OFF(FQ2_K, dmin));
    }
    static inline __m256i chunk(const uint8_t* b, const Prep&, int c) {  // values 32c..: bits 2*(c%4) of qs[32*(c/4)..]
        const __m256i v = _mm256_loadu_si256((const __m256i*)(b + HZ_OFF(FQ2_K, qs) + 32 * (c >> 2)));
        return _mm256_and_si256(_mm256_srli_epi16(v, 2 * (c & 3)), _mm256_set1_epi8(3));
    }
};
template <> struct Hooks<FQ3_K> {  // unsigned q3 = 2 low bits | high bit << 2, min 4*sc
    static constexpr bool SIGNED = false, HAS_MIN = true, SC_PAIRS = false, DM_F16 = false, PREP_AHEAD = false;
    static constexpr int MIN_LOG2 = 0;
    typedef PrepK Prep;
    static inline void prep(const uint8_t* b, Prep& p) {
        // 16 six-bit scales: low nibbles of bytes 0-7 (groups 0-7) then their high nibbles (8-15);
        // 2 high bits of group g at bits 2*(g/4) of byte 8 + g%4
        const uint64_t lo = rd_u64(b + HZ_OFF(FQ3_K, scales)), h = rd_u32(b + HZ_OFF(FQ3_K, scales) + 8);
        const uint64_t hlo = (h & 0x03030303u) | (((h >> 2) & 0x03030303u) << 32);
        const uint64_t hhi = ((h >> 4) & 0x03030303u) | (((h >> 6) & 0x03030303u) << 32);
        const __m128i v = _mm_set_epi64x((long long)(((lo >> 4) & 0x0f0f0f0f0f0f0f0fULL) | (hhi << 4)),
                                         (long long)((lo & 0x0f0f0f0f0f0f0f0fULL) | (hlo << 4)));
        p.sc16 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(v), _mm256_set1_epi16(32));
        p.mn16 = _mm256_slli_epi16(p.sc16, 2);
        p.d = f16c(b + HZ_OFF(FQ3_K, d));
        p.dmin = p.d;
    }
    static inline __m256i chunk(const uint8_t* b, const Prep&, int c) {
        const int h = c >> 2, j = c & 3, hs = 4 * h + j;
        __m256i q = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i*)(b + HZ_OFF(FQ3_K, qs) + 32 * h)), 2 * j),
                                     _mm256_set1_epi8(3));
        __m256i hb = _mm256_loadu_si256((const __m256i*)(b + HZ_OFF(FQ3_K, hmask)));
        hb = hs >= 2 ? _mm256_srli_epi16(hb, hs - 2) : _mm256_slli_epi16(hb, 2 - hs);
        return _mm256_or_si256(q, _mm256_and_si256(hb, _mm256_set1_epi8(4)));
    }
};

static const __m256i* hz_ones16() { static const int16_t o[16] __attribute__((aligned(32))) = {1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1}; return (const __m256i*)o; }

// Software prefetch of a mat-vec's weight stream, for the cache lines of [p, p + n): on the SIMD
// levels while hz_prefetch_l2 is on, into L2 only (prefetcht2) hz_prefetch_l2_bytes ahead;
// otherwise into L1 (prefetcht0) hz_prefetch_bytes ahead. A distance
// of 0 prefetches nothing, as does an activation marked no_prefetch (hz_api.h; the measurements
// are in ops.cpp).
// always_inline: GCC (12) counts __builtin_prefetch as free of side effects, so a call to this
// function that its early inliner leaves out of line (as it does the two-branch AVX-512 form
// without the attribute) is a call to a pure function whose result is unused, and dead-code
// elimination deletes it: the prefetch silently vanishes (tests/test_cpu_panels.py checks the
// built code for prefetcht2).
static inline __attribute__((always_inline)) void hz_prefetch_stream(const HzAct* a, const uint8_t* p, int n) {
    if (a->no_prefetch) return;
#if HZ_ISA >= 1
    if (hz_prefetch_l2) {
        if (hz_prefetch_l2_bytes > 0)
            for (int off = 0; off < n; off += 64) _mm_prefetch((const char*)(p + hz_prefetch_l2_bytes + off), _MM_HINT_T2);
        return;
    }
#endif
    if (hz_prefetch_bytes > 0)
        for (int off = 0; off < n; off += 64) _mm_prefetch((const char*)(p + hz_prefetch_bytes + off), _MM_HINT_T0);
}

#include "kernels_matvec.h"
#include "kernels_gemm.h"
#include "kernels_panels.h"

static void quantize_simd(const float* x, int64_t M, int64_t K, int64_t qa, int8_t* q, float* d, int16_t* s, float* sf) {
    const __m256 signbit = _mm256_set1_ps(-0.f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < K / qa; ++b) {
            const float* xb = x + m * K + b * qa;
            __m256 vmax = _mm256_setzero_ps();
            for (int64_t i = 0; i < qa; i += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(signbit, _mm256_loadu_ps(xb + i)));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float amax = _mm_cvtss_f32(h);
            const float id = amax > 0.f ? 127.f / amax : 0.f;
            d[m * (K / qa) + b] = amax / 127.f;
            const __m256 vid = _mm256_set1_ps(id);
            int8_t* qb = q + m * K + b * qa;
            int16_t* sb = s + m * (K / 16) + b * (qa / 16);
            float* sfb = sf + m * (K / 16) + b * (qa / 16);
            const float dq = amax / 127.f;
            if (qa % 128 == 0) {
                // 128 values a pass: the 8 sums of 16 from 8 vectors of partial sums by hadd
                // trees (the int32 sums and their conversions are exact: the same values as below)
                const __m256 vdq = _mm256_set1_ps(dq);
                for (int64_t i = 0; i < qa; i += 128) {
                    __m256i v[8];
                    for (int64_t j = 0; j < 4; ++j) {
                        const float* xj = xb + i + 32 * j;
                        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xj), vid));
                        __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xj + 8), vid));
                        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xj + 16), vid));
                        __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xj + 24), vid));
                        v[2 * j] = _mm256_add_epi32(i0, i1);
                        v[2 * j + 1] = _mm256_add_epi32(i2, i3);
                        __m256i pk = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
                        _mm256_storeu_si256((__m256i*)(qb + i + 32 * j), _mm256_permutevar8x32_epi32(pk, perm));
                    }
                    const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
                    const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
                    // h0 = [sums of v0..v3 over lanes 0-3 | over lanes 4-7], h1 the same for v4..v7
                    const __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20),
                                                          _mm256_permute2x128_si256(h0, h1, 0x31));
                    const __m128i s16 = _mm_packs_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
                    _mm_storeu_si128((__m128i*)(sb + i / 16), s16);
                    _mm256_storeu_ps(sfb + i / 16, _mm256_mul_ps(vdq, _mm256_cvtepi32_ps(sums)));
                }
                continue;
            }
            for (int64_t i = 0; i < qa; i += 32) {
                __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), vid));
                __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8), vid));
                __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 16), vid));
                __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 24), vid));
                sb[i / 16] = (int16_t)hsum8i(_mm256_add_epi32(i0, i1));
                sb[i / 16 + 1] = (int16_t)hsum8i(_mm256_add_epi32(i2, i3));
                sfb[i / 16] = dq * (float)sb[i / 16];
                sfb[i / 16 + 1] = dq * (float)sb[i / 16 + 1];
                __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
                _mm256_storeu_si256((__m256i*)(qb + i), _mm256_permutevar8x32_epi32(p, perm));
            }
        }
}
#endif  // HZ_ISA >= 1

// ------------------------------------------------------------------------------ tables
template <class T> struct PanelsOf { static constexpr hz_panel_fn fn = nullptr; };
#if HZ_ISA >= 1
template <> struct PanelsOf<FQ4_K> { static constexpr hz_panel_fn fn = &matvec_panels_q4k; };
#if HZ_ISA == 1
template <> struct PanelsOf<FQ6_K> { static constexpr hz_panel_fn fn = &matvec_planes_q6k; };
#endif
#define HZ_ENTRY(T) {T::ID, T::QK, T::BYTES, &matvec_simd<T>, &gemm_simd<T>, &dequant_row<T>, HZ_GEMM_NR, TableOf<T>::value, PanelsOf<T>::fn},
#define HZ_QUANT quantize_simd
#else
#define HZ_ENTRY(T) {T::ID, T::QK, T::BYTES, &matmul_scalar<T>, &matmul_scalar<T>, &dequant_row<T>, 1, TableOf<T>::value, nullptr},
#define HZ_QUANT quantize_scalar
#endif
static const HzFormatKernels hz_format_table[] = {HZ_FOR_EACH_FORMAT(HZ_ENTRY)};
