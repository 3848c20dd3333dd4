// hz: variants @int8 (the formats of hanzo_torch/backends/vulkan/rules.py INT8_RULES)
// mul_mat for few activation rows (decode) through int8 dot products: y[m, n] = sum_k x[m, k] W[n, k]
// with x given as q8_1 blocks (quantize_q8_1.comp) and W's integer codes (formats_q8.glsl), m < M <= HZ_MV_MAX_M.
// One workgroup per output row n (n = gl_WorkGroupID.x + gl_NumWorkGroups.x * gl_WorkGroupID.y): each
// invocation takes whole 32-value blocks of the row, packs the weight codes of a block once for all
// M activation rows, dots them with the q8_1 codes (exact int32) and scales per group; float32
// accumulation, reduced through shared memory.
#version 460
#include "formats_q8.glsl"

#define HZ_MV_MAX_M HZ_VK_MATVEC_MAX_ROWS  // hz_constants.glsl
#define HZ_MV_THREADS 64u

layout(local_size_x = 64) in;

layout(push_constant, std430) uniform Push {
    uint64_t w;       // packed [N, row_bytes]
    uint64_t x;       // q8_1 blocks [M, K / 32 * 36], rows x_stride bytes apart, 4-byte aligned
    uint64_t y;       // [M, N] of y_dtype, rows y_stride elements apart
    uint64_t table;   // unused (the layout of mul_mat_vec.comp)
    uint N;
    uint K;
    uint M;
    uint row_bytes;
    uint x_stride;
    uint y_stride;
    uint x_dtype;     // unused
    uint y_dtype;
} pc;

shared float red[HZ_MV_MAX_M][HZ_MV_THREADS];

void main() {
    uint n = gl_WorkGroupID.x + gl_NumWorkGroups.x * gl_WorkGroupID.y;
    uint t = gl_LocalInvocationID.x;
    if (n >= pc.N) return;  // uniform over the workgroup
    float acc[HZ_MV_MAX_M];
    for (uint m = 0u; m < HZ_MV_MAX_M; ++m) acc[m] = 0.0;
    uint64_t row = pc.w + uint64_t(n) * pc.row_bytes;
    for (uint kb = t; kb < pc.K / 32u; kb += HZ_MV_THREADS) {
        uint k0 = kb * 32u;
        uint64_t blk = row + uint64_t(k0 / HZ_QK) * HZ_TS;
        uint j0 = k0 % HZ_QK;
        uint wq[8];
        for (uint i = 0u; i < 8u; ++i) wq[i] = hz_q8_word(blk, j0 + 4u * i);
        vec2 ab[HZ_Q8_NG];
        for (uint g = 0u; g < HZ_Q8_NG; ++g) ab[g] = hz_q8_ab(blk, j0 / HZ_Q8_GROUP + g);
        for (uint m = 0u; m < pc.M; ++m) {
            U32Ptr xb = U32Ptr(pc.x + uint64_t(m) * pc.x_stride + uint64_t(kb) * 36ul);
            float dx = hz_half_to_float(xb.v[0]);
            float part = 0.0;
            for (uint g = 0u; g < HZ_Q8_NG; ++g) {
                int si = 0, sx = 0;
                for (uint i = g * (8u / HZ_Q8_NG); i < (g + 1u) * (8u / HZ_Q8_NG); ++i) {
                    uint xw = xb.v[1u + i];
                    si += hz_dot4(wq[i], xw);
#if defined(HZ_Q8_HAS_B)
                    sx += hz_dot4(0x01010101u, xw);
#endif
                }
                part += ab[g].x * float(si) + ab[g].y * float(sx);
            }
            acc[m] += dx * part;
        }
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
