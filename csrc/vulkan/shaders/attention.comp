#version 450
// hanzo::attention: causal-by-position, grouped-query attention of q [B, T, Hq, D] against
// contiguous caches [B, S, Hk, D] (f32/f16/bf16, or q8_0 rows). Scores, softmax and P*V in float32.
//
// mode 0: one workgroup per (b, t, kv head, split). The G = Hq/Hk query heads of the KV head
// share it: each key row is read (and converted to float32) once, by one invocation, which dots
// it with all G queries; each value row is read once, each invocation owning D/64 of its columns
// for all G heads. Keys 0..position (a position >= S sees the whole cache, a negative one
// nothing: zeros) go in chunks of 64 with an online softmax (running max m, sum l, unnormalized
// acc per head). Chunks c = split, split + nsplit, ...: with nsplit == 1 the workgroup writes
// the output; otherwise it writes its (m, l, acc) to the float32 workspace `part`, and the last
// of the nsplit workgroups of its (b, t, kv head) to finish (a per-item counter, atomically
// incremented, then reset to 0 for the next dispatch) merges the states in the same dispatch:
// out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
// Limits (ops_fused.cpp sends other calls to the reference): G <= 16, D <= 256, G * D <= 2048.
#include "fused.glsl"
#define FZ_WG 64u
#define FZ_CHUNK 64u
#define FZ_MAX_G 16u
#define FZ_MAX_ACC 32u
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

shared float q_sh[2048];
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
                    FzF32 st = FzF32(base + uint64_t(s) * state * 4u);
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
    const uint G = p.Hq / p.Hk, D = p.D, tid = gl_LocalInvocationID.x;
    const uint split = gl_WorkGroupID.z, bt = item / p.Hk, hk = item % p.Hk, b = bt / p.T;
    const int64_t pos = fz_position(p.pos, p.pos32, bt);
    const uint nkeys = pos < 0 ? 0u : pos >= int64_t(p.S) ? p.S : uint(pos) + 1u;
    const uint64_t qrow = p.q + uint64_t(bt * p.Hq + hk * G) * D * fz_elem_bytes(p.dt);
    for (uint i = tid; i < G * D; i += FZ_WG) q_sh[i] = fz_load(qrow, p.dt, i);
    if (tid < G) {
        m_sh[tid] = FZ_NEG_INF;
        l_sh[tid] = 0.0;
    }
    const uint nslot = (D + FZ_WG - 1u) / FZ_WG;
    float acc[FZ_MAX_ACC];
    for (uint i = 0u; i < FZ_MAX_ACC; ++i) acc[i] = 0.0;
    barrier();

    const uint rb = fz_row_bytes(p.dt_c, D);
    const uint64_t key_stride = uint64_t(p.Hk) * rb;
    const uint64_t head0 = (uint64_t(b) * p.S * p.Hk + hk) * rb;
    const uint nchunks = (nkeys + FZ_CHUNK - 1u) / FZ_CHUNK;
    for (uint c = split; c < nchunks; c += p.nsplit) {
        const uint j0 = c * FZ_CHUNK, n = min(FZ_CHUNK, nkeys - j0), j = j0 + tid;
        // scores of key j for the G heads
        if (tid < n) {
            float a[FZ_MAX_G];
            for (uint g = 0u; g < G; ++g) a[g] = 0.0;
            const uint64_t krow = p.kc + head0 + uint64_t(j) * key_stride;
            for (uint d = 0u; d < D; ++d) {
                const float kd = fz_load_cache(krow, p.dt_c, d);
                for (uint g = 0u; g < G; ++g) a[g] += q_sh[g * D + d] * kd;
            }
            for (uint g = 0u; g < G; ++g) s_sh[g * FZ_CHUNK + tid] = a[g] * p.scale;
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
        // P*V: this invocation owns columns d = tid + 64 * slot of all G heads
        for (uint slot = 0u; slot < nslot; ++slot)
            for (uint g = 0u; g < G; ++g) acc[slot * G + g] *= c_sh[g];
        for (uint i = 0u; i < n; ++i) {
            const uint64_t vrow = p.vc + head0 + uint64_t(j0 + i) * key_stride;
            for (uint slot = 0u; slot < nslot; ++slot) {
                const uint d = tid + slot * FZ_WG;
                if (d >= D) break;
                const float vd = fz_load_cache(vrow, p.dt_c, d);
                for (uint g = 0u; g < G; ++g) acc[slot * G + g] += s_sh[g * FZ_CHUNK + i] * vd;
            }
        }
        barrier();  // s_sh and c_sh are rewritten by the next chunk
    }

    if (p.nsplit == 1u) {
        for (uint slot = 0u; slot < nslot; ++slot) {
            const uint d = tid + slot * FZ_WG;
            if (d >= D) break;
            for (uint g = 0u; g < G; ++g) {
                const float l = l_sh[g];
                write_out(bt, hk, G, g, d, l > 0.0 ? acc[slot * G + g] / l : 0.0);
            }
        }
        return;
    }
    const uint state = G * (D + 2u);
    FzPart st = FzPart(p.part + (uint64_t(item) * p.nsplit + split) * state * 4u);
    if (tid < G) {
        st.v[tid] = m_sh[tid];
        st.v[G + tid] = l_sh[tid];
    }
    for (uint slot = 0u; slot < nslot; ++slot) {
        const uint d = tid + slot * FZ_WG;
        if (d >= D) break;
        for (uint g = 0u; g < G; ++g) st.v[2u * G + g * D + d] = acc[slot * G + g];
    }
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
