#version 450
// hanzo::swiglu: y = silu(gate) * up elementwise, float32 maths, one rounding to the dtype.
#include "fused.glsl"
layout(local_size_x = 128) in;

layout(push_constant) uniform Push {
    uint64_t g, u, y;
    uint n, dt;
} p;

void main() {
    const uint i = fz_group_index() * 128u + gl_LocalInvocationID.x;
    if (i >= p.n) return;
    const float a = fz_load(p.g, p.dt, i);
    fz_store(p.y, p.dt, i, a / (1.0 + exp(-a)) * fz_load(p.u, p.dt, i));
}
