#version 450
// hanzo::qk_norm_rope: one workgroup per (b, t, head) row of D values, q heads then k heads.
// Optional per-head RMSNorm (weights q_w / k_w), then NEOX RoPE: pairs (i, i + D/2) rotated by
// angle = float(position) * inv_freq[i]. inv_freq (float32 [D/2]) is computed on the host as the
// reference computes it; cos/sin are computed here with an explicit range reduction, so their
// accuracy does not depend on the driver's sin/cos (which Vulkan bounds only on [-pi, pi]).
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

// sin and cos of a float32 angle: x = n * pi/2 + r, with pi/2 in four parts, the first three of
// 8 significant bits, so that n * part is exact (|n| < 2^16, angles below ~1e5) and each
// subtraction exact or as small as r (Cody-Waite; fma is not needed, which the driver may not
// fuse), then minimax polynomials on |r| <= pi/4 (about 1 ulp).
void fz_sincos(float x, out float s, out float c) {
    const float n = roundEven(x * 0.636619772367581343);
    precise float r = x - n * 1.5703125;
    r = r - n * 4.825592041015625e-4;
    r = r - n * 1.2665987014770508e-6;
    r = r - n * 9.92093629470503e-10;
    const float z = r * r;
    const float sp = r + r * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4));
    const float cp = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (-1.388731625493765e-3 + z * 2.443315711809948e-5));
    const int q = int(n) & 3;
    s = q == 0 ? sp : q == 1 ? cp : q == 2 ? -sp : -cp;
    c = q == 0 ? cp : q == 1 ? -sp : q == 2 ? -cp : sp;
}

void main() {
    const uint row = fz_group_index();
    const uint H = p.Hq + p.Hk;
    if (row >= p.BT * H) return;
    const uint tid = gl_LocalInvocationID.x, D = p.D, half_d = D / 2u;
    const uint bt = row / H, h = row % H;
    const bool is_q = h < p.Hq;
    const uint64_t off = uint64_t(is_q ? bt * p.Hq + h : bt * p.Hk + (h - p.Hq)) * D * fz_elem_bytes(p.dt);
    const uint64_t src = (is_q ? p.q : p.k) + off, dst = (is_q ? p.qo : p.ko) + off;
    const uint64_t w = is_q ? p.qw : p.kw;
    float inv = 1.0;
    if (p.norm != 0u) {
        float acc = 0.0;
        for (uint i = tid; i < D; i += FZ_WG) {
            const float v = fz_load(src, p.dt, i);
            acc += v * v;
        }
        red[tid] = acc;
        barrier();
        for (uint k = FZ_WG / 2u; k > 0u; k >>= 1) {
            if (tid < k) red[tid] += red[tid + k];
            barrier();
        }
        inv = 1.0 / sqrt(red[0] / float(D) + p.eps);
    }
    const float position = float(fz_position(p.pos, p.pos32, bt));
    for (uint i = tid; i < half_d; i += FZ_WG) {
        float x1 = fz_load(src, p.dt, i), x2 = fz_load(src, p.dt, i + half_d);
        if (p.norm != 0u) {
            x1 = (x1 * inv) * fz_load(w, p.dt_w, i);
            x2 = (x2 * inv) * fz_load(w, p.dt_w, i + half_d);
        }
        // rounded to float32 as the reference's angle (no fusing into the range reduction's fma)
        precise float angle = position * F32Ptr(p.inv_freq).v[i];
        float s, c;
        fz_sincos(angle, s, c);
        fz_store(dst, p.dt, i, x1 * c - x2 * s);
        fz_store(dst, p.dt, i + half_d, x2 * c + x1 * s);
    }
}
