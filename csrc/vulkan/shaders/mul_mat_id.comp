// hz: per-format
// mul_mat_id (MoE): y[p, n] = sum_k x[row(p), k] * W[ids[p], n, k] for each (token, slot) pair
// p = t * n_slots + j, row(p) = t when x holds one row per token (x_per_slot = 0), else p.
// One workgroup per (n, p): n = gl_WorkGroupID.x + gl_NumWorkGroups.x * gl_WorkGroupID.y,
// p = p0 + gl_WorkGroupID.z. An expert id outside [0, E) gives NaN and reads no weight.
#version 460
#include "formats.glsl"

#define HZ_THREADS 64u

layout(local_size_x = 64) in;

layout(push_constant, std430) uniform Push {
    uint64_t w;       // packed [E, N, row_bytes]
    uint64_t x;       // [T, K] or [T, n_slots, K] of x_dtype, contiguous
    uint64_t y;       // [T, n_slots, N] of y_dtype, contiguous
    uint64_t ids;     // [T, n_slots] int32 or int64, contiguous
    uint64_t table;   // the format's grid (formats.glsl hz_table) or 0
    uint N;
    uint K;
    uint E;
    uint row_bytes;
    uint n_pairs;     // T * n_slots
    uint n_slots;
    uint p0;
    uint x_per_slot;
    uint x_dtype;
    uint y_dtype;
    uint ids_int64;
} pc;

shared float red[HZ_THREADS];

void main() {
    hz_table = pc.table;
    uint n = gl_WorkGroupID.x + gl_NumWorkGroups.x * gl_WorkGroupID.y;
    uint p = pc.p0 + gl_WorkGroupID.z;
    uint t = gl_LocalInvocationID.x;
    if (n >= pc.N || p >= pc.n_pairs) return;  // uniform over the workgroup
    int64_t e = pc.ids_int64 != 0u ? int64_t(U32Ptr(pc.ids + uint64_t(p) * 8ul).v[0]) |
                                         (int64_t(U32Ptr(pc.ids + uint64_t(p) * 8ul + 4ul).v[0]) << 32)
                                   : int64_t(int(U32Ptr(pc.ids + uint64_t(p) * 4ul).v[0]));
    if (e < 0l || e >= int64_t(pc.E)) {
        if (t == 0u) hz_store(pc.y, pc.y_dtype, uint64_t(p) * pc.N + n, uintBitsToFloat(0x7FC00000u));
        return;
    }
    uint64_t row = pc.w + (uint64_t(e) * pc.N + n) * pc.row_bytes;
    uint64_t xr = uint64_t(pc.x_per_slot != 0u ? p : p / pc.n_slots) * pc.K;
    float acc = 0.0;
    uint k8 = HZ_QK % 8u == 0u ? pc.K : 0u;  // runs of 8 values of one block, as mul_mat_vec.comp
    for (uint k0 = 8u * t; k0 < k8; k0 += 8u * HZ_THREADS) {
        uint64_t blk = row + uint64_t(k0 / HZ_QK) * HZ_TS;
        uint j0 = k0 % HZ_QK;
        for (uint i = 0u; i < 8u; ++i) acc += hz_elem(blk, j0 + i) * hz_load(pc.x, pc.x_dtype, xr + k0 + i);
    }
    for (uint k = k8 + t; k < pc.K; k += HZ_THREADS) acc += hz_value_at(row, k) * hz_load(pc.x, pc.x_dtype, xr + k);
    red[t] = acc;
    barrier();
    for (uint s = HZ_THREADS / 2u; s > 0u; s >>= 1) {
        if (t < s) red[t] += red[t + s];
        barrier();
    }
    if (t == 0u) hz_store(pc.y, pc.y_dtype, uint64_t(p) * pc.N + n, red[0]);
}
