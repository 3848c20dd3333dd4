#version 450
// hanzo::qk_norm_rope: one workgroup per (b, t, head) row of D values, q heads then k heads.
// Optional per-head RMSNorm (weights q_w / k_w), then NEOX RoPE: pairs (i, i + D/2) rotated by
// angle = float(position) * inv_freq[i]. inv_freq (float32 [D/2]) is computed on the host as the
// reference computes it; cos/sin are computed with an explicit range reduction (rope.glsl).
#include "fused.glsl"
#define FZ_WG 64u
layout(local_size_x = 64) in;

layout(push_constant) uniform Push {
    uint64_t q, k, qo, ko, qw, kw, pos, inv_freq;
    uint BT, Hq, Hk, D;
    uint dt, dt_w, pos32, norm;  // norm: weights given
    float eps;
} p;

shared float red[FZ_WG];

#include "rope.glsl"

void main() {
    const uint row = fz_group_index();
    const uint H = p.Hq + p.Hk;
    if (row >= p.BT * H) return;
    const uint tid = gl_LocalInvocationID.x, D = p.D, half_d = D / 2u;
    const uint bt = row / H, h = row % H;
    const bool is_q = h < p.Hq;
    const uint64_t off = uint64_t(is_q ? bt * p.Hq + h : bt * p.Hk + (h - p.Hq)) * D * fz_elem_bytes(p.dt);
    const uint64_t src = (is_q ? p.q : p.k) + off, dst = (is_q ? p.qo : p.ko) + off;
    const bool norm = p.norm != 0u;
    float inv = 1.0;
    if (norm) inv = fz_row_inv_rms(src, p.dt, D, p.eps);
    const float position = float(fz_position(p.pos, p.pos32, bt));
    for (uint i = tid; i < half_d; i += FZ_WG) {
        const vec2 r = fz_rope_pair(src, p.dt, norm, inv, is_q ? p.qw : p.kw, p.dt_w, position, p.inv_freq, i, half_d);
        fz_store(dst, p.dt, i, r.x);
        fz_store(dst, p.dt, i + half_d, r.y);
    }
}
