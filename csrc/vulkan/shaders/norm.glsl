// Body of rms_norm.comp and add_rms_norm.comp (FZ_ADD): one workgroup per row of H values.
// rms_norm:     y = x * rsqrt(mean(x^2) + eps) * w
// add_rms_norm: s = round(x + r) to the activation dtype (stored), y = rms_norm(s)
// Statistics in float32, one rounding of y to the activation dtype; as hanzo_torch/ops/fused.py.
#define FZ_WG 128u
layout(local_size_x = 128) in;

layout(push_constant) uniform Push {
    uint64_t x, r, w, y, s;  // r and s: add_rms_norm only
    uint rows, H, dt, dt_w;  // dt: x, r, y and s; dt_w: w
    float eps;
} p;

shared float red[FZ_WG];
#include "wg_sum.glsl"

void main() {
    const uint row = fz_group_index();
    if (row >= p.rows) return;
    const uint tid = gl_LocalInvocationID.x, H = p.H;
    const uint64_t off = uint64_t(row) * H * fz_elem_bytes(p.dt);
    const uint64_t x = p.x + off, y = p.y + off;
    float acc = 0.0;
    for (uint i = tid; i < H; i += FZ_WG) {
#ifdef FZ_ADD
        const float v = fz_round(p.dt, fz_load(x, p.dt, i) + fz_load(p.r + off, p.dt, i));
        fz_store(p.s + off, p.dt, i, v);
#else
        const float v = fz_load(x, p.dt, i);
#endif
        acc += v * v;
    }
    const float inv = 1.0 / sqrt(fz_workgroup_sum(acc) / float(H) + p.eps);
    for (uint i = tid; i < H; i += FZ_WG) {
#ifdef FZ_ADD
        // this invocation stored s[i] above
        const float v = fz_load(p.s + off, p.dt, i);
#else
        const float v = fz_load(x, p.dt, i);
#endif
        fz_store(y, p.dt, i, (v * inv) * fz_load(p.w, p.dt_w, i));
    }
}
