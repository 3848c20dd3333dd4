#version 450
// hanzo::kv_cache_write: k_cache[b, positions[b, t], h] = k[b, t, h] (and v), one workgroup per
// (b, t, h) row of D values. Contiguous caches [B, S, Hk, D] of f32/f16/bf16 (rounded to nearest
// even; a raw copy when k has the cache's dtype) or q8_0 rows (ggml's quantize_row_q8_0_ref: per
// block of 32, d = amax / 127 stored as f16, q = roundf(x / d) clipped to [-128, 127]: kv_write.glsl).
// A position outside [0, S) writes nothing (checking it would need a host sync).
#include "fused.glsl"
#define FZ_WG 64u
layout(local_size_x = 64) in;

layout(push_constant) uniform Push {
    uint64_t kc, vc, k, v, pos;
    uint BT, T, S, Hk, D;
    uint dt, dt_c, pos32;
} p;

#include "kv_write.glsl"

void quantize_block(uint64_t src, uint64_t dst, uint blk) {
    float x[32];
    for (uint j = 0u; j < 32u; ++j) x[j] = fz_load(src, p.dt, blk * 32u + j);
    fz_store_q8_0_block(dst, blk, x);
}

void main() {
    const uint row = fz_group_index();
    if (row >= p.BT * p.Hk) return;
    const uint bt = row / p.Hk, h = row % p.Hk, b = bt / p.T, D = p.D, tid = gl_LocalInvocationID.x;
    const int64_t pos = fz_position(p.pos, p.pos32, bt);
    if (pos < 0 || pos >= int64_t(p.S)) return;
    const uint64_t src_off = uint64_t(row) * D * fz_elem_bytes(p.dt);
    const uint rb = fz_row_bytes(p.dt_c, D);
    const uint64_t dst_off = ((uint64_t(b) * p.S + uint64_t(pos)) * p.Hk + h) * rb;
    for (uint which = 0u; which < 2u; ++which) {
        const uint64_t src = (which == 0u ? p.k : p.v) + src_off, dst = (which == 0u ? p.kc : p.vc) + dst_off;
        if (p.dt_c == FZ_Q8_0) {
            for (uint blk = tid; blk < D / HZ_Q8_0_BLOCK; blk += FZ_WG) quantize_block(src, dst, blk);
        } else if (p.dt_c == p.dt) {  // same dtype: the bits as they are
            if (p.dt == FZ_F32) {
                for (uint i = tid; i < D; i += FZ_WG) U32Ptr(dst).v[i] = U32Ptr(src).v[i];
            } else {
                for (uint i = tid; i < D; i += FZ_WG) U16Ptr(dst).v[i] = U16Ptr(src).v[i];
            }
        } else {
            for (uint i = tid; i < D; i += FZ_WG) fz_store(dst, p.dt_c, i, fz_load(src, p.dt, i));
        }
    }
}
