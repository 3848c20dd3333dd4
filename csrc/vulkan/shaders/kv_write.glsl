// Writing one cache row: the q8_0 quantizer shared by kv_cache_write.comp and
// qk_norm_rope_kv_write.comp (ggml's quantize_row_q8_0_ref: per block of 32, d = amax / 127
// stored as f16, q = roundf(x / d) clipped to [-128, 127]). Needs fused.glsl.

// a / b correctly rounded (round to nearest even), as IEEE division on the CPU: Vulkan lets a
// driver's division be off by 2.5 ulp. Integer long division of the 24-bit significands; zero,
// subnormal, infinite or NaN operands and results outside the normal range use the driver's
// division (exact there for zeros, infinities and NaN; q8_0 scales are never that small).
float fz_div(float a, float b) {
    const uint ua = floatBitsToUint(a), ub = floatBitsToUint(b);
    const int ea = int((ua >> 23) & 0xffu), eb = int((ub >> 23) & 0xffu);
    if (ea == 0 || ea == 255 || eb == 0 || eb == 255) return a / b;
    const uint64_t ma = uint64_t((ua & 0x7fffffu) | 0x800000u), mb = uint64_t((ub & 0x7fffffu) | 0x800000u);
    const uint64_t num = ma << 40, quo = num / mb;  // quo in [2^39, 2^41)
    const bool rest = quo * mb != num;
    const uint shift = quo >= (uint64_t(1) << 40) ? 17u : 16u;
    uint m = uint(quo >> shift);
    const uint64_t low = quo & ((uint64_t(1) << shift) - 1ul), halfway = uint64_t(1) << (shift - 1u);
    if (low > halfway || (low == halfway && (rest || (m & 1u) != 0u))) ++m;
    const int e = int(shift) - 40 + ea - eb;  // a / b = m * 2^e
    // the result's biased exponent: m in [2^23, 2^24] scaled by 2^e
    const int biased = e + 150 + (m == 0x1000000u ? 1 : 0);
    if (biased <= 0 || biased >= 255) return a / b;
    const uint bits = (m == 0x1000000u ? 0u : (m & 0x7fffffu)) | (uint(biased) << 23);
    return uintBitsToFloat(bits | ((ua ^ ub) & 0x80000000u));
}

// ggml roundf: half-way cases away from zero
float fz_roundf(float v) {
    const float t = trunc(v);
    return abs(v - t) >= 0.5 ? t + sign(v) : t;
}

// Block blk of a q8_0 row at dst from its 32 float32 values x.
void fz_store_q8_0_block(uint64_t dst, uint blk, float x[32]) {
    float amax = 0.0;
    for (uint j = 0u; j < 32u; ++j) {
        const float a = abs(x[j]);
        if (a > amax || isnan(a)) amax = a;  // a NaN stays (torch's amax propagates it)
        if (isnan(amax)) break;
    }
    const float d = fz_div(amax, 127.0);
    const float id = d == 0.0 ? 0.0 : fz_div(1.0, d);
    U16Ptr(dst).v[blk * (HZ_Q8_0_BYTES / 2u)] = uint16_t(fz_float_to_half(d));
    for (uint j = 0u; j < 32u; ++j) {
        // precise: a fused multiply-add here rounds once, which turns some products into .5 ties
        // (or out of them) and moves a code by one against the CPU's separately rounded product
        precise float xs = x[j] * id;
        const float r = fz_roundf(xs);
        const int q = isnan(r) || isinf(r) ? 0 : int(clamp(r, -128.0, 127.0));
        I8Ptr(dst).v[blk * HZ_Q8_0_BYTES + 2u + j] = int8_t(q);
    }
}
