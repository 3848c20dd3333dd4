// hz: variants any f32 f16 bf16 i64 i32 i16
#version 450
// Strided elementwise kernel of the vulkan device's aten glue: copy/cast, fill, add, sub, mul.
// out[i] = op(a[i], b[i]) over up to 5 coalesced dims (device.cpp's Elementwise); every operand has
// its own dtype code (HZ_DT_*) and strides in elements (0 for a broadcast dim). Floating results
// are computed in float32 and rounded once on store (round to nearest even for f16/bf16);
// integer results in int64 (wrapping on store). Float -> integer casts truncate toward zero.
// Variants (elementwise.<v>.spv): every operand of one dtype fixed at compile time (the dtype
// switches fold away: lavapipe ran a float32 multiply 15x faster than with run-time codes), or
// "any" (codes from dts). Element offsets are 32-bit (the host checks they fit).
#include "common.glsl"

layout(local_size_x = 256) in;

#define OP_COPY 0
#define OP_FILL 1
#define OP_ADD 2
#define OP_SUB 3
#define OP_MUL 4

layout(push_constant, scalar) uniform Push {
    uint64_t out_;    // address of out's element 0
    uint64_t a;       // first operand (OP_COPY: the source)
    uint64_t b;       // second operand; OP_FILL: the raw bits to store
    uint n;           // elements
    uint ndim;
    uint op;
    uint dts;         // dtype codes: out | a << 8 | b << 16 | (1 << 24 if computing in int64)
    float alpha;      // add/sub: out = a +- alpha * b (float domain)
    int alpha_i;      // the same in the integer domain
    uint size[5];
    int so[5];
    int sa[5];
    int sb[5];
} pc;

float load_f(uint64_t base, uint dt, int i) {
    switch (dt) {
        case HZ_DT_F32: return F32Ptr(base).v[i];
        case HZ_DT_F16: return hz_half_to_float(uint(U16Ptr(base).v[i]));
        case HZ_DT_BF16: return hz_bf16_to_float(uint(U16Ptr(base).v[i]));
        case HZ_DT_I64: return float(I64Ptr(base).v[i]);
        case HZ_DT_I32: return float(I32Ptr(base).v[i]);
        case HZ_DT_U8: return float(uint(U8Ptr(base).v[i]));
        case HZ_DT_I8: return float(int(I8Ptr(base).v[i]));
        case HZ_DT_BOOL: return uint(U8Ptr(base).v[i]) != 0u ? 1.0 : 0.0;
        case HZ_DT_I16: return float(int(I16Ptr(base).v[i]));
    }
    return 0.0;
}

int64_t load_i(uint64_t base, uint dt, int i) {
    switch (dt) {
        case HZ_DT_F32: return int64_t(F32Ptr(base).v[i]);
        case HZ_DT_F16: return int64_t(hz_half_to_float(uint(U16Ptr(base).v[i])));
        case HZ_DT_BF16: return int64_t(hz_bf16_to_float(uint(U16Ptr(base).v[i])));
        case HZ_DT_I64: return I64Ptr(base).v[i];
        case HZ_DT_I32: return int64_t(I32Ptr(base).v[i]);
        case HZ_DT_U8: return int64_t(uint(U8Ptr(base).v[i]));
        case HZ_DT_I8: return int64_t(int(I8Ptr(base).v[i]));
        case HZ_DT_BOOL: return int64_t(uint(U8Ptr(base).v[i]) != 0u ? 1 : 0);
        case HZ_DT_I16: return int64_t(int(I16Ptr(base).v[i]));
    }
    return 0;
}

void store_f(uint64_t base, uint dt, int i, float v) {
    switch (dt) {
        case HZ_DT_F32: F32Ptr(base).v[i] = v; break;
        case HZ_DT_F16: U16Ptr(base).v[i] = uint16_t(hz_float_to_half(v)); break;
        case HZ_DT_BF16: U16Ptr(base).v[i] = uint16_t(hz_float_to_bf16(v)); break;
        case HZ_DT_I64: I64Ptr(base).v[i] = int64_t(v); break;
        case HZ_DT_I32: I32Ptr(base).v[i] = int(int64_t(v)); break;
        case HZ_DT_U8: U8Ptr(base).v[i] = uint8_t(uint(int64_t(v)) & 0xFFu); break;
        case HZ_DT_I8: I8Ptr(base).v[i] = int8_t(int(int64_t(v))); break;
        case HZ_DT_BOOL: U8Ptr(base).v[i] = uint8_t(v != 0.0 ? 1u : 0u); break;
        case HZ_DT_I16: I16Ptr(base).v[i] = int16_t(int(int64_t(v))); break;
    }
}

void store_i(uint64_t base, uint dt, int i, int64_t v) {
    switch (dt) {
        case HZ_DT_F32: F32Ptr(base).v[i] = float(v); break;
        case HZ_DT_F16: U16Ptr(base).v[i] = uint16_t(hz_float_to_half(float(v))); break;
        case HZ_DT_BF16: U16Ptr(base).v[i] = uint16_t(hz_float_to_bf16(float(v))); break;
        case HZ_DT_I64: I64Ptr(base).v[i] = v; break;
        case HZ_DT_I32: I32Ptr(base).v[i] = int(v); break;
        case HZ_DT_U8: U8Ptr(base).v[i] = uint8_t(uint(v) & 0xFFu); break;
        case HZ_DT_I8: I8Ptr(base).v[i] = int8_t(int(v)); break;
        case HZ_DT_BOOL: U8Ptr(base).v[i] = uint8_t(v != 0 ? 1u : 0u); break;
        case HZ_DT_I16: I16Ptr(base).v[i] = int16_t(int(v)); break;
    }
}

void store_bits(uint64_t base, uint dt, int i, uint64_t bits) {
    switch (dt) {
        case HZ_DT_F32: case HZ_DT_I32: U32Ptr(base).v[i] = uint(bits); break;
        case HZ_DT_F16: case HZ_DT_BF16: case HZ_DT_I16: U16Ptr(base).v[i] = uint16_t(uint(bits) & 0xFFFFu); break;
        case HZ_DT_I64: U64Ptr(base).v[i] = bits; break;
        default: U8Ptr(base).v[i] = uint8_t(uint(bits) & 0xFFu); break;
    }
}

void main() {
    uint64_t lin = hz_linear_id(256);
    if (lin >= uint64_t(pc.n)) return;
    uint r = uint(lin);
    int io = 0, ia = 0, ib = 0;
    for (int d = int(pc.ndim) - 1; d >= 0; --d) {
        uint c = r % pc.size[d];
        r /= pc.size[d];
        io += int(c) * pc.so[d];
        ia += int(c) * pc.sa[d];
        ib += int(c) * pc.sb[d];
    }
#if defined(HZ_VARIANT_f32)
    const uint dto = HZ_DT_F32, dta = HZ_DT_F32, dtb = HZ_DT_F32;
    const bool integer = false;
#elif defined(HZ_VARIANT_f16)
    const uint dto = HZ_DT_F16, dta = HZ_DT_F16, dtb = HZ_DT_F16;
    const bool integer = false;
#elif defined(HZ_VARIANT_bf16)
    const uint dto = HZ_DT_BF16, dta = HZ_DT_BF16, dtb = HZ_DT_BF16;
    const bool integer = false;
#elif defined(HZ_VARIANT_i64)
    const uint dto = HZ_DT_I64, dta = HZ_DT_I64, dtb = HZ_DT_I64;
    const bool integer = true;
#elif defined(HZ_VARIANT_i32)
    const uint dto = HZ_DT_I32, dta = HZ_DT_I32, dtb = HZ_DT_I32;
    const bool integer = true;
#elif defined(HZ_VARIANT_i16)
    const uint dto = HZ_DT_I16, dta = HZ_DT_I16, dtb = HZ_DT_I16;
    const bool integer = true;
#else
    uint dto = pc.dts & 0xFFu, dta = (pc.dts >> 8) & 0xFFu, dtb = (pc.dts >> 16) & 0xFFu;
    bool integer = (pc.dts >> 24) != 0u;
#endif
    if (pc.op == OP_FILL) {
        store_bits(pc.out_, dto, io, pc.b);
        return;
    }
    if (pc.op == OP_COPY) {
        if (dta == dto) {
            // same type: move the bits (exact for NaN payloads and every integer)
            switch (dto) {
                case HZ_DT_F32: case HZ_DT_I32: U32Ptr(pc.out_).v[io] = U32Ptr(pc.a).v[ia]; break;
                case HZ_DT_F16: case HZ_DT_BF16: case HZ_DT_I16: U16Ptr(pc.out_).v[io] = U16Ptr(pc.a).v[ia]; break;
                case HZ_DT_I64: U64Ptr(pc.out_).v[io] = U64Ptr(pc.a).v[ia]; break;
                default: U8Ptr(pc.out_).v[io] = U8Ptr(pc.a).v[ia]; break;
            }
        } else if (integer) {
            store_i(pc.out_, dto, io, load_i(pc.a, dta, ia));
        } else {
            store_f(pc.out_, dto, io, load_f(pc.a, dta, ia));
        }
        return;
    }
    if (integer) {
        int64_t x = load_i(pc.a, dta, ia), y = load_i(pc.b, dtb, ib), v;
        if (pc.op == OP_ADD) v = x + int64_t(pc.alpha_i) * y;
        else if (pc.op == OP_SUB) v = x - int64_t(pc.alpha_i) * y;
        else v = x * y;
        store_i(pc.out_, dto, io, v);
    } else {
        float x = load_f(pc.a, dta, ia), y = load_f(pc.b, dtb, ib), v;
        // alpha != 1: one fused multiply-add, as torch's vectorized CPU kernels compute it
        if (pc.op == OP_ADD) v = pc.alpha == 1.0 ? x + y : fma(pc.alpha, y, x);
        else if (pc.op == OP_SUB) v = pc.alpha == 1.0 ? x - y : fma(-pc.alpha, y, x);
        else v = x * y;
        store_f(pc.out_, dto, io, v);
    }
}
