// hz: per-format
// mul_mat for few activation rows (decode): y[m, n] = sum_k x[m, k] * W[n, k], m < M <= HZ_MV_MAX_M.
// One workgroup per output row n (n = gl_WorkGroupID.x + gl_NumWorkGroups.x * gl_WorkGroupID.y):
// its invocations stride over the row in runs of 8 values, dequantize each weight value once for
// all M activation rows, accumulate in float32 and reduce through shared memory.
#version 460
#include "formats.glsl"

#define HZ_MV_MAX_M HZ_VK_MATVEC_MAX_ROWS  // hz_constants.glsl
#define HZ_MV_THREADS 64u

layout(local_size_x = 64) in;

layout(push_constant, std430) uniform Push {
    uint64_t w;       // packed [N, row_bytes]
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
} pc;

shared float red[HZ_MV_MAX_M][HZ_MV_THREADS];

void main() {
    hz_table = pc.table;
    uint n = gl_WorkGroupID.x + gl_NumWorkGroups.x * gl_WorkGroupID.y;
    uint t = gl_LocalInvocationID.x;
    if (n >= pc.N) return;  // uniform over the workgroup
    float acc[HZ_MV_MAX_M];
    for (uint m = 0u; m < HZ_MV_MAX_M; ++m) acc[m] = 0.0;
    uint64_t row = pc.w + uint64_t(n) * pc.row_bytes;
    // runs of 8 values of one block per invocation (the block address and its scales once per run;
    // every format's block holds a whole number of runs), neighbouring invocations on neighbouring runs
    uint k8 = HZ_QK % 8u == 0u ? pc.K : 0u;
    for (uint k0 = 8u * t; k0 < k8; k0 += 8u * HZ_MV_THREADS) {
        uint64_t blk = row + uint64_t(k0 / HZ_QK) * HZ_TS;
        uint j0 = k0 % HZ_QK;
        float wv[8];
        for (uint i = 0u; i < 8u; ++i) wv[i] = hz_elem(blk, j0 + i);
        for (uint m = 0u; m < pc.M; ++m) {
            uint64_t xo = uint64_t(m) * pc.x_stride + k0;
            for (uint i = 0u; i < 8u; ++i) acc[m] += wv[i] * hz_load(pc.x, pc.x_dtype, xo + i);
        }
    }
    for (uint k = k8 + t; k < pc.K; k += HZ_MV_THREADS) {  // dense formats (one value per block)
        float wv = hz_value_at(row, k);
        for (uint m = 0u; m < pc.M; ++m)
            acc[m] += wv * hz_load(pc.x, pc.x_dtype, uint64_t(m) * pc.x_stride + k);
    }
    for (uint m = 0u; m < pc.M; ++m) red[m][t] = acc[m];
    barrier();
    for (uint s = HZ_MV_THREADS / 2u; s > 0u; s >>= 1) {
        if (t < s)
            for (uint m = 0u; m < pc.M; ++m) red[m][t] += red[m][t + s];
        barrier();
    }
    if (t < pc.M) hz_store(pc.y, pc.y_dtype, uint64_t(t) * pc.y_stride + n, red[t][0]);
}
