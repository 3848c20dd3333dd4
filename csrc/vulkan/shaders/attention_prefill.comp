#version 450
// hanzo::attention for many query tokens (prefill): the same maths as attention.comp (causal by
// position, grouped-query, float32 scores, softmax and P*V, one rounding of the output), tiled.
//
// One workgroup per (b, block of BQ query tokens, kv head): its R = BQ * G query rows (row r is
// token r / G, head r % G of the group) share every key/value tile, which is fetched from the
// cache once per block and staged in shared memory as float32 ([NKV][D]: NKV = KV_FLOATS / D keys
// per tile). Row r sees keys 0 .. n_r - 1 (n_r from its position as in attention.comp: a
// position >= S sees the whole cache, a negative one nothing); the tiles go up to the largest n_r
// of the block, and a row never reads a score or value past its own n_r, so a slot past every
// position is never read and one past this row's position does not reach its output.
// Per tile: the scores of (row, key) pairs (invocation i takes row i for every key of the tile,
// its query read once per column), an online softmax update per row (running max m, sum l), then
// P*V into the unnormalized accumulators acc [R][D] (each entry owned by one invocation).
// ops_fused.cpp picks BQ so that R <= MAX_R and R * D <= ACC_FLOATS, and D <= KV_FLOATS.
#include "fused.glsl"
#define WG 64u
#define MAX_R 64u
#define ACC_FLOATS 4096u
#define KV_FLOATS 1024u
#define MAX_NKV 16u
layout(local_size_x = 64) in;

layout(push_constant) uniform Push {
    uint64_t q, kc, vc, out_, pos;
    uint B, T, S, Hq, Hk, D;
    uint dt, dt_c, pos32, BQ;
    float scale;
} p;

shared float acc_sh[ACC_FLOATS];      // [R][D]
shared float k_sh[KV_FLOATS];         // [NKV][D]
shared float v_sh[KV_FLOATS];         // [NKV][D]
shared float s_sh[MAX_R * MAX_NKV];   // scores, then probabilities [R][NKV]
shared float m_sh[MAX_R], l_sh[MAX_R], c_sh[MAX_R];
shared uint n_sh[MAX_R];              // keys each row sees
shared uint nmax_sh;

void main() {
    const uint G = p.Hq / p.Hk, D = p.D, tid = gl_LocalInvocationID.x;
    const uint nblk = (p.T + p.BQ - 1u) / p.BQ;
    const uint item = fz_group_index();
    if (item >= p.B * nblk * p.Hk) return;
    const uint hk = item % p.Hk, blk = (item / p.Hk) % nblk, b = item / (p.Hk * nblk);
    const uint t0 = blk * p.BQ, nq = min(p.BQ, p.T - t0), R = nq * G, RD = R * D;
    const uint NKV = min(MAX_NKV, KV_FLOATS / D);

    if (tid < R) {
        const int64_t pos = fz_position(p.pos, p.pos32, b * p.T + t0 + tid / G);
        n_sh[tid] = pos < 0 ? 0u : pos >= int64_t(p.S) ? p.S : uint(pos) + 1u;
        m_sh[tid] = FZ_NEG_INF;
        l_sh[tid] = 0.0;
    }
    for (uint o = tid; o < RD; o += WG) acc_sh[o] = 0.0;
    barrier();
    if (tid == 0u) {
        uint n = 0u;
        for (uint r = 0u; r < R; r += G) n = max(n, n_sh[r]);
        nmax_sh = n;
    }
    barrier();
    const uint nmax = nmax_sh;

    const uint rb = fz_row_bytes(p.dt_c, D), esz = fz_elem_bytes(p.dt);
    const uint64_t key_stride = uint64_t(p.Hk) * rb;
    const uint64_t head0 = (uint64_t(b) * p.S * p.Hk + hk) * rb;
    // this invocation's query row (invocation r < R takes row r in the score step)
    const uint my_r = min(tid, R - 1u);
    const uint64_t qrow = p.q + (uint64_t(b * p.T + t0 + my_r / G) * p.Hq + hk * G + my_r % G) * D * esz;
    const uint my_n = n_sh[my_r];

    for (uint j0 = 0u; j0 < nmax; j0 += NKV) {
        const uint n = min(NKV, nmax - j0);
        // stage the tile: keys j0 .. j0 + n - 1, all below the block's largest n_r
        for (uint i = tid; i < n * D; i += WG) {
            const uint j = i / D, d = i - j * D;
            const uint64_t off = head0 + uint64_t(j0 + j) * key_stride;
            k_sh[i] = fz_load_cache(p.kc + off, p.dt_c, d);
            v_sh[i] = fz_load_cache(p.vc + off, p.dt_c, d);
        }
        barrier();
        // scores of row tid against the keys it sees in this tile
        if (tid < R) {
            const uint nr = my_n > j0 ? min(n, my_n - j0) : 0u;
            float s[MAX_NKV];
            for (uint j = 0u; j < MAX_NKV; ++j) s[j] = 0.0;
            if (nr > 0u) {
                for (uint d = 0u; d < D; ++d) {
                    const float qd = fz_load(qrow, p.dt, d);
                    for (uint j = 0u; j < MAX_NKV; ++j)
                        if (j < nr) s[j] += qd * k_sh[j * D + d];
                }
            }
            // online softmax update of row tid
            float mc = FZ_NEG_INF;
            for (uint j = 0u; j < MAX_NKV; ++j)
                if (j < nr) mc = max(mc, s[j] * p.scale);
            const float mo = m_sh[tid], mn = max(mo, mc);
            const float corr = mo == FZ_NEG_INF ? 0.0 : exp(mo - mn);
            float l = 0.0;
            for (uint j = 0u; j < MAX_NKV; ++j) {
                if (j < n) {
                    const float e = j < nr ? exp(s[j] * p.scale - mn) : 0.0;
                    s_sh[tid * MAX_NKV + j] = e;
                    l += e;
                }
            }
            l_sh[tid] = l_sh[tid] * corr + l;
            m_sh[tid] = mn;
            c_sh[tid] = nr > 0u ? corr : 1.0;
        }
        barrier();
        // P*V: invocation tid owns the entries o = tid + 64 i of acc [R][D]
        for (uint o = tid; o < RD; o += WG) {
            const uint r = o / D, d = o - r * D;
            const uint nr = n_sh[r] > j0 ? min(n, n_sh[r] - j0) : 0u;
            if (nr == 0u) continue;
            float a = acc_sh[o] * c_sh[r];
            for (uint j = 0u; j < nr; ++j) a += s_sh[r * MAX_NKV + j] * v_sh[j * D + d];
            acc_sh[o] = a;
        }
        barrier();  // the tiles, s_sh and c_sh are rewritten by the next tile
    }

    for (uint o = tid; o < RD; o += WG) {
        const uint r = o / D, d = o - r * D;
        const uint64_t row = (uint64_t(b * p.T + t0 + r / G) * p.Hq + hk * G + r % G) * D * esz;
        fz_store(p.out_ + row, p.dt, d, l_sh[r] > 0.0 ? acc_sh[o] / l_sh[r] : 0.0);
    }
}
