// The format layer of the Vulkan shaders: one rule per ggml format, selected at compile time by
// HZ_FMT_<NAME> (the build compiles each `// hz: per-format` shader once per format of the
// backend's list, hanzo_torch/backends/vulkan/rules.py; a shader without a format defines
// HZ_NO_FORMAT and gets the dtype functions only). A rule is
//     float hz_elem(uint64_t blk, uint j)
// the float32 value of in-block element j (0 <= j < HZ_QK) of the block at byte address blk, plus
// the constants HZ_QK (values per block), HZ_TS (bytes per block) and HZ_GROUP_LEN (values per
// scale group; 1 for dense types). Logical column k of a packed row at byte address row lives in
// block k / HZ_QK at row + (k / HZ_QK) * HZ_TS, element k % HZ_QK.
//
// Block layouts, field offsets and the small tables come from ggml_blocks.glsl (generated from the
// format registry); the i-quant grids are read at hz_table. Blocks are not 4-byte aligned (Q4_0
// blocks are 18 bytes, MXFP4 17), so every field is read byte by byte through an 8-bit
// buffer_reference. The float arithmetic of each rule follows the
// order of operations of the registry's dequantizers (and of gguf.quants), and every float result
// is `precise` (no multiply-add contraction), so dequantize/get_rows are bit-exact with the
// reference. Activation and output functions for float32 / float16 / bfloat16 tensors are at the end
// (float16 and bfloat16 results are rounded to nearest even in integer arithmetic, as torch rounds).
#ifndef HZ_FORMATS_GLSL
#define HZ_FORMATS_GLSL

#include "common.glsl"  // extensions and the pointer types (U8Ptr, F32Ptr, ...)

#include "ggml_blocks.glsl"

// ------------------------------------------------------------------------------------------------
// byte readers (little-endian, as ggml stores blocks)

uint hz_u8(uint64_t b, uint off) { return uint(U8Ptr(b).v[off]); }
uint hz_u16(uint64_t b, uint off) { return hz_u8(b, off) | (hz_u8(b, off + 1u) << 8); }
uint hz_u32(uint64_t b, uint off) { return hz_u16(b, off) | (hz_u16(b, off + 2u) << 16); }
int hz_i8(uint64_t b, uint off) { return bitfieldExtract(int(hz_u8(b, off)), 0, 8); }
float hz_f16_bits(uint h) { return unpackHalf2x16(h).x; }
float hz_f16(uint64_t b, uint off) { return hz_f16_bits(hz_u16(b, off)); }

// 32 4-bit values in 16 bytes: value j < 16 is the low nibble of byte j, j >= 16 the high nibble
// of byte j - 16 (the legacy, IQ4_NL and MXFP4 order).
uint hz_nibble16(uint64_t b, uint qs, uint j) { return (hz_u8(b, qs + (j & 15u)) >> (4u * (j >> 4))) & 15u; }

// IQ2_XXS, IQ2_XS and IQ3_XXS store 7 sign bits per 8 values; the 8th is the parity of the 7.
uint hz_sign8(uint s7, uint i) {
    uint p = s7 ^ (s7 >> 4);
    p ^= p >> 2;
    p ^= p >> 1;
    return ((s7 | ((p & 1u) << 7)) >> i) & 1u;
}

// 6-bit scale (x) and min (y) of sub-block s (0..7) from the 12 packed scale bytes at b + sc (Q4_K, Q5_K).
uvec2 hz_scale_min_k4(uint64_t b, uint sc, uint s) {
    uint a = hz_u8(b, sc + (s & 3u)), c = hz_u8(b, sc + 4u + (s & 3u)), e = hz_u8(b, sc + 8u + (s & 3u));
    if (s < 4u) return uvec2(a & 63u, c & 63u);
    return uvec2((e & 15u) | ((a >> 6) << 4), (e >> 4) | ((c >> 6) << 4));
}

// The address of the format's int8 table when it has one too large to be a GLSL constant (the
// i-quant grids, uploaded once by the backend from the registry, ggml_blocks.glsl): every shader
// sets it from its push constants before it calls a rule.
uint64_t hz_table = 0ul;

// ------------------------------------------------------------------------------------------------
// one rule per format

#if defined(HZ_FMT_F32)
#define HZ_QK HZ_F32_QK
#define HZ_TS HZ_F32_TS
float hz_elem(uint64_t b, uint j) { return uintBitsToFloat(hz_u32(b, HZ_F32_v)); }

#elif defined(HZ_FMT_F16)
#define HZ_QK HZ_F16_QK
#define HZ_TS HZ_F16_TS
float hz_elem(uint64_t b, uint j) { return hz_f16(b, HZ_F16_v); }

#elif defined(HZ_FMT_BF16)
#define HZ_QK HZ_BF16_QK
#define HZ_TS HZ_BF16_TS
float hz_elem(uint64_t b, uint j) { return uintBitsToFloat(hz_u16(b, HZ_BF16_v) << 16); }

#elif defined(HZ_FMT_Q1_0)
#define HZ_QK HZ_Q1_0_QK
#define HZ_TS HZ_Q1_0_TS
#define HZ_GROUP_LEN HZ_Q1_0_GROUP_LEN
// d qs[16]: value j is +d if bit j % 8 of qs[j / 8] is set, else -d
float hz_elem(uint64_t b, uint j) {
    int s = 2 * int((hz_u8(b, HZ_Q1_0_qs + j / 8u) >> (j % 8u)) & 1u) - 1;
    precise float r = float(s) * hz_f16(b, HZ_Q1_0_d);
    return r;
}

#elif defined(HZ_FMT_Q4_0)
#define HZ_QK HZ_Q4_0_QK
#define HZ_TS HZ_Q4_0_TS
#define HZ_GROUP_LEN HZ_Q4_0_GROUP_LEN
float hz_elem(uint64_t b, uint j) {
    precise float r = hz_f16(b, HZ_Q4_0_d) * float(int(hz_nibble16(b, HZ_Q4_0_qs, j)) - 8);
    return r;
}

#elif defined(HZ_FMT_Q4_1)
#define HZ_QK HZ_Q4_1_QK
#define HZ_TS HZ_Q4_1_TS
#define HZ_GROUP_LEN HZ_Q4_1_GROUP_LEN
float hz_elem(uint64_t b, uint j) {
    precise float p = hz_f16(b, HZ_Q4_1_d) * float(hz_nibble16(b, HZ_Q4_1_qs, j));
    precise float r = p + hz_f16(b, HZ_Q4_1_m);
    return r;
}

#elif defined(HZ_FMT_Q5_0)
#define HZ_QK HZ_Q5_0_QK
#define HZ_TS HZ_Q5_0_TS
#define HZ_GROUP_LEN HZ_Q5_0_GROUP_LEN
float hz_elem(uint64_t b, uint j) {
    uint qh = (hz_u32(b, HZ_Q5_0_qh) >> j) & 1u;
    uint q = hz_nibble16(b, HZ_Q5_0_qs, j) | (qh << 4);
    precise float r = hz_f16(b, HZ_Q5_0_d) * float(int(q) - 16);
    return r;
}

#elif defined(HZ_FMT_Q5_1)
#define HZ_QK HZ_Q5_1_QK
#define HZ_TS HZ_Q5_1_TS
#define HZ_GROUP_LEN HZ_Q5_1_GROUP_LEN
float hz_elem(uint64_t b, uint j) {
    uint qh = (hz_u32(b, HZ_Q5_1_qh) >> j) & 1u;
    uint q = hz_nibble16(b, HZ_Q5_1_qs, j) | (qh << 4);
    precise float p = hz_f16(b, HZ_Q5_1_d) * float(q);
    precise float r = p + hz_f16(b, HZ_Q5_1_m);
    return r;
}

#elif defined(HZ_FMT_Q8_0)
#define HZ_QK HZ_Q8_0_QK
#define HZ_TS HZ_Q8_0_TS
#define HZ_GROUP_LEN HZ_Q8_0_GROUP_LEN
float hz_elem(uint64_t b, uint j) {
    precise float r = float(hz_i8(b, HZ_Q8_0_qs + j)) * hz_f16(b, HZ_Q8_0_d);
    return r;
}

#elif defined(HZ_FMT_Q2_K)
#define HZ_QK HZ_Q2_K_QK
#define HZ_TS HZ_Q2_K_TS
#define HZ_GROUP_LEN HZ_Q2_K_GROUP_LEN
// scales[16] qs[64] d dmin: value = d * (sc & 15) * q - dmin * (sc >> 4), 16 values per scale
float hz_elem(uint64_t b, uint j) {
    uint sc = hz_u8(b, HZ_Q2_K_scales + j / 16u);
    uint r = j % 128u;
    uint q = (hz_u8(b, HZ_Q2_K_qs + (j / 128u) * 32u + r % 32u) >> (2u * (r / 32u))) & 3u;
    precise float dl = hz_f16(b, HZ_Q2_K_d) * float(sc & 15u);
    precise float ml = hz_f16(b, HZ_Q2_K_dmin) * float(sc >> 4);
    precise float p = dl * float(q);
    precise float v = p - ml;
    return v;
}

#elif defined(HZ_FMT_Q3_K)
#define HZ_QK HZ_Q3_K_QK
#define HZ_TS HZ_Q3_K_TS
#define HZ_GROUP_LEN HZ_Q3_K_GROUP_LEN
// hmask[32] qs[64] scales[12] d: 6-bit signed scales (minus 32), q = low 2 bits - 4 * (1 - hbit)
float hz_elem(uint64_t b, uint j) {
    uint hbit = (hz_u8(b, HZ_Q3_K_hmask + j % 32u) >> (j / 32u)) & 1u;
    uint r = j % 128u;
    uint ql = (hz_u8(b, HZ_Q3_K_qs + (j / 128u) * 32u + r % 32u) >> (2u * (r / 32u))) & 3u;
    uint s = j / 16u;
    uint lo = (hz_u8(b, HZ_Q3_K_scales + s % 8u) >> (4u * (s / 8u))) & 15u;
    uint hi = (hz_u8(b, HZ_Q3_K_scales + 8u + s % 4u) >> (2u * (s / 4u))) & 3u;
    precise float dl = hz_f16(b, HZ_Q3_K_d) * float(int(lo | (hi << 4)) - 32);
    precise float v = dl * float(int(ql) - int((1u - hbit) << 2));
    return v;
}

#elif defined(HZ_FMT_Q4_K)
#define HZ_QK HZ_Q4_K_QK
#define HZ_TS HZ_Q4_K_TS
#define HZ_GROUP_LEN HZ_Q4_K_GROUP_LEN
// d dmin scales[12] qs[128]: value = d * sc * q - dmin * mn, 32 values per sub-block
float hz_elem(uint64_t b, uint j) {
    uint s = j / 32u;
    uvec2 sm = hz_scale_min_k4(b, HZ_Q4_K_scales, s);
    uint q = (hz_u8(b, HZ_Q4_K_qs + (j / 64u) * 32u + j % 32u) >> (4u * (s % 2u))) & 15u;
    precise float ds = hz_f16(b, HZ_Q4_K_d) * float(sm.x);
    precise float dm = hz_f16(b, HZ_Q4_K_dmin) * float(sm.y);
    precise float p = ds * float(q);
    precise float v = p - dm;
    return v;
}

#elif defined(HZ_FMT_Q5_K)
#define HZ_QK HZ_Q5_K_QK
#define HZ_TS HZ_Q5_K_TS
#define HZ_GROUP_LEN HZ_Q5_K_GROUP_LEN
// d dmin scales[12] qh[32] qs[128]
float hz_elem(uint64_t b, uint j) {
    uint s = j / 32u;
    uvec2 sm = hz_scale_min_k4(b, HZ_Q5_K_scales, s);
    uint ql = (hz_u8(b, HZ_Q5_K_qs + (j / 64u) * 32u + j % 32u) >> (4u * (s % 2u))) & 15u;
    uint qh = (hz_u8(b, HZ_Q5_K_qh + j % 32u) >> s) & 1u;
    precise float ds = hz_f16(b, HZ_Q5_K_d) * float(sm.x);
    precise float dm = hz_f16(b, HZ_Q5_K_dmin) * float(sm.y);
    precise float p = ds * float(ql | (qh << 4));
    precise float v = p - dm;
    return v;
}

#elif defined(HZ_FMT_Q6_K)
#define HZ_QK HZ_Q6_K_QK
#define HZ_TS HZ_Q6_K_TS
#define HZ_GROUP_LEN HZ_Q6_K_GROUP_LEN
// ql[128] qh[64] scales[16] (int8) d: value = d * sc * (q - 32), 16 values per scale
float hz_elem(uint64_t b, uint j) {
    uint h = j / 128u, r = j % 128u;
    uint ql = (hz_u8(b, HZ_Q6_K_ql + h * 64u + r % 64u) >> (4u * (r / 64u))) & 15u;
    uint qh = (hz_u8(b, HZ_Q6_K_qh + h * 32u + r % 32u) >> (2u * (r / 32u))) & 3u;
    precise float ds = hz_f16(b, HZ_Q6_K_d) * float(hz_i8(b, HZ_Q6_K_scales + j / 16u));
    precise float v = ds * float(int(ql | (qh << 4)) - 32);
    return v;
}

#elif defined(HZ_FMT_TQ1_0)
#define HZ_QK HZ_TQ1_0_QK
#define HZ_TS HZ_TQ1_0_TS
#define HZ_GROUP_LEN HZ_TQ1_0_GROUP_LEN
// qs[48] qh[4] d: base-3 digits packed 5 (4 in qh) per byte as a fixed-point fraction -> -1..1
float hz_elem(uint64_t b, uint j) {
    uint byte_off, digit;
    if (j < 160u) {
        byte_off = HZ_TQ1_0_qs + j % 32u;
        digit = j / 32u;
    } else if (j < 240u) {
        byte_off = HZ_TQ1_0_qs + 32u + (j - 160u) % 16u;
        digit = (j - 160u) / 16u;
    } else {
        byte_off = HZ_TQ1_0_qh + (j - 240u) % 4u;
        digit = (j - 240u) / 4u;
    }
    const uint pow3[5] = uint[](1u, 3u, 9u, 27u, 81u);
    uint v = (hz_u8(b, byte_off) * pow3[digit]) & 255u;
    precise float r = hz_f16(b, HZ_TQ1_0_d) * float(int((v * 3u) >> 8) - 1);
    return r;
}

#elif defined(HZ_FMT_TQ2_0)
#define HZ_QK HZ_TQ2_0_QK
#define HZ_TS HZ_TQ2_0_TS
#define HZ_GROUP_LEN HZ_TQ2_0_GROUP_LEN
// qs[64] d: 2-bit codes 0..2 meaning -1..1
float hz_elem(uint64_t b, uint j) {
    uint r = j % 128u;
    int q = int((hz_u8(b, HZ_TQ2_0_qs + (j / 128u) * 32u + r % 32u) >> (2u * (r / 32u))) & 3u) - 1;
    precise float v = hz_f16(b, HZ_TQ2_0_d) * float(q);
    return v;
}

#elif defined(HZ_FMT_MXFP4)
#define HZ_QK HZ_MXFP4_QK
#define HZ_TS HZ_MXFP4_TS
#define HZ_GROUP_LEN HZ_MXFP4_GROUP_LEN
// e (E8M0 exponent) qs[16]: value = 2^(e - 128) * kvalues[q] (kvalues: doubled e2m1 levels)
float hz_elem(uint64_t b, uint j) {
    uint e = hz_u8(b, HZ_MXFP4_e);
    int kv = HZ_MXFP4_TABLE_KVALUES[hz_nibble16(b, HZ_MXFP4_qs, j)];
    if (e < 2u) {
        // 2^(e-128) is subnormal in float32, and so may be the product: build it from its bits,
        // as devices that flush subnormal operands to zero would lose it (|kv| <= 12)
        uint k = uint(abs(kv)), sign = kv < 0 ? 0x80000000u : 0u;
        uint sub = k << (e + 21u);  // the product's bits while it is subnormal
        if (sub < 0x00800000u) return uintBitsToFloat(sign | sub);
        precise float t = float(kv) * uintBitsToFloat(63u << 23);  // * 2^-64: exact, normal
        precise float n = t * uintBitsToFloat((e + 63u) << 23);  // * 2^(e-64), normal result
        return n;
    }
    precise float v = uintBitsToFloat((e - 1u) << 23) * float(kv);
    return v;
}

#elif defined(HZ_FMT_NVFP4)
#define HZ_QK HZ_NVFP4_QK
#define HZ_TS HZ_NVFP4_TS
#define HZ_GROUP_LEN HZ_NVFP4_GROUP_LEN
// 4 UE4M3 scales (one per 16 values) then qs[32]: value = 0.5 * ue4m3(s) * kvalues[q]
float hz_elem(uint64_t b, uint j) {
    uint s = j / 16u, r = j % 16u;
    uint x = hz_u8(b, HZ_NVFP4_d + s);
    uint ex = (x >> 3) & 15u;
    float man = float(x & 7u);
    precise float sub = man * 0.001953125;  // 2^-9
    precise float nrm = (1.0 + man * 0.125) * uintBitsToFloat((ex + 120u) << 23);  // 2^(ex-7)
    precise float raw = ex == 0u ? sub : nrm;
    precise float d = (x == 0u || x == 0x7Fu) ? 0.0 : raw * 0.5;
    uint q = (hz_u8(b, HZ_NVFP4_qs + s * 8u + r % 8u) >> (4u * (r / 8u))) & 15u;
    precise float v = d * float(HZ_NVFP4_TABLE_KVALUES[q]);
    return v;
}

#elif defined(HZ_FMT_IQ4_NL)
#define HZ_QK HZ_IQ4_NL_QK
#define HZ_TS HZ_IQ4_NL_TS
#define HZ_GROUP_LEN HZ_IQ4_NL_GROUP_LEN
float hz_elem(uint64_t b, uint j) {
    precise float v = hz_f16(b, HZ_IQ4_NL_d) * float(HZ_IQ4_NL_TABLE_KVALUES[hz_nibble16(b, HZ_IQ4_NL_qs, j)]);
    return v;
}

#elif defined(HZ_FMT_IQ4_XS)
#define HZ_QK HZ_IQ4_XS_QK
#define HZ_TS HZ_IQ4_XS_TS
#define HZ_GROUP_LEN HZ_IQ4_XS_GROUP_LEN
// d scales_h (u16) scales_l[4] qs[128]: 6-bit scale (minus 32) per 32 values
float hz_elem(uint64_t b, uint j) {
    uint ib = j / 32u, r = j % 32u;
    uint sl = (hz_u8(b, HZ_IQ4_XS_scales_l + ib / 2u) >> (4u * (ib % 2u))) & 15u;
    uint sh = (hz_u16(b, HZ_IQ4_XS_scales_h) >> (2u * ib)) & 3u;
    precise float dl = hz_f16(b, HZ_IQ4_XS_d) * float(int(sl | (sh << 4)) - 32);
    uint q = (hz_u8(b, HZ_IQ4_XS_qs + ib * 16u + r % 16u) >> (4u * (r / 16u))) & 15u;
    precise float v = dl * float(HZ_IQ4_XS_TABLE_KVALUES[q]);
    return v;
}

#elif defined(HZ_FMT_IQ2_XXS)
#define HZ_QK HZ_IQ2_XXS_QK
#define HZ_TS HZ_IQ2_XXS_TS
#define HZ_GROUP_LEN HZ_IQ2_XXS_GROUP_LEN
// d, then per 32 values: 4 grid-index bytes and a u32 of 4 x 7 sign bits + a 4-bit scale
float hz_elem(uint64_t b, uint j) {
    uint ib = j / 32u, l = (j % 32u) / 8u, i = j % 8u;
    uint g = HZ_IQ2_XXS_qs + ib * 8u;
    uint aux = hz_u32(b, g + 4u);
    precise float t = hz_f16(b, HZ_IQ2_XXS_d) * (0.5 + float(aux >> 28));
    precise float db = t * 0.25;
    precise float v = db * float(hz_i8(hz_table, hz_u8(b, g + l) * 8u + i));
    return hz_sign8((aux >> (7u * l)) & 127u, i) != 0u ? -v : v;
}

#elif defined(HZ_FMT_IQ2_XS)
#define HZ_QK HZ_IQ2_XS_QK
#define HZ_TS HZ_IQ2_XS_TS
#define HZ_GROUP_LEN HZ_IQ2_XS_GROUP_LEN
// d qs[32] (u16: 9-bit grid index | 7 sign bits << 9) scales[8] (4 bits per 16 values)
float hz_elem(uint64_t b, uint j) {
    uint i = j % 8u;
    uint q = hz_u16(b, HZ_IQ2_XS_qs + (j / 8u) * 2u);
    uint sc = (hz_u8(b, HZ_IQ2_XS_scales + j / 32u) >> (4u * ((j / 16u) % 2u))) & 15u;
    precise float t = hz_f16(b, HZ_IQ2_XS_d) * (0.5 + float(sc));
    precise float db = t * 0.25;
    precise float v = db * float(hz_i8(hz_table, (q & 511u) * 8u + i));
    return hz_sign8(q >> 9, i) != 0u ? -v : v;
}

#elif defined(HZ_FMT_IQ2_S)
#define HZ_QK HZ_IQ2_S_QK
#define HZ_TS HZ_IQ2_S_TS
#define HZ_GROUP_LEN HZ_IQ2_S_GROUP_LEN
// d qs[32] signs[32] (in qs[32..63]) qh[8] scales[8]: 10-bit grid index = qs | 2 bits of qh << 8
float hz_elem(uint64_t b, uint j) {
    uint gi = j / 8u, i = j % 8u;
    uint idx = hz_u8(b, HZ_IQ2_S_qs + gi) | (((hz_u8(b, HZ_IQ2_S_qh + gi / 4u) >> (2u * (gi % 4u))) & 3u) << 8);
    uint sgn = (hz_u8(b, HZ_IQ2_S_qs + 32u + gi) >> i) & 1u;
    uint sc = (hz_u8(b, HZ_IQ2_S_scales + j / 32u) >> (4u * ((j / 16u) % 2u))) & 15u;
    precise float t = hz_f16(b, HZ_IQ2_S_d) * (0.5 + float(sc));
    precise float db = t * 0.25;
    precise float v = db * float(hz_i8(hz_table, idx * 8u + i));
    return sgn != 0u ? -v : v;
}

#elif defined(HZ_FMT_IQ3_XXS)
#define HZ_QK HZ_IQ3_XXS_QK
#define HZ_TS HZ_IQ3_XXS_TS
#define HZ_GROUP_LEN HZ_IQ3_XXS_GROUP_LEN
// d qs[64] (grid index per 4 values), then 8 x u32 (4 x 7 sign bits + 4-bit scale)
float hz_elem(uint64_t b, uint j) {
    uint ib = j / 32u, l = (j % 32u) / 8u, i = j % 8u;
    uint aux = hz_u32(b, HZ_IQ3_XXS_qs + 64u + ib * 4u);
    precise float t = hz_f16(b, HZ_IQ3_XXS_d) * (0.5 + float(aux >> 28));
    precise float db = t * 0.5;
    precise float v = db * float(hz_i8(hz_table, hz_u8(b, HZ_IQ3_XXS_qs + j / 4u) * 4u + j % 4u));
    return hz_sign8((aux >> (7u * l)) & 127u, i) != 0u ? -v : v;
}

#elif defined(HZ_FMT_IQ3_S)
#define HZ_QK HZ_IQ3_S_QK
#define HZ_TS HZ_IQ3_S_TS
#define HZ_GROUP_LEN HZ_IQ3_S_GROUP_LEN
// d qs[64] qh[8] signs[32] scales[4]: 9-bit grid index, explicit signs, scale 1 + 2 * s
float hz_elem(uint64_t b, uint j) {
    uint qi = j / 4u;
    uint idx = hz_u8(b, HZ_IQ3_S_qs + qi) | (((hz_u8(b, HZ_IQ3_S_qh + qi / 8u) >> (qi % 8u)) & 1u) << 8);
    uint sgn = (hz_u8(b, HZ_IQ3_S_signs + j / 8u) >> (j % 8u)) & 1u;
    uint sc = (hz_u8(b, HZ_IQ3_S_scales + j / 64u) >> (4u * ((j / 32u) % 2u))) & 15u;
    precise float db = hz_f16(b, HZ_IQ3_S_d) * float(1u + 2u * sc);
    precise float v = db * float(hz_i8(hz_table, idx * 4u + j % 4u));
    return sgn != 0u ? -v : v;
}

#elif defined(HZ_FMT_IQ1_S)
#define HZ_QK HZ_IQ1_S_QK
#define HZ_TS HZ_IQ1_S_TS
#define HZ_GROUP_LEN HZ_IQ1_S_GROUP_LEN
// d qs[32] qh[8] (u16 per 32 values: 4 x 3 index bits, 3-bit scale, delta sign)
float hz_elem(uint64_t b, uint j) {
    uint ib = j / 32u, l = (j % 32u) / 8u;
    uint qh = hz_u16(b, HZ_IQ1_S_qh + ib * 2u);
    precise float dl = hz_f16(b, HZ_IQ1_S_d) * float(2u * ((qh >> 12) & 7u) + 1u);
    float delta = (qh & 0x8000u) == 0u ? 0.125 : -0.125;
    uint idx = hz_u8(b, HZ_IQ1_S_qs + ib * 4u + l) | (((qh >> (3u * l)) & 7u) << 8);
    precise float g = float(hz_i8(hz_table, idx * 8u + j % 8u)) + delta;
    precise float v = dl * g;
    return v;
}

#elif defined(HZ_FMT_IQ1_M)
#define HZ_QK HZ_IQ1_M_QK
#define HZ_TS HZ_IQ1_M_TS
#define HZ_GROUP_LEN HZ_IQ1_M_GROUP_LEN
// qs[32] qh[16] scales[8]: the f16 d is spread over the top nibbles of the 4 scale u16 words
float hz_elem(uint64_t b, uint j) {
    uint s0 = hz_u16(b, HZ_IQ1_M_scales), s1 = hz_u16(b, HZ_IQ1_M_scales + 2u);
    uint s2 = hz_u16(b, HZ_IQ1_M_scales + 4u), s3 = hz_u16(b, HZ_IQ1_M_scales + 6u);
    float d = hz_f16_bits(((s0 & 0xF000u) >> 12) | ((s1 & 0xF000u) >> 8) | ((s2 & 0xF000u) >> 4) | (s3 & 0xF000u));
    uint t = j / 16u;
    uint sc = (hz_u16(b, HZ_IQ1_M_scales + 2u * (t / 4u)) >> (3u * (t % 4u))) & 7u;
    precise float dl = d * float(2u * sc + 1u);
    uint u = j / 8u;
    uint qh = (hz_u8(b, HZ_IQ1_M_qh + u / 2u) >> (4u * (u % 2u))) & 15u;
    uint idx = hz_u8(b, HZ_IQ1_M_qs + u) | ((qh & 7u) << 8);
    float delta = (qh & 8u) == 0u ? 0.125 : -0.125;
    precise float g = float(hz_i8(hz_table, idx * 8u + j % 8u)) + delta;
    precise float v = dl * g;
    return v;
}

#elif !defined(HZ_NO_FORMAT)
#error "formats.glsl: compile with -DHZ_FMT_<NAME>=1 for one format of hanzo_torch/backends/vulkan/rules.py (or define HZ_NO_FORMAT)"
#endif

#ifndef HZ_NO_FORMAT
#ifndef HZ_GROUP_LEN
#define HZ_GROUP_LEN 1u
#endif

// float32 value of logical column k of the packed row starting at byte address row
float hz_value_at(uint64_t row, uint k) { return hz_elem(row + uint64_t(k / HZ_QK) * HZ_TS, k % HZ_QK); }
#endif

// ------------------------------------------------------------------------------------------------
// activations and results: dtype codes HZ_DT_F32, HZ_DT_F16, HZ_DT_BF16 (common.glsl)

// element i of a float tensor of dtype dt at address base, as float32 (exact)
float hz_load(uint64_t base, uint dt, uint64_t i) {
    if (dt == HZ_DT_F32) return uintBitsToFloat(U32Ptr(base + i * 4ul).v[0]);
    uint h = uint(U16Ptr(base + i * 2ul).v[0]);
    return dt == HZ_DT_F16 ? hz_f16_bits(h) : uintBitsToFloat(h << 16);
}

// float32 -> float16 bits, round to nearest even (subnormals, overflow to inf, NaN kept quiet)
uint hz_f16_rne(float f) {
    uint x = floatBitsToUint(f);
    uint sign = (x >> 16) & 0x8000u, e = (x >> 23) & 255u, m = x & 0x7FFFFFu;
    if (e == 255u) return sign | 0x7C00u | (m != 0u ? 0x200u | (m >> 13) : 0u);
    int E = int(e) - 112;  // the half-precision biased exponent
    if (E >= 31) return sign | 0x7C00u;
    uint h, rem, halfway;
    if (E <= 0) {
        if (E < -10) return sign;
        uint shift = uint(14 - E);
        m |= 0x800000u;
        h = m >> shift;
        rem = m & ((1u << shift) - 1u);
        halfway = 1u << (shift - 1u);
    } else {
        h = (uint(E) << 10) | (m >> 13);
        rem = m & 0x1FFFu;
        halfway = 0x1000u;
    }
    if (rem > halfway || (rem == halfway && (h & 1u) != 0u)) h += 1u;  // a carry may reach inf: correct
    return sign | h;
}

// float32 -> bfloat16 bits, round to nearest even (NaN kept quiet)
uint hz_bf16_rne(float f) {
    uint x = floatBitsToUint(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (x >> 16) | 0x40u;
    return (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
}

// store v as element i of a float tensor of dtype dt at address base (one rounding for f16/bf16)
void hz_store(uint64_t base, uint dt, uint64_t i, float v) {
    if (dt == HZ_DT_F32) {
        U32Ptr(base + i * 4ul).v[0] = floatBitsToUint(v);
    } else {
        U16Ptr(base + i * 2ul).v[0] = uint16_t(dt == HZ_DT_F16 ? hz_f16_rne(v) : hz_bf16_rne(v));
    }
}

#endif  // HZ_FORMATS_GLSL
