#version 450
// hanzo::moe_route: one workgroup per token. Softmax of the E logits in float32, then the k
// experts of highest probability in descending order (ties to the lower expert index, NaN above
// everything, as the reference's stable descending sort orders them): an expert's rank is the
// number of experts ahead of it, so each of the k first is written by its own invocation.
// Ranks compare logits, which order the experts as their probabilities do, except that a device
// flushing subnormal results to zero (lavapipe does) would turn probabilities below 2^-126 into
// ties and pick the lower index where the reference picks the larger logit.
// Weights optionally divided by their sum. Limits (else the reference): E <= 1024, k <= 256.
#include "fused.glsl"
#define FZ_WG 64u
layout(local_size_x = 64) in;

layout(push_constant) uniform Push {
    uint64_t logits, w, ids;
    uint T, E, k, normalize, dt;
} p;

shared float prob[1024];
shared float logit[1024];
shared float top[256];
shared float red[FZ_WG];

// x ahead of y in a descending order with NaN first
bool fz_ahead(float x, float y) { return isnan(x) ? !isnan(y) : (!isnan(y) && x > y); }

void main() {
    const uint t = fz_group_index();
    if (t >= p.T) return;
    const uint tid = gl_LocalInvocationID.x, E = p.E;
    const uint64_t row = p.logits + uint64_t(t) * E * fz_elem_bytes(p.dt);
    float mx = FZ_NEG_INF;
    for (uint e = tid; e < E; e += FZ_WG) {
        const float v = fz_load(row, p.dt, e);
        prob[e] = v;
        logit[e] = v;
        mx = isnan(v) || isnan(mx) ? uintBitsToFloat(0x7fc00000u) : max(mx, v);
    }
    red[tid] = mx;
    barrier();
    for (uint s = FZ_WG / 2u; s > 0u; s >>= 1) {
        if (tid < s) {
            const float a = red[tid], b = red[tid + s];
            red[tid] = isnan(a) || isnan(b) ? uintBitsToFloat(0x7fc00000u) : max(a, b);
        }
        barrier();
    }
    mx = red[0];
    barrier();
    float sum = 0.0;
    for (uint e = tid; e < E; e += FZ_WG) {
        const float v = exp(prob[e] - mx);
        prob[e] = v;
        sum += v;
    }
    red[tid] = sum;
    barrier();
    for (uint s = FZ_WG / 2u; s > 0u; s >>= 1) {
        if (tid < s) red[tid] += red[tid + s];
        barrier();
    }
    sum = red[0];
    for (uint e = tid; e < E; e += FZ_WG) prob[e] = prob[e] / sum;
    barrier();
    for (uint e = tid; e < E; e += FZ_WG) {
        const float le = logit[e];
        uint rank = 0u;
        if (isnan(mx)) rank = e;  // one NaN logit makes every probability NaN: all tie, index order
        else for (uint f = 0u; f < E && rank < p.k; ++f) {
            const float lf = logit[f];
            if (fz_ahead(lf, le) || (f < e && !fz_ahead(le, lf))) ++rank;
        }
        if (rank < p.k) {
            top[rank] = prob[e];
            I64Ptr(p.ids).v[t * p.k + rank] = int64_t(e);
        }
    }
    barrier();
    if (tid == 0u) {
        float tot = 0.0;
        for (uint j = 0u; j < p.k; ++j) tot += top[j];
        red[0] = tot;
    }
    barrier();
    for (uint j = tid; j < p.k; j += FZ_WG) F32Ptr(p.w).v[t * p.k + j] = p.normalize != 0u ? top[j] / red[0] : top[j];
}
