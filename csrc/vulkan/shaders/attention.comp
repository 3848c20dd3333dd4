#version 450
// hanzo::attention: causal-by-position, grouped-query attention of q [B, T, Hq, D] against
// contiguous caches [B, S, Hk, D] (f32/f16/bf16, or q8_0 rows). Scores, softmax and P*V in float32.
//
// One workgroup per (b, t, kv head, split). The G = Hq/Hk query heads of the KV head share it
// (their queries and accumulators in shared memory), so the key and value rows of a chunk are
// fetched from memory once for the group. Keys 0..position (a position >= S sees the whole
// cache, a negative one nothing: zeros) go in chunks of 64 with an online softmax (running max
// m, sum l, unnormalized acc per head). Chunks c = split, split + nsplit, ...: with nsplit == 1
// the workgroup writes the output; otherwise it writes its (m, l, acc) to the float32 workspace
// `part`, and the last of the nsplit workgroups of its (b, t, kv head) to finish (a per-item
// counter, atomically incremented, then reset to 0 for the next dispatch) merges the states in
// the same dispatch: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
// No array in an invocation is indexed by a run-time value (those live in slow scratch memory).
// Limits (ops_fused.cpp sends other calls to the reference): G <= 16, G * D <= 2048.
#include "fused.glsl"
#define FZ_WG 64u
#define FZ_CHUNK 64u
#define FZ_MAX_G 16u
#define FZ_MAX_GD 2048u
layout(local_size_x = 64) in;

layout(push_constant) uniform Push {
    uint64_t q, kc, vc, out_, pos, part, counter;  // counter: uint [BT * Hk], zero between dispatches
    uint BT, T, S, Hq, Hk, D;
    uint dt, dt_c, pos32, nsplit;
    float scale;
} p;

// The workspace and counters are shared between the workgroups of one item.
layout(buffer_reference, std430, buffer_reference_align = 4) coherent buffer FzPart { float v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) coherent buffer FzCounter { uint v[]; };
shared bool last_sh;

shared float q_sh[FZ_MAX_GD];    // the G queries, [G][D]
shared float acc_sh[FZ_MAX_GD];  // unnormalized P*V of the G heads, [G][D]; each entry owned by one invocation
shared float s_sh[FZ_MAX_G * FZ_CHUNK];
shared float m_sh[FZ_MAX_G], l_sh[FZ_MAX_G], c_sh[FZ_MAX_G];

void write_out(uint bt, uint hk, uint G, uint g, uint d, float v) {
    const uint64_t row = uint64_t(bt * p.Hq + hk * G + g) * p.D * fz_elem_bytes(p.dt);
    fz_store(p.out_ + row, p.dt, d, v);
}

void merge(uint item, uint G) {
    const uint D = p.D, tid = gl_LocalInvocationID.x, bt = item / p.Hk, hk = item % p.Hk;
    const uint state = G * (D + 2u);  // floats per (item, split): m[G], l[G], acc[G][D]
    const uint64_t base = p.part + uint64_t(item) * p.nsplit * state * 4u;
    for (uint g = 0u; g < G; ++g) {
        float M = FZ_NEG_INF;
        for (uint s = 0u; s < p.nsplit; ++s) M = max(M, FzPart(base + uint64_t(s) * state * 4u).v[g]);
        for (uint d = tid; d < D; d += FZ_WG) {
            float L = 0.0, o = 0.0;
            if (M != FZ_NEG_INF) {
                for (uint s = 0u; s < p.nsplit; ++s) {
                    FzPart st = FzPart(base + uint64_t(s) * state * 4u);
                    const float m = st.v[g];
                    if (m == FZ_NEG_INF) continue;
                    const float w = exp(m - M);
                    L += w * st.v[G + g];
                    o += w * st.v[2u * G + g * D + d];
                }
            }
            write_out(bt, hk, G, g, d, L > 0.0 ? o / L : 0.0);
        }
    }
}

void main() {
    const uint item = fz_group_index();
    if (item >= p.BT * p.Hk) return;
    const uint G = p.Hq / p.Hk, D = p.D, GD = G * D, tid = gl_LocalInvocationID.x;
    const uint split = gl_WorkGroupID.z, bt = item / p.Hk, hk = item % p.Hk, b = bt / p.T;
    const int64_t pos = fz_position(p.pos, p.pos32, bt);
    const uint nkeys = pos < 0 ? 0u : pos >= int64_t(p.S) ? p.S : uint(pos) + 1u;
    const uint64_t qrow = p.q + uint64_t(bt * p.Hq + hk * G) * D * fz_elem_bytes(p.dt);
    for (uint i = tid; i < GD; i += FZ_WG) {
        q_sh[i] = fz_load(qrow, p.dt, i);
        acc_sh[i] = 0.0;
    }
    if (tid < G) {
        m_sh[tid] = FZ_NEG_INF;
        l_sh[tid] = 0.0;
    }
    barrier();

    const uint rb = fz_row_bytes(p.dt_c, D);
    const uint64_t key_stride = uint64_t(p.Hk) * rb;
    const uint64_t head0 = (uint64_t(b) * p.S * p.Hk + hk) * rb;
    const uint nchunks = (nkeys + FZ_CHUNK - 1u) / FZ_CHUNK;
    for (uint c = split; c < nchunks; c += p.nsplit) {
        const uint j0 = c * FZ_CHUNK, n = min(FZ_CHUNK, nkeys - j0);
        // scores: invocation tid takes key j0 + tid, for each head
        if (tid < n) {
            const uint64_t krow = p.kc + head0 + uint64_t(j0 + tid) * key_stride;
            for (uint g = 0u; g < G; ++g) {
                float a = 0.0;
                for (uint d = 0u; d < D; ++d) a += q_sh[g * D + d] * fz_load_cache(krow, p.dt_c, d);
                s_sh[g * FZ_CHUNK + tid] = a * p.scale;
            }
        }
        barrier();
        // online softmax update, one invocation per head
        if (tid < G) {
            float mc = FZ_NEG_INF;
            for (uint i = 0u; i < n; ++i) mc = max(mc, s_sh[tid * FZ_CHUNK + i]);
            const float mo = m_sh[tid], mn = max(mo, mc);
            const float corr = mo == FZ_NEG_INF ? 0.0 : exp(mo - mn);
            float l = 0.0;
            for (uint i = 0u; i < n; ++i) {
                const float e = exp(s_sh[tid * FZ_CHUNK + i] - mn);
                s_sh[tid * FZ_CHUNK + i] = e;
                l += e;
            }
            l_sh[tid] = l_sh[tid] * corr + l;
            m_sh[tid] = mn;
            c_sh[tid] = corr;
        }
        barrier();
        // P*V: invocation tid owns the entries o = tid + 64 i of acc [G][D]
        for (uint o = tid; o < GD; o += FZ_WG) {
            const uint g = o / D, d = o - g * D;
            float a = acc_sh[o] * c_sh[g];
            uint64_t vrow = p.vc + head0 + uint64_t(j0) * key_stride;
            for (uint i = 0u; i < n; ++i, vrow += key_stride) a += s_sh[g * FZ_CHUNK + i] * fz_load_cache(vrow, p.dt_c, d);
            acc_sh[o] = a;
        }
        barrier();  // s_sh and c_sh are rewritten by the next chunk
    }

    if (p.nsplit == 1u) {
        for (uint o = tid; o < GD; o += FZ_WG) {
            const uint g = o / D;
            write_out(bt, hk, G, g, o - g * D, l_sh[g] > 0.0 ? acc_sh[o] / l_sh[g] : 0.0);
        }
        return;
    }
    const uint state = G * (D + 2u);
    FzPart st = FzPart(p.part + (uint64_t(item) * p.nsplit + split) * state * 4u);
    if (tid < G) {
        st.v[tid] = m_sh[tid];
        st.v[G + tid] = l_sh[tid];
    }
    for (uint o = tid; o < GD; o += FZ_WG) st.v[2u * G + o] = acc_sh[o];
    // the last workgroup of this item to get here merges the nsplit states
    memoryBarrierBuffer();
    barrier();
    if (tid == 0u) last_sh = atomicAdd(FzCounter(p.counter).v[item], 1u) == p.nsplit - 1u;
    barrier();
    if (!last_sh) return;
    memoryBarrierBuffer();
    merge(item, G);
    if (tid == 0u) FzCounter(p.counter).v[item] = 0u;
}
