// The float32 sum of one value per invocation over the workgroup, by a tree reduction in shared
// memory (a fixed order, so every shader that uses it rounds alike). The includer defines FZ_WG
// (the workgroup size, a power of two) and declares `shared float red[FZ_WG]`; every invocation
// of the workgroup must call it (it has barriers), and red is overwritten by the next call.
#ifndef FZ_WG_SUM_GLSL
#define FZ_WG_SUM_GLSL
float fz_workgroup_sum(float v) {
    const uint tid = gl_LocalInvocationID.x;
    red[tid] = v;
    barrier();
    for (uint k = FZ_WG / 2u; k > 0u; k >>= 1) {
        if (tid < k) red[tid] += red[tid + k];
        barrier();
    }
    return red[0];
}
#endif
