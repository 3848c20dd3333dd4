// hz: per-format
// mul_mat_id (MoE): y[p, n] = sum_k x[row(p), k] * W[ids[p], n, k] for each (token, slot) pair
// p = t * n_slots + j, row(p) = t when x holds one row per token (x_per_slot = 0), else p.
// Per pair (order == 0, few pairs): one workgroup per (n, p): n = gl_WorkGroupID.x +
// gl_NumWorkGroups.x * gl_WorkGroupID.y, p = p0 + gl_WorkGroupID.z.
// Grouped (order != 0, prefill): the pairs sorted by expert (mul_mat_id_sort.comp: order, expert)
// go in chunks of HZ_CHUNK; one workgroup per (n, chunk p0 / HZ_CHUNK + gl_WorkGroupID.z) reads
// each weight value of row n once per expert of its chunk (not once per pair) for all the pairs
// of that expert. Each pair's sum runs in the same order in both modes (same bits).
// An expert id outside [0, E) gives NaN and reads no weight.
#version 460
#include "formats.glsl"

#define HZ_THREADS 64u
#define HZ_CHUNK 8u

layout(local_size_x = 64) in;

layout(push_constant, std430) uniform Push {
    uint64_t w;       // packed [E, N, row_bytes]
    uint64_t x;       // [T, K] or [T, n_slots, K] of x_dtype, contiguous
    uint64_t y;       // [T, n_slots, N] of y_dtype, contiguous
    uint64_t ids;     // [T, n_slots] int32 or int64, contiguous
    uint64_t table;   // the format's grid (formats.glsl hz_table) or 0
    uint64_t order;   // grouped mode: [n_pairs] int32 pair indices sorted by expert, else 0
    uint64_t expert;  // grouped mode: [n_pairs] int32 expert of each entry of order (-1: outside [0, E))
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

shared float red_g[HZ_CHUNK][HZ_THREADS];
shared int pair_sh[HZ_CHUNK], expert_sh[HZ_CHUNK];

float x_at(uint p, uint k) {
    return hz_load(pc.x, pc.x_dtype, uint64_t(pc.x_per_slot != 0u ? p : p / pc.n_slots) * pc.K + k);
}

// The grouped mode: the chunk of sorted entries [c0, c0 + cnt) for output column n.
void grouped(uint n, uint c0, uint cnt, uint t) {
    if (t < HZ_CHUNK) {
        pair_sh[t] = t < cnt ? I32Ptr(pc.order).v[c0 + t] : 0;
        expert_sh[t] = t < cnt ? I32Ptr(pc.expert).v[c0 + t] : -1;
    }
    barrier();
    float acc[HZ_CHUNK];
    for (uint i = 0u; i < HZ_CHUNK; ++i) acc[i] = 0.0;
    uint k8 = HZ_QK % 8u == 0u ? pc.K : 0u;
    for (uint k0 = 8u * t; k0 < k8; k0 += 8u * HZ_THREADS) {
        float wv[8];
        int cur = -1;
        for (uint i = 0u; i < HZ_CHUNK; ++i) {
            const int e = expert_sh[i];
            if (i >= cnt || e < 0) continue;
            if (e != cur) {  // the weight run of this expert, once for its pairs in the chunk
                cur = e;
                uint64_t blk = pc.w + (uint64_t(e) * pc.N + n) * pc.row_bytes + uint64_t(k0 / HZ_QK) * HZ_TS;
                for (uint j = 0u; j < 8u; ++j) wv[j] = hz_elem(blk, k0 % HZ_QK + j);
            }
            const uint p = uint(pair_sh[i]);
            float a = acc[i];
            for (uint j = 0u; j < 8u; ++j) a += wv[j] * x_at(p, k0 + j);
            acc[i] = a;
        }
    }
    for (uint k = k8 + t; k < pc.K; k += HZ_THREADS) {
        float wv = 0.0;
        int cur = -1;
        for (uint i = 0u; i < HZ_CHUNK; ++i) {
            const int e = expert_sh[i];
            if (i >= cnt || e < 0) continue;
            if (e != cur) {
                cur = e;
                wv = hz_value_at(pc.w + (uint64_t(e) * pc.N + n) * pc.row_bytes, k);
            }
            acc[i] += wv * x_at(uint(pair_sh[i]), k);
        }
    }
    for (uint i = 0u; i < HZ_CHUNK; ++i) red_g[i][t] = acc[i];
    barrier();
    for (uint s = HZ_THREADS / 2u; s > 0u; s >>= 1) {
        if (t < s)
            for (uint i = 0u; i < HZ_CHUNK; ++i) red_g[i][t] += red_g[i][t + s];
        barrier();
    }
    if (t < cnt) {
        const float v = expert_sh[t] < 0 ? uintBitsToFloat(0x7FC00000u) : red_g[t][0];
        hz_store(pc.y, pc.y_dtype, uint64_t(pair_sh[t]) * pc.N + n, v);
    }
}

void main() {
    hz_table = pc.table;
    if (pc.order != 0ul) {
        uint n = gl_WorkGroupID.x + gl_NumWorkGroups.x * gl_WorkGroupID.y;
        uint c0 = pc.p0 + gl_WorkGroupID.z * HZ_CHUNK;
        if (n >= pc.N || c0 >= pc.n_pairs) return;  // uniform over the workgroup
        grouped(n, c0, min(HZ_CHUNK, pc.n_pairs - c0), gl_LocalInvocationID.x);
        return;
    }
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
