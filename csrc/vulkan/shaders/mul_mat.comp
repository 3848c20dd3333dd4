// hz: per-format
// mul_mat for many activation rows (prefill): y[m, n] = sum_k x[m, k] * W[n, k], a 2-D tiled GEMM.
// A workgroup computes a 64 x 64 tile of y (rows m0.., columns n0..: gl_WorkGroupID.y, .x); per
// step of 16 along K it stages both operands in shared memory, the weight tile dequantized once
// (never the whole weight) and the activation tile converted to float32, then each of the 64
// invocations accumulates an 8 x 8 block of outputs in float32 registers (16 shared-memory loads
// per 64 multiply-adds: on a CPU driver such as llvmpipe a load costs far more than arithmetic).
#version 460
#include "formats.glsl"

#define BM 64u
#define BN 64u
#define BK 16u

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

shared float xs[BK][BM + 1u];
shared float ws[BK][BN + 1u];

void main() {
    hz_table = pc.table;
    uint lid = gl_LocalInvocationID.x;
    uint tx = lid % 8u, ty = lid / 8u;
    uint n0 = gl_WorkGroupID.x * BN, m0 = gl_WorkGroupID.y * BM;
    float acc[8][8];
    for (uint i = 0u; i < 8u; ++i)
        for (uint j = 0u; j < 8u; ++j) acc[i][j] = 0.0;
    for (uint k0 = 0u; k0 < pc.K; k0 += BK) {
        if (HZ_QK % 8u == 0u) {
            // the weight tile as 128 runs of 8 values of one block (block address and scales once
            // per run; K is a multiple of the block size, so a run is whole or wholly past K)
            for (uint h = 0u; h < 2u; ++h) {
                uint l = lid + 64u * h;
                uint r = l / 2u, kk0 = (l % 2u) * 8u, n = n0 + r, k = k0 + kk0;
                if (n < pc.N && k < pc.K) {
                    uint64_t blk = pc.w + uint64_t(n) * pc.row_bytes + uint64_t(k / HZ_QK) * HZ_TS;
                    uint j0 = k % HZ_QK;
                    for (uint i = 0u; i < 8u; ++i) ws[kk0 + i][r] = hz_elem(blk, j0 + i);
                } else {
                    for (uint i = 0u; i < 8u; ++i) ws[kk0 + i][r] = 0.0;
                }
            }
        } else {
            for (uint q = 0u; q < 16u; ++q) {  // dense formats: 64 x 16 values, 16 per invocation
                uint l = lid + 64u * q;
                uint r = l / BK, kk = l % BK, k = k0 + kk, n = n0 + r;
                ws[kk][r] = (n < pc.N && k < pc.K) ? hz_value_at(pc.w + uint64_t(n) * pc.row_bytes, k) : 0.0;
            }
        }
        for (uint q = 0u; q < 16u; ++q) {  // the activation tile, 64 x 16 values, 16 per invocation
            uint l = lid + 64u * q;
            uint r = l / BK, kk = l % BK, k = k0 + kk, m = m0 + r;
            xs[kk][r] = (m < pc.M && k < pc.K) ? hz_load(pc.x, pc.x_dtype, uint64_t(m) * pc.x_stride + k) : 0.0;
        }
        barrier();
        for (uint kk = 0u; kk < BK; ++kk) {
            float a[8], b[8];
            for (uint i = 0u; i < 8u; ++i) a[i] = xs[kk][ty + 8u * i];
            for (uint j = 0u; j < 8u; ++j) b[j] = ws[kk][tx + 8u * j];
            for (uint i = 0u; i < 8u; ++i)
                for (uint j = 0u; j < 8u; ++j) acc[i][j] += a[i] * b[j];
        }
        barrier();
    }
    for (uint i = 0u; i < 8u; ++i) {
        uint m = m0 + ty + 8u * i;
        if (m >= pc.M) continue;
        for (uint j = 0u; j < 8u; ++j) {
            uint n = n0 + tx + 8u * j;
            if (n < pc.N) hz_store(pc.y, pc.y_dtype, uint64_t(m) * pc.y_stride + n, acc[i][j]);
        }
    }
}
