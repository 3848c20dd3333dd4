// quantize_q8_1: x [R, K] (float32/float16/bfloat16, rows x_stride elements apart) -> ggml q8_1
// blocks [R, K / 32 * 36] bytes (q8_1.glsl), one invocation per block of 32 values.
#version 460
#include "q8_1.glsl"

layout(local_size_x = 64) in;

layout(push_constant, std430) uniform Push {
    uint64_t x;        // [R, K] of x_dtype
    uint64_t y;        // [R, K / 32 * 36] bytes, 4-byte aligned
    uint64_t n_blocks; // R * K / 32
    uint blocks_per_row;  // K / 32
    uint x_stride;     // elements between rows of x
    uint x_dtype;      // HZ_DT_F32, HZ_DT_F16 or HZ_DT_BF16
} pc;

void main() {
    uint64_t b = hz_linear_id(64u);
    if (b >= pc.n_blocks) return;
    uint64_t r = b / uint64_t(pc.blocks_per_row), c = b % uint64_t(pc.blocks_per_row);
    uint64_t i0 = r * uint64_t(pc.x_stride) + c * 32ul;
    uint u[32];
    for (uint i = 0u; i < 32u; ++i) {
        if (pc.x_dtype == HZ_DT_F32) {
            u[i] = U32Ptr(pc.x + (i0 + i) * 4ul).v[0];
        } else {
            uint h = uint(U16Ptr(pc.x + (i0 + i) * 2ul).v[0]);
            u[i] = pc.x_dtype == HZ_DT_F16 ? floatBitsToUint(hz_half_to_float(h)) : h << 16;
        }
    }
    uint words[9];
    hz_quantize_q8_1(u, words);
    U32Ptr out_ = U32Ptr(pc.y + b * 36ul);
    for (uint i = 0u; i < 9u; ++i) out_.v[i] = words[i];
}
