// The epilogue of swiglu_mul_mat: dst[i] = silu(g[i]) * u[i] in float32, where g and u are the two
// float32 projections (gate, up), first rounded to round_dtype (HZ_DT_*; float32 keeps them) as the
// unfused mul_mat ops round their results to the activation dtype; dst is stored in out_dtype.
// Element i = gl_GlobalInvocationID.x + 65535 * 256 * gl_WorkGroupID.y.
#version 460
#define HZ_NO_FORMAT
#include "formats.glsl"

layout(local_size_x = 256) in;

layout(push_constant, std430) uniform Push {
    uint64_t g;        // float32 [n]
    uint64_t u;        // float32 [n]
    uint64_t dst;      // [n] of out_dtype
    uint n;
    uint round_dtype;
    uint out_dtype;
} pc;

float round_to(float v, uint dt) {
    if (dt == HZ_DT_F16) return hz_f16_bits(hz_f16_rne(v));
    if (dt == HZ_DT_BF16) return uintBitsToFloat(hz_bf16_rne(v) << 16);
    return v;
}

void main() {
    uint i = gl_GlobalInvocationID.x + 65535u * 256u * gl_WorkGroupID.y;
    if (i >= pc.n) return;
    float a = round_to(hz_load(pc.g, HZ_DT_F32, i), pc.round_dtype);
    float b = round_to(hz_load(pc.u, HZ_DT_F32, i), pc.round_dtype);
    hz_store(pc.dst, pc.out_dtype, i, a / (1.0 + exp(-a)) * b);
}
