// The int8 rules of the Vulkan shaders: a format's values as integer codes times per-group float
// factors, for dot products against q8_1 activations (q8_1.glsl). Selected like formats.glsl, by
// HZ_VARIANT_<NAME> of a shader whose first line is `// hz: variants @int8` (the formats of
// hanzo_torch/backends/vulkan/rules.py INT8_RULES, one rule each below). A rule is
//     int hz_q8_code(uint64_t blk, uint j)   the signed code (-128..127) of in-block element j
//     vec2 hz_q8_ab(uint64_t blk, uint g)    (A, B) of scale group g (HZ_Q8_GROUP values)
// with value_j = A * code_j + B (B only where HZ_Q8_HAS_B is defined), so that a group of
// weights dotted with a q8_1 block (scale dx, codes qx) is dx * (A * dot(code, qx) + B * sum(qx)),
// the integer dots exact. A and B are the products of the format's dequantizer (formats.glsl).
// The dots use SPV_KHR_integer_dot_product (OpSDot on 4 packed int8 lanes) through
// GL_EXT_spirv_intrinsics: glslc releases before GL_EXT_integer_dot_product reached glslang lack
// the GLSL built-ins. A device without shaderIntegerDotProduct must not run these shaders.
#ifndef HZ_FORMATS_Q8_GLSL
#define HZ_FORMATS_Q8_GLSL

#if defined(HZ_VARIANT_Q4_0)
#define HZ_FMT_Q4_0 1
#elif defined(HZ_VARIANT_Q4_1)
#define HZ_FMT_Q4_1 1
#elif defined(HZ_VARIANT_Q5_0)
#define HZ_FMT_Q5_0 1
#elif defined(HZ_VARIANT_Q5_1)
#define HZ_FMT_Q5_1 1
#elif defined(HZ_VARIANT_Q8_0)
#define HZ_FMT_Q8_0 1
#elif defined(HZ_VARIANT_Q4_K)
#define HZ_FMT_Q4_K 1
#elif defined(HZ_VARIANT_Q5_K)
#define HZ_FMT_Q5_K 1
#elif defined(HZ_VARIANT_Q6_K)
#define HZ_FMT_Q6_K 1
#elif defined(HZ_VARIANT_IQ4_NL)
#define HZ_FMT_IQ4_NL 1
#elif defined(HZ_VARIANT_IQ4_XS)
#define HZ_FMT_IQ4_XS 1
#endif

#extension GL_EXT_spirv_intrinsics : require

#include "formats.glsl"

// OpSDot (4450) of two words of 4 packed signed int8 lanes (PackedVectorFormat4x8Bit = 0);
// capabilities DotProduct (6019) and DotProductInput4x8BitPacked (6018).
spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4450)
int hz_sdot4x8_(uint a, uint b, spirv_literal int packed_format);
int hz_dot4(uint a, uint b) { return hz_sdot4x8_(a, b, 0); }

#if defined(HZ_FMT_Q8_0)
#define HZ_Q8_GROUP 32u
int hz_q8_code(uint64_t b, uint j) { return hz_i8(b, HZ_Q8_0_qs + j); }
vec2 hz_q8_ab(uint64_t b, uint g) { return vec2(hz_f16(b, HZ_Q8_0_d), 0.0); }

#elif defined(HZ_FMT_Q4_0)
#define HZ_Q8_GROUP 32u
int hz_q8_code(uint64_t b, uint j) { return int(hz_nibble16(b, HZ_Q4_0_qs, j)) - 8; }
vec2 hz_q8_ab(uint64_t b, uint g) { return vec2(hz_f16(b, HZ_Q4_0_d), 0.0); }

#elif defined(HZ_FMT_Q4_1)
#define HZ_Q8_GROUP 32u
#define HZ_Q8_HAS_B
int hz_q8_code(uint64_t b, uint j) { return int(hz_nibble16(b, HZ_Q4_1_qs, j)); }
vec2 hz_q8_ab(uint64_t b, uint g) { return vec2(hz_f16(b, HZ_Q4_1_d), hz_f16(b, HZ_Q4_1_m)); }

#elif defined(HZ_FMT_Q5_0)
#define HZ_Q8_GROUP 32u
int hz_q8_code(uint64_t b, uint j) {
    uint qh = (hz_u32(b, HZ_Q5_0_qh) >> j) & 1u;
    return int(hz_nibble16(b, HZ_Q5_0_qs, j) | (qh << 4)) - 16;
}
vec2 hz_q8_ab(uint64_t b, uint g) { return vec2(hz_f16(b, HZ_Q5_0_d), 0.0); }

#elif defined(HZ_FMT_Q5_1)
#define HZ_Q8_GROUP 32u
#define HZ_Q8_HAS_B
int hz_q8_code(uint64_t b, uint j) {
    uint qh = (hz_u32(b, HZ_Q5_1_qh) >> j) & 1u;
    return int(hz_nibble16(b, HZ_Q5_1_qs, j) | (qh << 4));
}
vec2 hz_q8_ab(uint64_t b, uint g) { return vec2(hz_f16(b, HZ_Q5_1_d), hz_f16(b, HZ_Q5_1_m)); }

#elif defined(HZ_FMT_Q4_K)
#define HZ_Q8_GROUP 32u
#define HZ_Q8_HAS_B
int hz_q8_code(uint64_t b, uint j) {
    return int((hz_u8(b, HZ_Q4_K_qs + (j / 64u) * 32u + j % 32u) >> (4u * ((j / 32u) % 2u))) & 15u);
}
vec2 hz_q8_ab(uint64_t b, uint g) {
    uvec2 sm = hz_scale_min_k4(b, HZ_Q4_K_scales, g);
    precise float ds = hz_f16(b, HZ_Q4_K_d) * float(sm.x);
    precise float dm = hz_f16(b, HZ_Q4_K_dmin) * float(sm.y);
    return vec2(ds, -dm);
}

#elif defined(HZ_FMT_Q5_K)
#define HZ_Q8_GROUP 32u
#define HZ_Q8_HAS_B
int hz_q8_code(uint64_t b, uint j) {
    uint s = j / 32u;
    uint ql = (hz_u8(b, HZ_Q5_K_qs + (j / 64u) * 32u + j % 32u) >> (4u * (s % 2u))) & 15u;
    uint qh = (hz_u8(b, HZ_Q5_K_qh + j % 32u) >> s) & 1u;
    return int(ql | (qh << 4));
}
vec2 hz_q8_ab(uint64_t b, uint g) {
    uvec2 sm = hz_scale_min_k4(b, HZ_Q5_K_scales, g);
    precise float ds = hz_f16(b, HZ_Q5_K_d) * float(sm.x);
    precise float dm = hz_f16(b, HZ_Q5_K_dmin) * float(sm.y);
    return vec2(ds, -dm);
}

#elif defined(HZ_FMT_Q6_K)
#define HZ_Q8_GROUP 16u
int hz_q8_code(uint64_t b, uint j) {
    uint h = j / 128u, r = j % 128u;
    uint ql = (hz_u8(b, HZ_Q6_K_ql + h * 64u + r % 64u) >> (4u * (r / 64u))) & 15u;
    uint qh = (hz_u8(b, HZ_Q6_K_qh + h * 32u + r % 32u) >> (2u * (r / 32u))) & 3u;
    return int(ql | (qh << 4)) - 32;
}
vec2 hz_q8_ab(uint64_t b, uint g) {
    precise float ds = hz_f16(b, HZ_Q6_K_d) * float(hz_i8(b, HZ_Q6_K_scales + g));
    return vec2(ds, 0.0);
}

#elif defined(HZ_FMT_IQ4_NL)
#define HZ_Q8_GROUP 32u
int hz_q8_code(uint64_t b, uint j) { return HZ_IQ4_NL_TABLE_KVALUES[hz_nibble16(b, HZ_IQ4_NL_qs, j)]; }
vec2 hz_q8_ab(uint64_t b, uint g) { return vec2(hz_f16(b, HZ_IQ4_NL_d), 0.0); }

#elif defined(HZ_FMT_IQ4_XS)
#define HZ_Q8_GROUP 32u
int hz_q8_code(uint64_t b, uint j) {
    uint ib = j / 32u, r = j % 32u;
    return HZ_IQ4_XS_TABLE_KVALUES[(hz_u8(b, HZ_IQ4_XS_qs + ib * 16u + r % 16u) >> (4u * (r / 16u))) & 15u];
}
vec2 hz_q8_ab(uint64_t b, uint g) {
    uint sl = (hz_u8(b, HZ_IQ4_XS_scales_l + g / 2u) >> (4u * (g % 2u))) & 15u;
    uint sh = (hz_u16(b, HZ_IQ4_XS_scales_h) >> (2u * g)) & 3u;
    precise float dl = hz_f16(b, HZ_IQ4_XS_d) * float(int(sl | (sh << 4)) - 32);
    return vec2(dl, 0.0);
}

#else
#error "formats_q8.glsl: no int8 rule for this variant"
#endif

// groups of HZ_Q8_GROUP values in one 32-value q8_1 block
#define HZ_Q8_NG (32u / HZ_Q8_GROUP)

// the codes of elements j .. j + 3 (j % 4 == 0) as 4 packed int8 lanes
uint hz_q8_word(uint64_t b, uint j) {
    uint w = 0u;
    for (uint i = 0u; i < 4u; ++i) w |= uint(hz_q8_code(b, j + i) & 0xFF) << (8u * i);
    return w;
}

#endif  // HZ_FORMATS_Q8_GLSL
