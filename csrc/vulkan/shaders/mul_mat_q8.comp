// hz: variants @int8 (the formats of hanzo_torch/backends/vulkan/rules.py INT8_RULES)
// mul_mat for many activation rows (prefill) through int8 dot products: a 2-D tiled GEMM,
// y[m, n] = sum_k x[m, k] W[n, k], x given as q8_1 blocks (quantize_q8_1.comp).
// A workgroup computes a 64 x 64 tile of y (rows m0.., columns n0..: gl_WorkGroupID.y, .x); per
// 32-value step along K it stages both operands in shared memory as packed int8 codes: the 64
// activation rows' q8_1 words and scales, the 64 weight rows' codes (formats_q8.glsl, unpacked
// once per tile, never the whole weight) and group factors. Each of the 256 invocations then
// accumulates a 4 x 4 block of outputs: int32 dot products per group, scaled into float32.
#version 460
#include "formats_q8.glsl"

#define BM 64u
#define BN 64u

layout(local_size_x = 256) in;

layout(push_constant, std430) uniform Push {
    uint64_t w;       // packed [N, row_bytes]
    uint64_t x;       // q8_1 blocks [M, K / 32 * 36], rows x_stride bytes apart, 4-byte aligned
    uint64_t y;       // [M, N] of y_dtype, rows y_stride elements apart
    uint64_t table;   // unused (the layout of mul_mat.comp)
    uint N;
    uint K;
    uint M;
    uint row_bytes;
    uint x_stride;
    uint y_stride;
    uint x_dtype;     // unused
    uint y_dtype;
} pc;

shared uint xq[8][BM];          // activation codes, word i of the block, per row
shared float xd[BM];            // activation scales
shared uint wq[8][BN];          // weight codes
shared vec2 wab[HZ_Q8_NG][BN];  // weight group factors
#if defined(HZ_Q8_HAS_B)
shared int xsum[HZ_Q8_NG][BM];  // sums of the activation codes per group
#endif

void main() {
    uint lid = gl_LocalInvocationID.x;
    uint tx = lid % 16u, ty = lid / 16u;
    uint n0 = gl_WorkGroupID.x * BN, m0 = gl_WorkGroupID.y * BM;
    float acc[4][4];
    for (uint i = 0u; i < 4u; ++i)
        for (uint j = 0u; j < 4u; ++j) acc[i][j] = 0.0;
    for (uint kb = 0u; kb < pc.K / 32u; ++kb) {
        uint k0 = kb * 32u;
        // weights: 64 rows x 8 words, two words (8 values) per invocation
        {
            uint r = lid / 4u, p = lid % 4u, n = n0 + r;
            if (n < pc.N) {
                uint64_t blk = pc.w + uint64_t(n) * pc.row_bytes + uint64_t(k0 / HZ_QK) * HZ_TS;
                uint j0 = k0 % HZ_QK;
                wq[2u * p][r] = hz_q8_word(blk, j0 + 8u * p);
                wq[2u * p + 1u][r] = hz_q8_word(blk, j0 + 8u * p + 4u);
                if (p < HZ_Q8_NG) wab[p][r] = hz_q8_ab(blk, j0 / HZ_Q8_GROUP + p);
            } else {
                wq[2u * p][r] = 0u;
                wq[2u * p + 1u][r] = 0u;
                if (p < HZ_Q8_NG) wab[p][r] = vec2(0.0);
            }
        }
        // activations: 64 rows x 9 words (rows past M read as zeros)
        for (uint l = lid; l < BM * 9u; l += 256u) {
            uint r = l / 9u, i = l % 9u, m = m0 + r;
            uint v = m < pc.M ? U32Ptr(pc.x + uint64_t(m) * pc.x_stride + uint64_t(kb) * 36ul).v[i] : 0u;
            if (i == 0u)
                xd[r] = hz_half_to_float(v);
            else
                xq[i - 1u][r] = v;
        }
        barrier();
#if defined(HZ_Q8_HAS_B)
        if (lid < BM * HZ_Q8_NG) {
            uint r = lid % BM, g = lid / BM;
            int sx = 0;
            for (uint i = g * (8u / HZ_Q8_NG); i < (g + 1u) * (8u / HZ_Q8_NG); ++i)
                sx += hz_dot4(0x01010101u, xq[i][r]);
            xsum[g][r] = sx;
        }
        barrier();
#endif
        float part[4][4];
        for (uint i = 0u; i < 4u; ++i)
            for (uint j = 0u; j < 4u; ++j) part[i][j] = 0.0;
        for (uint g = 0u; g < HZ_Q8_NG; ++g) {
            int si[4][4];
            for (uint i = 0u; i < 4u; ++i)
                for (uint j = 0u; j < 4u; ++j) si[i][j] = 0;
            for (uint w = g * (8u / HZ_Q8_NG); w < (g + 1u) * (8u / HZ_Q8_NG); ++w) {
                uint a[4], b[4];
                for (uint i = 0u; i < 4u; ++i) a[i] = xq[w][ty + 16u * i];
                for (uint j = 0u; j < 4u; ++j) b[j] = wq[w][tx + 16u * j];
                for (uint i = 0u; i < 4u; ++i)
                    for (uint j = 0u; j < 4u; ++j) si[i][j] += hz_dot4(a[i], b[j]);
            }
            for (uint j = 0u; j < 4u; ++j) {
                vec2 ab = wab[g][tx + 16u * j];
                for (uint i = 0u; i < 4u; ++i) {
#if defined(HZ_Q8_HAS_B)
                    part[i][j] += ab.x * float(si[i][j]) + ab.y * float(xsum[g][ty + 16u * i]);
#else
                    part[i][j] += ab.x * float(si[i][j]);
#endif
                }
            }
        }
        for (uint i = 0u; i < 4u; ++i) {
            float dx = xd[ty + 16u * i];
            for (uint j = 0u; j < 4u; ++j) acc[i][j] += dx * part[i][j];
        }
        barrier();
    }
    for (uint i = 0u; i < 4u; ++i) {
        uint m = m0 + ty + 16u * i;
        if (m >= pc.M) continue;
        for (uint j = 0u; j < 4u; ++j) {
            uint n = n0 + tx + 16u * j;
            if (n < pc.N) hz_store(pc.y, pc.y_dtype, uint64_t(m) * pc.y_stride + n, acc[i][j]);
        }
    }
}
