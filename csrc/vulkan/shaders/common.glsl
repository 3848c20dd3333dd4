// Shared by every hanzo Vulkan shader: extensions, buffer_reference pointer types and helpers.
//
// Tensors arrive as 64-bit buffer device addresses in the push constants (a tensor's
// data_ptr()); a shader turns one into a typed pointer, e.g. `F32Ptr(pc.x).v[i]`, or into a
// pointer at a byte address for unaligned views. Storage of 8- and 16-bit values needs only the
// storageBuffer8BitAccess / storageBuffer16BitAccess features the runtime requires; arithmetic
// on float16_t / int8_t needs shaderFloat16 / shaderInt8 (hz::vk::features()), so this file
// reads halves as uint16_t and decodes them exactly in 32-bit.
#ifndef HZ_COMMON_GLSL
#define HZ_COMMON_GLSL

#include "hz_constants.glsl"  // numbers shared with the host code (generated)

#extension GL_EXT_buffer_reference : require
#extension GL_EXT_buffer_reference2 : require
#extension GL_EXT_scalar_block_layout : require
#extension GL_EXT_shader_explicit_arithmetic_types_int64 : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_int8 : enable
#extension GL_EXT_shader_explicit_arithmetic_types_int16 : enable

// Pointer types: the alignment is the element's (views of any tensor are element-aligned).
layout(buffer_reference, scalar, buffer_reference_align = 1) buffer U8Ptr { uint8_t v[]; };
layout(buffer_reference, scalar, buffer_reference_align = 1) buffer I8Ptr { int8_t v[]; };
layout(buffer_reference, scalar, buffer_reference_align = 2) buffer U16Ptr { uint16_t v[]; };
layout(buffer_reference, scalar, buffer_reference_align = 2) buffer I16Ptr { int16_t v[]; };
layout(buffer_reference, scalar, buffer_reference_align = 4) buffer U32Ptr { uint v[]; };
layout(buffer_reference, scalar, buffer_reference_align = 4) buffer I32Ptr { int v[]; };
layout(buffer_reference, scalar, buffer_reference_align = 4) buffer F32Ptr { float v[]; };
layout(buffer_reference, scalar, buffer_reference_align = 8) buffer I64Ptr { int64_t v[]; };
layout(buffer_reference, scalar, buffer_reference_align = 8) buffer U64Ptr { uint64_t v[]; };

// The invocation's index over a grid of (gx, gy) workgroups of LOCAL invocations each, as
// hz::vk::groups_1d() splits large 1-D launches.
#define hz_linear_id(LOCAL) \
    ((uint64_t(gl_WorkGroupID.y) * uint64_t(gl_NumWorkGroups.x) + uint64_t(gl_WorkGroupID.x)) * uint64_t(LOCAL) + \
     uint64_t(gl_LocalInvocationID.x))

// IEEE half bits -> float (exact).
float hz_half_to_float(uint h) { return unpackHalf2x16(h & 0xFFFFu).x; }

// float -> IEEE half bits, round to nearest even (as torch and numpy; packHalf2x16's rounding is
// implementation-defined). Overflow gives inf, NaN stays NaN.
uint hz_float_to_half(float f) {
    uint x = floatBitsToUint(f);
    uint sign = (x >> 16) & 0x8000u;
    uint e = (x >> 23) & 0xFFu;
    uint m = x & 0x7FFFFFu;
    if (e == 0xFFu) return sign | 0x7C00u | (m != 0u ? (0x200u | (m >> 13)) : 0u);
    int exp = int(e) - 127 + 15;
    if (exp >= 31) return sign | 0x7C00u;
    if (exp <= 0) {
        if (exp < -10) return sign;          // below half the smallest subnormal: +-0
        m |= 0x800000u;                      // implicit bit
        uint shift = uint(14 - exp);         // 14..24
        uint h = m >> shift;
        uint rem = m & ((1u << shift) - 1u);
        uint half_ = 1u << (shift - 1u);
        if (rem > half_ || (rem == half_ && (h & 1u) != 0u)) h += 1u;
        return sign | h;
    }
    uint h = (uint(exp) << 10) | (m >> 13);
    uint rem = m & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u) != 0u)) h += 1u;  // may carry into inf: correct
    return sign | h;
}

// bfloat16 bits <-> float (to bf16: round to nearest even, NaN -> quiet NaN, as torch).
float hz_bf16_to_float(uint b) { return uintBitsToFloat((b & 0xFFFFu) << 16); }
uint hz_float_to_bf16(float f) {
    if (isnan(f)) return 0x7FC0u;
    uint x = floatBitsToUint(f);
    return (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
}

// dtype codes shared with csrc/vulkan/device.cpp (hz_dtype_code)
#define HZ_DT_F32 0u
#define HZ_DT_F16 1u
#define HZ_DT_BF16 2u
#define HZ_DT_I64 3u
#define HZ_DT_I32 4u
#define HZ_DT_U8 5u
#define HZ_DT_I8 6u
#define HZ_DT_BOOL 7u
#define HZ_DT_I16 8u

#endif  // HZ_COMMON_GLSL
