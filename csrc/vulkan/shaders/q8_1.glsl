// ggml q8_1 quantization of one block of 32 activations, bit-exact with the reference
// (hanzo_torch.formats.q8_1.quantize_q8_1, ggml's quantize_row_q8_1_ref in float32):
//     d = amax / 127, id = d ? 1 / d : 0, qs[i] = roundf(x[i] * id) (0 where not finite),
//     fields: fp16(d), fp16(float(sum(qs)) * d), qs.
// Vulkan leaves float division 2.5 ulp and lets a device flush subnormals (lavapipe does), so:
// both divisions are done exactly on the significands in 64-bit integers (hz_div_rn); products
// are `precise` (Vulkan rounds OpFMul correctly); a block whose amax is below 2^-100 is scaled by
// 2^100 through its bits (exact) and its subnormal scale d is rounded on the 2^-149 grid in
// integers, so no subnormal float is ever an operand. Non-finite blocks give the reference's
// bytes: amax inf -> d = inf, qs = 0, s = fp16 of 0 * inf, which the CPU reference computes as
// the x86 default NaN (sign set: 0xFE00); a NaN -> d = s = the canonical quiet NaN (0x7E00).
// Block layout (36 bytes, 9 little-endian words): word 0 = d | s << 16, words 1..8 = qs.
#ifndef HZ_Q8_1_GLSL
#define HZ_Q8_1_GLSL

#include "common.glsl"

// Correctly rounded a / b (round to nearest even) for positive normal a and b whose quotient
// is a normal float.
float hz_div_rn(float a, float b) {
    uint ua = floatBitsToUint(a), ub = floatBitsToUint(b);
    int e = int(ua >> 23) - int(ub >> 23) + 127;
    uint64_t A = uint64_t((ua & 0x7FFFFFu) | 0x800000u), B = uint64_t((ub & 0x7FFFFFu) | 0x800000u);
    if (A < B) {
        A <<= 1;
        e -= 1;
    }
    uint64_t num = A << 23;  // A / B in [1, 2): a 24-bit quotient and its remainder
    uint64_t N = num / B, R = num - N * B;
    if (2ul * R > B || (2ul * R == B && (N & 1ul) != 0ul)) N += 1ul;
    if (N == (1ul << 24)) {
        N >>= 1;
        e += 1;
    }
    return uintBitsToFloat((uint(e) << 23) | (uint(N) & 0x7FFFFFu));
}

// roundf (ties away from zero) of a finite float, with the reference's operations
// (sign(p) * (floor(|p|) + floor(2 * (|p| - floor(|p|)))): each step is exact).
float hz_round_half_away(float p) {
    precise float a = abs(p);
    precise float fl = floor(a);
    precise float fr = a - fl;
    precise float r = fl + floor(2.0 * fr);
    return p < 0.0 ? -r : r;
}

// x * 2^100 from the bits of x, for |x| < 2^-100 (exact: no float operand is subnormal).
float hz_scale_up_100(uint u) {
    uint e = (u >> 23) & 0xFFu;
    if (e != 0u) return uintBitsToFloat(u + (100u << 23));
    precise float v = float(u & 0x7FFFFFu) * uintBitsToFloat(78u << 23);  // mantissa * 2^-49
    return (u >> 31) != 0u ? -v : v;
}

// The 36-byte q8_1 block of the 32 float32 values with bits u, as 9 words.
void hz_quantize_q8_1(in uint u[32], out uint words[9]) {
    uint amax = 0u;
    bool nan = false;
    for (uint i = 0u; i < 32u; ++i) {
        uint a = u[i] & 0x7FFFFFFFu;
        nan = nan || a > 0x7F800000u;
        amax = max(amax, a);
    }
    for (uint i = 1u; i < 9u; ++i) words[i] = 0u;
    if (nan) {
        words[0] = 0x7E00u | (0x7E00u << 16);
        return;
    }
    if (amax == 0x7F800000u) {
        words[0] = 0x7C00u | (0xFE00u << 16);
        return;
    }
    if (amax == 0u) {
        words[0] = 0u;
        return;
    }
    float d, id;       // the scale and its reciprocal; both scaled by 2^100 in a tiny block
    bool tiny = amax < (27u << 23);  // amax < 2^-100
    float v[32];
    if (!tiny) {
        d = hz_div_rn(uintBitsToFloat(amax), 127.0);
        id = hz_div_rn(1.0, d);
        for (uint i = 0u; i < 32u; ++i) v[i] = uintBitsToFloat(u[i]);
    } else {
        // amax = M * 2^-149 exactly
        uint e = amax >> 23;
        uint64_t M = e == 0u ? uint64_t(amax) : uint64_t((amax & 0x7FFFFFu) | 0x800000u) << (e - 1u);
        uint64_t D = 0ul;  // d = D * 2^-149 when d is subnormal
        if (M < 127ul * 0x800000ul) {
            D = M / 127ul + (M % 127ul >= 64ul ? 1ul : 0ul);  // 127 is odd: no ties
            precise float dd = float(uint(D)) * uintBitsToFloat(78u << 23);
            d = dd;
        } else {
            d = hz_div_rn(hz_scale_up_100(amax), 127.0);
        }
        // d <= 2^-128 (D <= 2^21, zero included) makes 1/d overflow: every code is 0 and both
        // fields round to +0
        if (M < 127ul * 0x800000ul && D <= (1ul << 21)) {
            words[0] = 0u;
            return;
        }
        id = hz_div_rn(1.0, d);
        for (uint i = 0u; i < 32u; ++i) v[i] = hz_scale_up_100(u[i]);
    }
    int sum = 0;
    for (uint i = 0u; i < 32u; ++i) {
        precise float p = v[i] * id;
        int q = int(clamp(hz_round_half_away(p), -128.0, 127.0));
        sum += q;
        words[1u + i / 4u] |= uint(q & 0xFF) << (8u * (i % 4u));
    }
    uint dh, sh;
    if (!tiny) {
        precise float s = float(sum) * d;
        dh = hz_float_to_half(d);
        sh = hz_float_to_half(s);
    } else {  // d < 2^-100: both fields are zeros, s with the sign of the sum
        dh = 0u;
        sh = sum < 0 ? 0x8000u : 0u;
    }
    words[0] = dh | (sh << 16);
}

#endif  // HZ_Q8_1_GLSL
