// Format traits: the value axis of the CPU kernels.
//
// Included INSIDE an ISA namespace by each isa_*.cpp (after <immintrin.h> etc.), so every trait is
// compiled once per instruction set. Each trait describes one ggml block format:
//   B         its block struct (ggml_blocks.h, generated from the format registry); ID, QK and
//             BYTES (ggml type id, values and bytes per block) come from it (BlockOf), and the
//             rules read fields at offsetof(B, field), compile-time constants,
//   TABLE     (formats with a codebook) the HzTableSlot of hz_tables it reads,
//   SIGNED    the unpacked integers are int8 (else uint8),
//   HAS_MIN   the value has a subtracted per-group minimum,
//   unpack()  portable scalar rule: block -> Unpacked, such that value p of the block is
//                 (d * sc[p/16]) * q[p] - dmin * mn[p/16]          (mn term only if HAS_MIN)
//             with q, sc, mn small integers. This one rule serves dequantization, the scalar
//             int8 dot product and the generic SIMD dot product (for formats without SIMD hooks).
//   Simd      (optional, AVX2 TUs) register-level hooks for the hot formats: prep() and chunk().
//             A Simd may choose a different integer representation than unpack() (e.g. Q6_K uses
//             unsigned q with a min of 32*sc so the AVX2 dot needs no sign fix-up).
// Blocks of 32 values (QK == 32) have a single scale and a single min per block.
// Facts (layouts, grids) follow ggml-common.h / gguf.quants; the code is ours.

struct Unpacked {
    alignas(32) uint8_t q[256];  // uint8 or (SIGNED) int8 bit patterns, in value order
    alignas(32) int16_t sc[16];  // integer scale per group of 16 values
    alignas(32) int16_t mn[16];  // integer min per group of 16 values
    float d, dmin;
};

static inline float fp16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    if (e == 0) {
        float f = (float)m * 5.9604644775390625e-08f;  // m * 2^-24 (zero or subnormal)
        return sign ? -f : f;
    } else if (e == 31) {
        bits = sign | 0x7f800000u | (m << 13);
    } else {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline float rd_f16(const uint8_t* p) { uint16_t h; memcpy(&h, p, 2); return fp16_to_f32(h); }
static inline uint32_t rd_u32(const uint8_t* p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint16_t rd_u16(const uint8_t* p) { uint16_t v; memcpy(&v, p, 2); return v; }

static inline void fill_groups(Unpacked& u, int ngroups, int sc, int mn) {
    for (int g = 0; g < ngroups; ++g) { u.sc[g] = (int16_t)sc; u.mn[g] = (int16_t)mn; }
}

// Tables: the small ones (IQ4_NL / IQ4_XS non-linear levels, MXFP4 e2m1 levels doubled) are
// constants of ggml_blocks.h (hz_kvalues_*); the i-quant grids are read from the registry at run
// time (set_table in ops.cpp) and reach this code through hz_tables[TABLE].
template <class Block>
struct BlockOf {
    typedef Block B;
    static constexpr int ID = Block::type_id, QK = Block::qk, BYTES = (int)sizeof(Block);
};
#define HZ_OFF(T, field) offsetof(T::B, field)  // byte offset of a field of trait T's block

// ---------------------------------------------------------------- legacy 32-value blocks
struct FQ4_0 : BlockOf<block_q4_0> {  // value = d * (nibble - 8)
    static constexpr bool SIGNED = false, HAS_MIN = true;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        const uint8_t* qs = b + offsetof(B, qs);
        for (int j = 0; j < 16; ++j) { u.q[j] = qs[j] & 15; u.q[j + 16] = qs[j] >> 4; }
        u.d = rd_f16(b + offsetof(B, d)); u.dmin = u.d; fill_groups(u, 2, 1, 8);
    }
};
struct FQ4_1 : BlockOf<block_q4_1> {  // value = d * nibble + m
    static constexpr bool SIGNED = false, HAS_MIN = true;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        const uint8_t* qs = b + offsetof(B, qs);
        for (int j = 0; j < 16; ++j) { u.q[j] = qs[j] & 15; u.q[j + 16] = qs[j] >> 4; }
        u.d = rd_f16(b + offsetof(B, d)); u.dmin = -rd_f16(b + offsetof(B, m)); fill_groups(u, 2, 1, 1);
    }
};
struct FQ5_0 : BlockOf<block_q5_0> {  // value = d * ((nibble | bit<<4) - 16), qh a little-endian u32
    static constexpr bool SIGNED = false, HAS_MIN = true;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        uint32_t qh = rd_u32(b + offsetof(B, qh)); const uint8_t* qs = b + offsetof(B, qs);
        for (int j = 0; j < 16; ++j) {
            u.q[j] = (uint8_t)((qs[j] & 15) | (((qh >> j) & 1) << 4));
            u.q[j + 16] = (uint8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
        }
        u.d = rd_f16(b + offsetof(B, d)); u.dmin = u.d; fill_groups(u, 2, 1, 16);
    }
};
struct FQ5_1 : BlockOf<block_q5_1> {  // value = d * (nibble | bit<<4) + m
    static constexpr bool SIGNED = false, HAS_MIN = true;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        uint32_t qh = rd_u32(b + offsetof(B, qh)); const uint8_t* qs = b + offsetof(B, qs);
        for (int j = 0; j < 16; ++j) {
            u.q[j] = (uint8_t)((qs[j] & 15) | (((qh >> j) & 1) << 4));
            u.q[j + 16] = (uint8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
        }
        u.d = rd_f16(b + offsetof(B, d)); u.dmin = -rd_f16(b + offsetof(B, m)); fill_groups(u, 2, 1, 1);
    }
};
struct FQ8_0 : BlockOf<block_q8_0> {  // value = d * q, q int8
    static constexpr bool SIGNED = true, HAS_MIN = false;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        memcpy(u.q, b + offsetof(B, qs), 32); u.d = rd_f16(b + offsetof(B, d)); u.dmin = 0.f; fill_groups(u, 2, 1, 0);
    }
};
struct FIQ4_NL : BlockOf<block_iq4_nl> {  // value = d * kvalues[nibble]
    static constexpr bool SIGNED = true, HAS_MIN = false;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        const uint8_t* qs = b + offsetof(B, qs);
        for (int j = 0; j < 16; ++j) {
            u.q[j] = (uint8_t)hz_kvalues_iq4_nl[qs[j] & 15]; u.q[j + 16] = (uint8_t)hz_kvalues_iq4_nl[qs[j] >> 4];
        }
        u.d = rd_f16(b + offsetof(B, d)); u.dmin = 0.f; fill_groups(u, 2, 1, 0);
    }
};
struct FMXFP4 : BlockOf<block_mxfp4> {  // value = 2^(e-128) * kvalues[nibble] (e8m0 e, levels doubled)
    static constexpr bool SIGNED = true, HAS_MIN = false;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        const uint8_t* qs = b + offsetof(B, qs);
        for (int j = 0; j < 16; ++j) {
            u.q[j] = (uint8_t)hz_kvalues_mxfp4[qs[j] & 15]; u.q[j + 16] = (uint8_t)hz_kvalues_mxfp4[qs[j] >> 4];
        }
        uint32_t e = b[offsetof(B, e)], bits = e < 2 ? (0x00200000u << e) : ((e - 1) << 23);
        memcpy(&u.d, &bits, 4); u.dmin = 0.f; fill_groups(u, 2, 1, 0);
    }
};

// ---------------------------------------------------------------- K-quants (256-value blocks)
struct FQ2_K : BlockOf<block_q2_K> {  // scales[16] (lo: scale, hi: min), 2-bit qs
    static constexpr bool SIGNED = false, HAS_MIN = true;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        const uint8_t *qs = b + offsetof(B, qs), *s = b + offsetof(B, scales);
        for (int h = 0; h < 2; ++h)
            for (int j = 0; j < 4; ++j)
                for (int l = 0; l < 32; ++l) u.q[128 * h + 32 * j + l] = (qs[32 * h + l] >> (2 * j)) & 3;
        for (int g = 0; g < 16; ++g) { u.sc[g] = s[g] & 15; u.mn[g] = s[g] >> 4; }
        u.d = rd_f16(b + offsetof(B, d)); u.dmin = rd_f16(b + offsetof(B, dmin));
    }
};
struct FQ3_K : BlockOf<block_q3_K> {  // scales 6-bit, -32: value = d*sc*(q3 - 4)
    static constexpr bool SIGNED = false, HAS_MIN = true;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        const uint8_t *hm = b + offsetof(B, hmask), *qs = b + offsetof(B, qs), *s = b + offsetof(B, scales);
        for (int h = 0; h < 2; ++h)
            for (int j = 0; j < 4; ++j)
                for (int l = 0; l < 32; ++l)
                    u.q[128 * h + 32 * j + l] =
                        (uint8_t)(((qs[32 * h + l] >> (2 * j)) & 3) | (((hm[l] >> (4 * h + j)) & 1) << 2));
        for (int g = 0; g < 16; ++g) {
            int lo = g < 8 ? (s[g] & 15) : (s[g - 8] >> 4);
            int hi = (s[8 + (g & 3)] >> (2 * (g >> 2))) & 3;
            u.sc[g] = (int16_t)((lo | (hi << 4)) - 32);
            u.mn[g] = (int16_t)(4 * u.sc[g]);
        }
        u.d = rd_f16(b + offsetof(B, d)); u.dmin = u.d;
    }
};
struct FQ4_K : BlockOf<block_q4_K> {  // value = d*sc*q - dmin*m per 32
    static constexpr bool SIGNED = false, HAS_MIN = true;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        uint8_t sc[8], mn[8];
        kquant_scales_6bit(b + offsetof(B, scales), sc, mn);
        const uint8_t* qs = b + offsetof(B, qs);
        for (int c = 0; c < 4; ++c)
            for (int l = 0; l < 32; ++l) { u.q[64 * c + l] = qs[32 * c + l] & 15; u.q[64 * c + 32 + l] = qs[32 * c + l] >> 4; }
        for (int g = 0; g < 16; ++g) { u.sc[g] = sc[g >> 1]; u.mn[g] = mn[g >> 1]; }
        u.d = rd_f16(b + offsetof(B, d)); u.dmin = rd_f16(b + offsetof(B, dmin));
    }
};
struct FQ5_K : BlockOf<block_q5_K> {  // as Q4_K with a fifth bit in qh
    static constexpr bool SIGNED = false, HAS_MIN = true;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        uint8_t sc[8], mn[8];
        kquant_scales_6bit(b + offsetof(B, scales), sc, mn);
        const uint8_t *qh = b + offsetof(B, qh), *qs = b + offsetof(B, qs);
        for (int s = 0; s < 8; ++s)
            for (int l = 0; l < 32; ++l) {
                uint8_t nib = (s & 1) ? (qs[32 * (s >> 1) + l] >> 4) : (qs[32 * (s >> 1) + l] & 15);
                u.q[32 * s + l] = (uint8_t)(nib | (((qh[l] >> s) & 1) << 4));
            }
        for (int g = 0; g < 16; ++g) { u.sc[g] = sc[g >> 1]; u.mn[g] = mn[g >> 1]; }
        u.d = rd_f16(b + offsetof(B, d)); u.dmin = rd_f16(b + offsetof(B, dmin));
    }
};
struct FQ6_K : BlockOf<block_q6_K> {  // value = d*sc*(q6 - 32), scales int8
    static constexpr bool SIGNED = true, HAS_MIN = false;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        for (int h = 0; h < 2; ++h) {
            const uint8_t *ql = b + offsetof(B, ql) + 64 * h, *qh = b + offsetof(B, qh) + 32 * h;
            for (int l = 0; l < 32; ++l) {
                int8_t* q = (int8_t*)u.q + 128 * h;
                q[l] = (int8_t)(((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32);
                q[l + 32] = (int8_t)(((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
                q[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                q[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
        for (int g = 0; g < 16; ++g) { u.sc[g] = (int8_t)b[offsetof(B, scales) + g]; u.mn[g] = 0; }
        u.d = rd_f16(b + offsetof(B, d)); u.dmin = 0.f;
    }
};
struct FIQ4_XS : BlockOf<block_iq4_xs> {  // value = d*(ls-32)*kvalues[nibble]
    static constexpr bool SIGNED = true, HAS_MIN = false;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        uint16_t sh = rd_u16(b + offsetof(B, scales_h)); const uint8_t *sl = b + offsetof(B, scales_l), *qs = b + offsetof(B, qs);
        for (int ib = 0; ib < 8; ++ib) {
            int ls = ((sl[ib / 2] >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4);
            u.sc[2 * ib] = u.sc[2 * ib + 1] = (int16_t)(ls - 32);
            u.mn[2 * ib] = u.mn[2 * ib + 1] = 0;
            for (int j = 0; j < 16; ++j) {
                u.q[32 * ib + j] = (uint8_t)hz_kvalues_iq4_xs[qs[16 * ib + j] & 15];
                u.q[32 * ib + 16 + j] = (uint8_t)hz_kvalues_iq4_xs[qs[16 * ib + j] >> 4];
            }
        }
        u.d = rd_f16(b + offsetof(B, d)); u.dmin = 0.f;
    }
};
struct FTQ2_0 : BlockOf<block_tq2_0> {  // 2-bit qs: value = d * (q - 1)
    static constexpr bool SIGNED = false, HAS_MIN = true;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        const uint8_t* qs = b + offsetof(B, qs);
        for (int h = 0; h < 2; ++h)
            for (int l = 0; l < 4; ++l)
                for (int m = 0; m < 32; ++m) u.q[128 * h + 32 * l + m] = (qs[32 * h + m] >> (2 * l)) & 3;
        u.d = rd_f16(b + offsetof(B, d)); u.dmin = u.d; fill_groups(u, 16, 1, 1);
    }
};
struct FTQ1_0 : BlockOf<block_tq1_0> {  // qs 5 trits/byte, qh 4 trits/byte: value = d * (trit - 1)
    static constexpr bool SIGNED = false, HAS_MIN = true;
    static inline uint8_t trit(uint8_t byte, int n) {
        static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
        uint8_t q = (uint8_t)(byte * pow3[n]);
        return (uint8_t)(((uint16_t)q * 3) >> 8);
    }
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        const uint8_t *qs = b + offsetof(B, qs), *qh = b + offsetof(B, qh);
        int p = 0;
        for (int n = 0; n < 5; ++n) for (int m = 0; m < 32; ++m) u.q[p++] = trit(qs[m], n);
        for (int n = 0; n < 5; ++n) for (int m = 0; m < 16; ++m) u.q[p++] = trit(qs[32 + m], n);
        for (int n = 0; n < 4; ++n) for (int j = 0; j < 4; ++j) u.q[p++] = trit(qh[j], n);
        u.d = rd_f16(b + offsetof(B, d)); u.dmin = u.d; fill_groups(u, 16, 1, 1);
    }
};

// ---------------------------------------------------------------- i-quants with codebook grids
// Grid tables come from the registry (gguf.quants <Type>.grid) via set_table() into
// hz_tables[TABLE]; rows of 8 (or 4) int8 values. Sign bytes of IQ2_XXS/IQ2_XS/IQ3_XXS store 7 bits; the 8th is their parity.
static inline uint8_t sign7(uint32_t s7) {
    s7 &= 127;
    return (uint8_t)(s7 | ((__builtin_popcount(s7) & 1) << 7));
}
static inline void put_signed8(uint8_t* dst, const int8_t* grid_row, uint8_t signs, int mul, int add_pos, int add_neg) {
    // dst[i] = (mul * g[i] + add) * (-1)^bit_i   (IQ1 uses mul=8, add=+-1; others mul=1, add=0)
    for (int i = 0; i < 8; ++i) {
        int v = grid_row[i];
        (void)add_neg;
        v = v * mul + add_pos;
        dst[i] = (uint8_t)(int8_t)((signs >> i) & 1 ? -v : v);
    }
}
struct FIQ2_XXS : BlockOf<block_iq2_xxs> {  // qs: 8 x (u32 grid idx x4, u32 signs 4x7 bits | scale<<28): value = d*(0.5+s)/4 * grid * sign
    static constexpr bool SIGNED = true, HAS_MIN = false;
    static constexpr int TABLE = HZ_TABLE_IQ2_XXS_GRID;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        const int8_t* grid = hz_tables[TABLE];
        for (int ib = 0; ib < 8; ++ib) {
            const uint8_t* g = b + offsetof(B, qs) + 8 * ib;
            uint32_t aux1 = rd_u32(g + 4);
            for (int l = 0; l < 4; ++l)
                put_signed8(u.q + 32 * ib + 8 * l, grid + 8 * g[l], sign7(aux1 >> (7 * l)), 1, 0, 0);
            u.sc[2 * ib] = u.sc[2 * ib + 1] = (int16_t)(2 * (aux1 >> 28) + 1);
            u.mn[2 * ib] = u.mn[2 * ib + 1] = 0;
        }
        u.d = rd_f16(b + offsetof(B, d)) * 0.125f; u.dmin = 0.f;
    }
};
struct FIQ2_XS : BlockOf<block_iq2_xs> {  // qs u16[32] (9-bit grid idx | 7 sign bits), scales[8] (4 bits per 16)
    static constexpr bool SIGNED = true, HAS_MIN = false;
    static constexpr int TABLE = HZ_TABLE_IQ2_XS_GRID;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        const int8_t* grid = hz_tables[TABLE];
        const uint8_t* s = b + offsetof(B, scales);
        for (int i = 0; i < 32; ++i) {
            uint16_t v = rd_u16(b + offsetof(B, qs) + 2 * i);
            put_signed8(u.q + 8 * i, grid + 8 * (v & 511), sign7(v >> 9), 1, 0, 0);
        }
        for (int g = 0; g < 16; ++g) { u.sc[g] = (int16_t)(2 * ((s[g / 2] >> (4 * (g % 2))) & 15) + 1); u.mn[g] = 0; }
        u.d = rd_f16(b + offsetof(B, d)) * 0.125f; u.dmin = 0.f;
    }
};
struct FIQ2_S : BlockOf<block_iq2_s> {  // qs[64] (32 low idx bytes, then 32 sign bytes) | qh[8] (2 high idx bits each) | scales[8]
    static constexpr bool SIGNED = true, HAS_MIN = false;
    static constexpr int TABLE = HZ_TABLE_IQ2_S_GRID;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        const int8_t* grid = hz_tables[TABLE];
        const uint8_t *qs = b + offsetof(B, qs), *sg = qs + 32, *qh = b + offsetof(B, qh), *s = b + offsetof(B, scales);
        for (int i = 0; i < 32; ++i) {
            int idx = qs[i] | (((qh[i / 4] >> (2 * (i % 4))) & 3) << 8);
            put_signed8(u.q + 8 * i, grid + 8 * idx, sg[i], 1, 0, 0);
        }
        for (int g = 0; g < 16; ++g) { u.sc[g] = (int16_t)(2 * ((s[g / 2] >> (4 * (g % 2))) & 15) + 1); u.mn[g] = 0; }
        u.d = rd_f16(b + offsetof(B, d)) * 0.125f; u.dmin = 0.f;
    }
};
struct FIQ3_XXS : BlockOf<block_iq3_xxs> {  // qs[96]: 64 grid idx (4 values each), then 8 x u32 (signs 4x7 bits | scale<<28)
    static constexpr bool SIGNED = true, HAS_MIN = false;
    static constexpr int TABLE = HZ_TABLE_IQ3_XXS_GRID;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        const int8_t* grid = hz_tables[TABLE];
        const uint8_t* qs = b + offsetof(B, qs);
        for (int ib = 0; ib < 8; ++ib) {
            uint32_t aux = rd_u32(qs + 64 + 4 * ib);
            for (int l = 0; l < 4; ++l) {
                int8_t row[8];
                memcpy(row, grid + 4 * qs[8 * ib + 2 * l], 4);
                memcpy(row + 4, grid + 4 * qs[8 * ib + 2 * l + 1], 4);
                put_signed8(u.q + 32 * ib + 8 * l, row, sign7(aux >> (7 * l)), 1, 0, 0);
            }
            u.sc[2 * ib] = u.sc[2 * ib + 1] = (int16_t)(2 * (aux >> 28) + 1);
            u.mn[2 * ib] = u.mn[2 * ib + 1] = 0;
        }
        u.d = rd_f16(b + offsetof(B, d)) * 0.25f; u.dmin = 0.f;
    }
};
struct FIQ3_S : BlockOf<block_iq3_s> {  // qh: 9th idx bit, scales 4 bits per 32: value = d*(1+2s)*grid*sign
    static constexpr bool SIGNED = true, HAS_MIN = false;
    static constexpr int TABLE = HZ_TABLE_IQ3_S_GRID;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        const int8_t* grid = hz_tables[TABLE];
        const uint8_t *qs = b + offsetof(B, qs), *qh = b + offsetof(B, qh), *sg = b + offsetof(B, signs), *s = b + offsetof(B, scales);
        for (int i = 0; i < 32; ++i) {  // groups of 8 values = two grid rows of 4
            int8_t row[8];
            int i0 = 2 * i, i1 = 2 * i + 1;
            memcpy(row, grid + 4 * (qs[i0] | (((qh[i0 / 8] >> (i0 % 8)) & 1) << 8)), 4);
            memcpy(row + 4, grid + 4 * (qs[i1] | (((qh[i1 / 8] >> (i1 % 8)) & 1) << 8)), 4);
            put_signed8(u.q + 8 * i, row, sg[i], 1, 0, 0);
        }
        for (int g = 0; g < 16; ++g) { u.sc[g] = (int16_t)(1 + 2 * ((s[g / 4] >> (4 * ((g / 2) % 2))) & 15)); u.mn[g] = 0; }
        u.d = rd_f16(b + offsetof(B, d)); u.dmin = 0.f;
    }
};
struct FIQ1_S : BlockOf<block_iq1_s> {  // qh u16[8] (3x3 high idx bits | scale<<12 | delta sign<<15): value = d*(2s+1)*(grid +- 1/8)
    static constexpr bool SIGNED = true, HAS_MIN = false;
    static constexpr int TABLE = HZ_TABLE_IQ1_S_GRID;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        const int8_t* grid = hz_tables[TABLE];
        const uint8_t* qs = b + offsetof(B, qs);
        for (int ib = 0; ib < 8; ++ib) {
            uint16_t qh = rd_u16(b + offsetof(B, qh) + 2 * ib);
            int delta = (qh & 0x8000) ? -1 : 1;
            for (int l = 0; l < 4; ++l) {
                int idx = qs[4 * ib + l] | (((qh >> (3 * l)) & 7) << 8);
                put_signed8(u.q + 32 * ib + 8 * l, grid + 8 * idx, 0, 8, delta, 0);
            }
            u.sc[2 * ib] = u.sc[2 * ib + 1] = (int16_t)(2 * ((qh >> 12) & 7) + 1);
            u.mn[2 * ib] = u.mn[2 * ib + 1] = 0;
        }
        u.d = rd_f16(b + offsetof(B, d)) * 0.125f; u.dmin = 0.f;
    }
};
struct FIQ1_M : BlockOf<block_iq1_m> {  // qh: nibble per 8 (3 idx bits | delta sign); scales: 4 LE u16 (3 bits per 16, f16 d in top nibbles)
    static constexpr bool SIGNED = true, HAS_MIN = false;
    static constexpr int TABLE = HZ_TABLE_IQ1_M_GRID;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        const int8_t* grid = hz_tables[TABLE];
        const uint8_t *qs = b + offsetof(B, qs), *qh = b + offsetof(B, qh);
        uint16_t s[4];
        for (int i = 0; i < 4; ++i) s[i] = rd_u16(b + offsetof(B, scales) + 2 * i);
        uint16_t dh = (uint16_t)((s[0] >> 12) | ((s[1] >> 8) & 0x00f0) | ((s[2] >> 4) & 0x0f00) | (s[3] & 0xf000));
        for (int i = 0; i < 32; ++i) {
            int nib = (qh[i / 2] >> (4 * (i % 2))) & 15;
            int idx = qs[i] | ((nib & 7) << 8);
            put_signed8(u.q + 8 * i, grid + 8 * idx, 0, 8, (nib & 8) ? -1 : 1, 0);
        }
        for (int g = 0; g < 16; ++g) { u.sc[g] = (int16_t)(2 * ((s[g / 4] >> (3 * (g % 4))) & 7) + 1); u.mn[g] = 0; }
        u.d = fp16_to_f32(dh) * 0.125f; u.dmin = 0.f;
    }
};

// ---------------------------------------------------------------- binary (sign-only) blocks
struct FQ1_0 : BlockOf<block_q1_0> {  // value = bit ? d : -d, bit j of qs[j / 8] (lsb first)
    static constexpr bool SIGNED = true, HAS_MIN = false;
    static inline void unpack(const uint8_t* b, Unpacked& u) {
        const uint8_t* qs = b + offsetof(B, qs);
        for (int j = 0; j < QK; ++j) u.q[j] = (uint8_t)(int8_t)(((qs[j / 8] >> (j % 8)) & 1) ? 1 : -1);
        u.d = rd_f16(b + offsetof(B, d)); u.dmin = 0.f; fill_groups(u, 16, 1, 0);
    }
};

// The HzTableSlot a trait reads (its TABLE), -1 for traits without one.
template <class...> using hz_void_tt = void;
template <class T, class = void> struct TableOf { static constexpr int value = -1; };
template <class T> struct TableOf<T, hz_void_tt<decltype(T::TABLE)>> { static constexpr int value = T::TABLE; };

// Every format with a CPU kernel, for the dispatch tables (X-macro HZ_FOR_EACH_FORMAT(X): X(trait)),
// generated from the CPU backend's rule list (hanzo_torch/backends/cpu/rules.py).
#include "format_list.h"
