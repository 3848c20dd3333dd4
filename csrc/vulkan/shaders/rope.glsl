// q/k-norm + NEOX RoPE of one head row of D values, shared by qk_norm_rope.comp and
// qk_norm_rope_kv_write.comp so that both give the same bits. The includer defines FZ_WG (the
// workgroup size) and declares `shared float red[FZ_WG]`; every invocation of the workgroup calls
// fz_row_inv_rms (it has barriers).
#include "wg_sum.glsl"

// sin and cos of a float32 angle: x = n * pi/2 + r, with pi/2 in four parts, the first three of
// 8 significant bits, so that n * part is exact (|n| < 2^16, angles below ~1e5) and each
// subtraction exact or as small as r (Cody-Waite; fma is not needed, which the driver may not
// fuse), then minimax polynomials on |r| <= pi/4 (about 1 ulp). Computed here, so the accuracy
// does not depend on the driver's sin/cos (which Vulkan bounds only on [-pi, pi]).
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

// 1 / sqrt(mean(x^2) + eps) over the row of D values of dtype dt at src (float32 sums, a tree
// reduction over the workgroup).
float fz_row_inv_rms(uint64_t src, uint dt, uint D, float eps) {
    const uint tid = gl_LocalInvocationID.x;
    float acc = 0.0;
    for (uint i = tid; i < D; i += FZ_WG) {
        const float v = fz_load(src, dt, i);
        acc += v * v;
    }
    return 1.0 / sqrt(fz_workgroup_sum(acc) / float(D) + eps);
}

// Pair (i, i + D/2) of the row at src, normalized (norm: (x * inv) * w, w of dtype dt_w) and
// rotated by angle = position * inv_freq[i] (float32, as the reference rounds it); float32,
// before the rounding to the output dtype.
vec2 fz_rope_pair(uint64_t src, uint dt, bool norm, float inv, uint64_t w, uint dt_w, float position,
                  uint64_t inv_freq, uint i, uint half_d) {
    float x1 = fz_load(src, dt, i), x2 = fz_load(src, dt, i + half_d);
    if (norm) {
        x1 = (x1 * inv) * fz_load(w, dt_w, i);
        x2 = (x2 * inv) * fz_load(w, dt_w, i + half_d);
    }
    // rounded to float32 as the reference's angle (no fusing into the range reduction's fma)
    precise float angle = position * F32Ptr(inv_freq).v[i];
    float s, c;
    fz_sincos(angle, s, c);
    return vec2(x1 * c - x2 * s, x2 * c + x1 * s);
}
