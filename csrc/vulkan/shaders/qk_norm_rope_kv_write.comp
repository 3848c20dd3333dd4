#version 450
// hanzo::qk_norm_rope_kv_write: qk_norm_rope.comp and kv_cache_write.comp in one dispatch. One
// workgroup per (b, t, head) row of D values, q heads then k heads:
//   q head: normalized and rotated into qo, as qk_norm_rope;
//   k head h: its row normalized, rotated and rounded to the activation dtype (what qk_norm_rope
//     stores) into shared memory, then written to k_cache[b, positions[b, t], h] in the cache's
//     type (kv_write.glsl for q8_0); then v[b, t, h] to v_cache the same way (a raw copy when v
//     has the cache's dtype).
// The same bits as the two dispatches. A position outside [0, S) writes no cache row (q is
// still rotated). D <= FZ_MAX_D (ops_fused.cpp runs the two shaders for longer rows).
#include "fused.glsl"
#define FZ_WG 64u
#define FZ_MAX_D 1024u
layout(local_size_x = 64) in;

layout(push_constant) uniform Push {
    uint64_t q, k, v, qo, kc, vc, qw, kw, pos, inv_freq;
    uint BT, T, S, Hq, Hk, D;
    uint dt, dt_w, dt_c, pos32, norm;  // dt: q, k, v, qo; dt_w: weights; dt_c: caches (FZ_Q8_0 too)
    float eps;
} p;

shared float red[FZ_WG];
shared float row_f[FZ_MAX_D];  // the row being written to a cache, float32

#include "rope.glsl"
#include "kv_write.glsl"

// row_f (D values) to the cache row at dst; every invocation calls it.
void store_cache_row(uint64_t dst, uint D) {
    const uint tid = gl_LocalInvocationID.x;
    barrier();  // row_f complete
    if (p.dt_c == FZ_Q8_0) {
        for (uint blk = tid; blk < D / HZ_Q8_0_BLOCK; blk += FZ_WG) {
            float x[32];
            for (uint j = 0u; j < 32u; ++j) x[j] = row_f[blk * 32u + j];
            fz_store_q8_0_block(dst, blk, x);
        }
    } else {
        for (uint i = tid; i < D; i += FZ_WG) fz_store(dst, p.dt_c, i, row_f[i]);
    }
    barrier();  // row_f free again
}

void main() {
    const uint row = fz_group_index();
    const uint H = p.Hq + p.Hk;
    if (row >= p.BT * H) return;
    const uint tid = gl_LocalInvocationID.x, D = p.D, half_d = D / 2u;
    const uint bt = row / H, h = row % H;
    const bool is_q = h < p.Hq;
    const uint hk = h - p.Hq;
    const uint64_t off = uint64_t(is_q ? bt * p.Hq + h : bt * p.Hk + hk) * D * fz_elem_bytes(p.dt);
    const uint64_t src = (is_q ? p.q : p.k) + off;
    const bool norm = p.norm != 0u;
    float inv = 1.0;
    if (norm) inv = fz_row_inv_rms(src, p.dt, D, p.eps);
    const int64_t pos = fz_position(p.pos, p.pos32, bt);
    const float position = float(pos);
    if (is_q) {
        for (uint i = tid; i < half_d; i += FZ_WG) {
            const vec2 r = fz_rope_pair(src, p.dt, norm, inv, p.qw, p.dt_w, position, p.inv_freq, i, half_d);
            fz_store(p.qo + off, p.dt, i, r.x);
            fz_store(p.qo + off, p.dt, i + half_d, r.y);
        }
        return;
    }
    if (pos < 0 || pos >= int64_t(p.S)) return;
    for (uint i = tid; i < half_d; i += FZ_WG) {
        const vec2 r = fz_rope_pair(src, p.dt, norm, inv, p.kw, p.dt_w, position, p.inv_freq, i, half_d);
        row_f[i] = fz_round(p.dt, r.x);
        row_f[i + half_d] = fz_round(p.dt, r.y);
    }
    const uint64_t dst_off = ((uint64_t(bt / p.T) * p.S + uint64_t(pos)) * p.Hk + hk) * fz_row_bytes(p.dt_c, D);
    store_cache_row(p.kc + dst_off, D);
    const uint64_t v_src = p.v + off, v_dst = p.vc + dst_off;
    if (p.dt_c == p.dt) {  // same dtype: the bits as they are
        if (p.dt == FZ_F32) {
            for (uint i = tid; i < D; i += FZ_WG) U32Ptr(v_dst).v[i] = U32Ptr(v_src).v[i];
        } else {
            for (uint i = tid; i < D; i += FZ_WG) U16Ptr(v_dst).v[i] = U16Ptr(v_src).v[i];
        }
    } else {
        for (uint i = tid; i < D; i += FZ_WG) row_f[i] = fz_load(v_src, p.dt, i);
        store_cache_row(v_dst, D);
    }
}
