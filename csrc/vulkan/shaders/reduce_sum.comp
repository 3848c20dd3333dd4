#version 450
// Row sums: out[r] = sum(x[r * len .. r * len + len)) for a contiguous x, accumulated in float32
// (floating outputs, rounded once on store) or int64 (integer outputs), sequentially per row.
#include "common.glsl"

layout(local_size_x = 64) in;

layout(push_constant, scalar) uniform Push {
    uint64_t x;
    uint64_t out_;
    uint rows;
    uint len;
    uint dts;         // x dtype | out dtype << 8 | (1 << 24 if integer)
} pc;

float load_f(uint64_t base, uint dt, int64_t i) {
    switch (dt) {
        case HZ_DT_F32: return F32Ptr(base + uint64_t(i) * 4ul).v[0];
        case HZ_DT_F16: return hz_half_to_float(uint(U16Ptr(base + uint64_t(i) * 2ul).v[0]));
        case HZ_DT_BF16: return hz_bf16_to_float(uint(U16Ptr(base + uint64_t(i) * 2ul).v[0]));
    }
    return 0.0;
}

int64_t load_i(uint64_t base, uint dt, int64_t i) {
    switch (dt) {
        case HZ_DT_I64: return I64Ptr(base + uint64_t(i) * 8ul).v[0];
        case HZ_DT_I32: return int64_t(I32Ptr(base + uint64_t(i) * 4ul).v[0]);
        case HZ_DT_U8: case HZ_DT_BOOL: return int64_t(uint(U8Ptr(base + uint64_t(i)).v[0]));
        case HZ_DT_I8: return int64_t(int(I8Ptr(base + uint64_t(i)).v[0]));
        case HZ_DT_I16: return int64_t(int(I16Ptr(base + uint64_t(i) * 2ul).v[0]));
    }
    return 0;
}

void main() {
    uint64_t r = hz_linear_id(64);
    if (r >= uint64_t(pc.rows)) return;
    uint dtx = pc.dts & 0xFFu, dto = (pc.dts >> 8) & 0xFFu;
    int64_t base = int64_t(r) * int64_t(pc.len);
    if ((pc.dts >> 24) != 0u) {
        int64_t acc = 0;
        for (uint j = 0u; j < pc.len; ++j) acc += load_i(pc.x, dtx, base + int64_t(j));
        if (dto == HZ_DT_I64) I64Ptr(pc.out_ + uint64_t(r) * 8ul).v[0] = acc;
        else I32Ptr(pc.out_ + uint64_t(r) * 4ul).v[0] = int(acc);
    } else {
        float acc = 0.0;
        for (uint j = 0u; j < pc.len; ++j) acc += load_f(pc.x, dtx, base + int64_t(j));
        if (dto == HZ_DT_F32) F32Ptr(pc.out_ + uint64_t(r) * 4ul).v[0] = acc;
        else if (dto == HZ_DT_F16) U16Ptr(pc.out_ + uint64_t(r) * 2ul).v[0] = uint16_t(hz_float_to_half(acc));
        else U16Ptr(pc.out_ + uint64_t(r) * 2ul).v[0] = uint16_t(hz_float_to_bf16(acc));
    }
}
