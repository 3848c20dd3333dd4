// hz: per-format
// swiglu_mul_mat for few activation rows (decode) when gate and up share a format, in one
// dispatch: y[m, n] = silu(g) * u with g = sum_k x[m, k] * Wg[n, k] and u = sum_k x[m, k] * Wu[n, k],
// m < M <= HZ_MV_MAX_M. One workgroup per output column n computes both weight rows exactly as
// mul_mat_vec.comp computes one (same runs of 8 values, same float32 accumulation order, same
// reduction tree), then the epilogue of swiglu_mul_mat.comp (g and u rounded to round_dtype, then
// silu(g) * u in float32): the bits of the three-dispatch path.
#version 460
#include "formats.glsl"

#define HZ_MV_MAX_M HZ_VK_MATVEC_MAX_ROWS  // hz_constants.glsl
#define HZ_MV_THREADS 64u

layout(local_size_x = 64) in;

layout(push_constant, std430) uniform Push {
    uint64_t wg;      // packed [N, row_bytes], gate
    uint64_t wu;      // packed [N, row_bytes], up (the same format)
    uint64_t x;       // [M, K] of x_dtype, rows x_stride elements apart
    uint64_t y;       // [M, N] of y_dtype, rows y_stride elements apart
    uint64_t table;   // the format's grid (formats.glsl hz_table) or 0
    uint N;
    uint K;
    uint M;
    uint row_bytes;
    uint x_stride;
    uint y_stride;
    uint x_dtype;     // HZ_DT_*
    uint y_dtype;
    uint round_dtype; // g and u are rounded to it before the epilogue (HZ_DT_F32: kept)
} pc;

shared float red_g[HZ_MV_MAX_M][HZ_MV_THREADS];
shared float red_u[HZ_MV_MAX_M][HZ_MV_THREADS];

float round_to(float v, uint dt) {
    if (dt == HZ_DT_F16) return hz_f16_bits(hz_f16_rne(v));
    if (dt == HZ_DT_BF16) return uintBitsToFloat(hz_bf16_rne(v) << 16);
    return v;
}

void main() {
    hz_table = pc.table;
    uint n = gl_WorkGroupID.x + gl_NumWorkGroups.x * gl_WorkGroupID.y;
    uint t = gl_LocalInvocationID.x;
    if (n >= pc.N) return;  // uniform over the workgroup
    float acc_g[HZ_MV_MAX_M], acc_u[HZ_MV_MAX_M];
    for (uint m = 0u; m < HZ_MV_MAX_M; ++m) {
        acc_g[m] = 0.0;
        acc_u[m] = 0.0;
    }
    uint64_t row_g = pc.wg + uint64_t(n) * pc.row_bytes, row_u = pc.wu + uint64_t(n) * pc.row_bytes;
    uint k8 = HZ_QK % 8u == 0u ? pc.K : 0u;
    for (uint k0 = 8u * t; k0 < k8; k0 += 8u * HZ_MV_THREADS) {
        uint64_t boff = uint64_t(k0 / HZ_QK) * HZ_TS;
        uint j0 = k0 % HZ_QK;
        float wgv[8], wuv[8];
        for (uint i = 0u; i < 8u; ++i) wgv[i] = hz_elem(row_g + boff, j0 + i);
        for (uint i = 0u; i < 8u; ++i) wuv[i] = hz_elem(row_u + boff, j0 + i);
        for (uint m = 0u; m < pc.M; ++m) {
            uint64_t xo = uint64_t(m) * pc.x_stride + k0;
            for (uint i = 0u; i < 8u; ++i) {
                float xv = hz_load(pc.x, pc.x_dtype, xo + i);
                acc_g[m] += wgv[i] * xv;
                acc_u[m] += wuv[i] * xv;
            }
        }
    }
    for (uint k = k8 + t; k < pc.K; k += HZ_MV_THREADS) {  // dense formats (one value per block)
        float wgv = hz_value_at(row_g, k), wuv = hz_value_at(row_u, k);
        for (uint m = 0u; m < pc.M; ++m) {
            float xv = hz_load(pc.x, pc.x_dtype, uint64_t(m) * pc.x_stride + k);
            acc_g[m] += wgv * xv;
            acc_u[m] += wuv * xv;
        }
    }
    for (uint m = 0u; m < pc.M; ++m) {
        red_g[m][t] = acc_g[m];
        red_u[m][t] = acc_u[m];
    }
    barrier();
    for (uint s = HZ_MV_THREADS / 2u; s > 0u; s >>= 1) {
        if (t < s)
            for (uint m = 0u; m < pc.M; ++m) {
                red_g[m][t] += red_g[m][t + s];
                red_u[m][t] += red_u[m][t + s];
            }
        barrier();
    }
    if (t < pc.M) {
        float a = round_to(red_g[t][0], pc.round_dtype);
        float b = round_to(red_u[t][0], pc.round_dtype);
        hz_store(pc.y, pc.y_dtype, uint64_t(t) * pc.y_stride + n, a / (1.0 + exp(-a)) * b);
    }
}
