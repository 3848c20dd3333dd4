// Shared code of the fused-op shaders (rms_norm, add_rms_norm, qk_norm_rope, swiglu, kv_cache_write,
// attention, moe_route): element loads and stores by a run-time dtype code, and float32 <-> float16/bfloat16 conversions that round to nearest
// even in integer arithmetic (bit-identical to torch's Tensor.to on every device, whatever the
// driver's own conversion or float16 arithmetic support; only 16-bit storage is needed).
//
// dtype codes (ops_fused.cpp passes them in push constants):
//   FZ_F32 = 0, FZ_F16 = 1, FZ_BF16 = 2 (activations and caches), FZ_Q8_0 = 3 (caches only:
//   rows of ggml block_q8_0, 34 bytes per 32 values: an f16 scale d, then 32 int8 codes q).
#include "common.glsl"  // extensions and the pointer types (U8Ptr, F32Ptr, ...)

#define FZ_F32 0u
#define FZ_F16 1u
#define FZ_BF16 2u
#define FZ_Q8_0 3u

#define FZ_NEG_INF uintBitsToFloat(0xff800000u)

uint fz_elem_bytes(uint dt) { return dt == FZ_F32 ? 4u : 2u; }

float fz_half_to_float(uint h) {
    const uint s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0u) {  // zero or subnormal: m * 2^-24, exact in float32
        const float f = float(m) * 5.9604644775390625e-8;
        return s != 0u ? -f : f;
    }
    if (e == 31u) return uintBitsToFloat(s | 0x7f800000u | (m << 13));
    return uintBitsToFloat(s | ((e + 112u) << 23) | (m << 13));
}

// float32 -> float16 bits, round to nearest even; overflow to inf, NaN to 0x7e00 (with the sign), as c10::Half.
uint fz_float_to_half(float f) {
    const uint x = floatBitsToUint(f), s = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return s | 0x7e00u;
    if (a >= 0x477ff000u) return s | 0x7c00u;  // >= 65520 (halfway past 65504) and inf
    if (a < 0x38800000u) {  // below 2^-14: a subnormal half (1024 rounds up to the smallest normal)
        return s | uint(roundEven(uintBitsToFloat(a) * 16777216.0));
    }
    return s | ((a + 0xc8000000u + 0xfffu + ((a >> 13) & 1u)) >> 13);  // rebias 127 -> 15, round
}

float fz_bf16_to_float(uint h) { return uintBitsToFloat(h << 16); }

// float32 -> bfloat16 bits, round to nearest even; NaN to 0x7fc0, as c10::BFloat16.
uint fz_float_to_bf16(float f) {
    const uint u = floatBitsToUint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// Element i of a float tensor of dtype dt (f32/f16/bf16) at address base.
float fz_load(uint64_t base, uint dt, uint i) {
    if (dt == FZ_F32) return F32Ptr(base).v[i];
    const uint h = uint(U16Ptr(base).v[i]);
    return dt == FZ_F16 ? fz_half_to_float(h) : fz_bf16_to_float(h);
}

void fz_store(uint64_t base, uint dt, uint i, float v) {
    if (dt == FZ_F32) {
        F32Ptr(base).v[i] = v;
    } else {
        U16Ptr(base).v[i] = uint16_t(dt == FZ_F16 ? fz_float_to_half(v) : fz_float_to_bf16(v));
    }
}

// v rounded to dtype dt and back (what storing and reloading it gives).
float fz_round(uint dt, float v) {
    if (dt == FZ_F16) return fz_half_to_float(fz_float_to_half(v));
    if (dt == FZ_BF16) return fz_bf16_to_float(fz_float_to_bf16(v));
    return v;
}

// Bytes of one cache row of D values of dtype dt (q8_0: D/32 blocks of 34 bytes).
uint fz_row_bytes(uint dt, uint D) { return dt == FZ_Q8_0 ? HZ_Q8_0_ROW_BYTES(D) : D * fz_elem_bytes(dt); }

// Value d of one cache row at address row (q8_0: scale * code, float32 as ggml dequantizes).
float fz_load_cache(uint64_t row, uint dt, uint d) {
    if (dt != FZ_Q8_0) return fz_load(row, dt, d);
    const uint blk = d >> 5;
    const float scale = fz_half_to_float(uint(U16Ptr(row).v[blk * (HZ_Q8_0_BYTES / 2u)]));
    return float(int(I8Ptr(row).v[blk * HZ_Q8_0_BYTES + 2u + (d & 31u)])) * scale;
}

// Position of query row i: int64 (pos32 == 0) or int32 positions.
int64_t fz_position(uint64_t pos, uint pos32, uint i) {
    return pos32 != 0u ? int64_t(I32Ptr(pos).v[i]) : I64Ptr(pos).v[i];
}

// Flat index of this workgroup in a grid of (x, y) workgroups laid out as ops_fused.cpp splits
// large counts (x <= 65535).
uint fz_group_index() { return gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x; }
