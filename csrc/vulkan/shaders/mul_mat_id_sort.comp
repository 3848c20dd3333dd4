#version 460
// The (token, slot) pairs of mul_mat_id grouped by expert, on the device (one workgroup): a
// counting sort of the P = T * n_slots ids. Writes order[P] (pair indices, those of expert 0
// first, then expert 1, ...; an id outside [0, E) after every expert) and expert[P] (the id of
// each entry of order, -1 for one outside [0, E)), both int32. The order inside one expert's run
// is not fixed; mul_mat_id.comp computes each pair the same way wherever it sits.
#include "common.glsl"

#define MAX_E 4096u

layout(local_size_x = 256) in;

layout(push_constant, std430) uniform Push {
    uint64_t ids;     // [P] int32 or int64
    uint64_t order;   // [P] int32, written
    uint64_t expert;  // [P] int32, written
    uint n_pairs;
    uint E;           // <= MAX_E
    uint ids_int64;
} pc;

shared uint count_sh[MAX_E + 1u];  // per expert, the last bucket for ids outside [0, E)

uint bucket(uint p) {
    const int64_t e = pc.ids_int64 != 0u ? I64Ptr(pc.ids).v[p] : int64_t(I32Ptr(pc.ids).v[p]);
    return e < 0l || e >= int64_t(pc.E) ? pc.E : uint(e);
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    for (uint e = tid; e <= pc.E; e += 256u) count_sh[e] = 0u;
    barrier();
    for (uint p = tid; p < pc.n_pairs; p += 256u) atomicAdd(count_sh[bucket(p)], 1u);
    barrier();
    if (tid == 0u) {  // exclusive prefix sum: the first slot of each bucket
        uint total = 0u;
        for (uint e = 0u; e <= pc.E; ++e) {
            const uint c = count_sh[e];
            count_sh[e] = total;
            total += c;
        }
    }
    barrier();
    for (uint p = tid; p < pc.n_pairs; p += 256u) {
        const uint e = bucket(p), slot = atomicAdd(count_sh[e], 1u);
        I32Ptr(pc.order).v[slot] = int(p);
        I32Ptr(pc.expert).v[slot] = e == pc.E ? -1 : int(e);
    }
}
