// Mat-vec over weights stored as row-interleaved panels (hz_panel_fn in hz_api.h), built once at
// load. Included by kernels.h inside namespace hz_<isa>, SIMD path only (HZ_ISA >= 1).
//
// Q4_K panels ("Q4_K x 8"): 8 consecutive weight rows per group; per group and 256-value block
// HZ_Q4K_PANEL_BYTES (1184) bytes, the blocks of a group one after another, the groups in row order.
// Offsets (hz_api.h) in the order the kernel reads them:
//   [0, 64)       the 6-bit scales, decoded: byte 8s + r = scale of sub-block s of row r
//   [64, 128)     the 6-bit mins, decoded: byte 16q + 2r + e = min of sub-block 2q + e of row r
//   [128, 144)    d of rows 0..7 (fp16), [144, 160) dmin of rows 0..7 (fp16)
//   [160, 1184)   qs: for nibble byte pair j (0..3) and 4-byte group g (0..7), 32 bytes whose
//                 32-bit lane r is bytes 32j + 4g .. 32j + 4g + 3 of row r's qs (low nibbles:
//                 sub-block 2j, high nibbles: sub-block 2j + 1)
// The header comes first and is read first, so each thread's demand loads walk its panels in
// address order: with the header after the qs (the kernel jumping 1 KiB ahead and back in every
// block), a token's mat-vecs read 0.78 of a plain read's bandwidth in the fast-memory minutes of
// a Zen 4 box, against 0.85 header first (ffn_down Q4_K 37.0 -> 45.0 GB/s, gate+up 46.8 -> 53.0;
// 15 / 16 rounds in alternated processes); in the slow minutes 0.95 -> 0.97.
// (1184 bytes against the 8 x 144 of the rows: +2.8%.) One 256-bit load then feeds 8 rows: the
// activation's 4 bytes are broadcast once per load and the accumulator's lanes are output rows,
// so the scales, mins and float fix-up run once per 8 rows and no horizontal sum is needed.
// The integers and the float steps are gemm_il_q4k's (kernels_gemm.h), which repacks the rows to
// the same lanes per call, including its K panels of hz_gemm_kc values: a row's result is the same
// bits as that GEMM gives it.

template <int MR>
static void panels_q4k_tile(const uint8_t* P, int64_t K, int64_t n0, int64_t n1, const HzAct* a, int64_t m0,
                            float* y, int64_t ldy) {
    const int64_t nb = K / 256, gstride = nb * HZ_Q4K_PANEL_BYTES;
    const int64_t KB = hz_min<int64_t>(nb, hz_gemm_kc / 256 > 0 ? hz_gemm_kc / 256 : 1);
    // A group's pass reads 4.6 K bytes of panels and 1.1 K of activation (q8, sums per 16): from
    // K = 4096 on that passes a 32 KiB L1, and the panels streaming through it evict the activation
    // before the next group comes back to it. Prefetching the next block's activation into L1 then
    // keeps its loads off L2 (Zen 4, ffn_down [1536, 8960], fast minutes: avx512 level 46.8 -> 50.9
    // GB/s in 73 rounds, avx2 level 43.1 -> 46.9 in 67).
    const bool act_pf = hz_prefetch_act && K >= 4096;
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i ones = _mm256_load_si256(hz_ones16());
    const int8_t* xq[MR]; const float* xd[MR]; const int16_t* xs[MR];
    for (int m = 0; m < MR; ++m) {
        xq[m] = a->q + (m0 + m) * K; xd[m] = a->d + (m0 + m) * nb; xs[m] = a->s + (m0 + m) * (K / 16);
    }
    // The min term's activation side, once per call rather than once per 8-row group and block:
    // the activation's sums over sub-blocks 2q and 2q + 1 as an int16 pair in 32-bit word q
    // (16 bytes per block, half the sums they come from; the K >= 4096 prefetch below fetches
    // only the int8 values). Zen 4, one
    // thread, 2 MB of gate panels from L2/L3: 39.1 -> 40.1 GB/s on avx2, 42.9 -> 44.2 on avx512.
    constexpr int64_t XP_STACK = 256;  // blocks (K <= 65536) whose pairs live on the stack
    alignas(16) __m128i xp_stack[MR * XP_STACK];
    __m128i* xpv = nb <= XP_STACK ? xp_stack : (__m128i*)aligned_alloc(16, sizeof(__m128i) * MR * nb);
    for (int m = 0; m < MR; ++m)
        for (int64_t b = 0; b < nb; ++b) {
            const __m256i t = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(xs[m] + b * 16)), ones);
            xpv[m * nb + b] = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packs_epi32(t, t), 0x08));
        }
    for (int64_t grp = n0 / 8; grp * 8 < n1; ++grp) {
        const uint8_t* pg = P + grp * gstride;
        for (int64_t kp = 0; kp < nb; kp += KB) {
            const int64_t ke = hz_min<int64_t>(nb, kp + KB);
            __m256 acc[MR];
            for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
            for (int64_t b = kp; b < ke; ++b) {
                const uint8_t* pb = pg + b * HZ_Q4K_PANEL_BYTES;
                if (hz_prefetch_panels) hz_prefetch_stream(a, pb, HZ_Q4K_PANEL_BYTES);  // off by default (ops.cpp)
                if (act_pf && b + 1 < nb)
                    for (int m = 0; m < MR; ++m) {
                        const char* xn = (const char*)(xq[m] + (b + 1) * 256);
                        _mm_prefetch(xn, _MM_HINT_T0); _mm_prefetch(xn + 64, _MM_HINT_T0);
                        _mm_prefetch(xn + 128, _MM_HINT_T0); _mm_prefetch(xn + 192, _MM_HINT_T0);
                    }
                // the block's header (mins, d, dmin) read before its qs: the weight stream in address order
                const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(pb + HZ_Q4K_PANEL_D)));
                const __m256 dm8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(pb + HZ_Q4K_PANEL_DM)));
                __m256i mn[4];
                for (int q = 0; q < 4; ++q) mn[q] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(pb + HZ_Q4K_PANEL_MN + 16 * q)));
                __m256i is[MR];
                for (int m = 0; m < MR; ++m) is[m] = _mm256_setzero_si256();
                for (int j = 0; j < 4; ++j) {
                    const __m256i* wq = (const __m256i*)(pb + HZ_Q4K_PANEL_QS + 256 * j);
#if HZ_ISA >= 2
                    // two accumulators per sub-block (even and odd groups): half the vpdpbusd chain's latency
                    __m256i slo[2][MR], shi[2][MR];
                    for (int m = 0; m < MR; ++m) slo[0][m] = shi[0][m] = slo[1][m] = shi[1][m] = _mm256_setzero_si256();
                    for (int g = 0; g < 8; ++g) {
                        const __m256i w = _mm256_loadu_si256(wq + g);
                        const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
                        for (int m = 0; m < MR; ++m) {
                            const uint8_t* xb = (const uint8_t*)(xq[m] + b * 256 + 64 * j + 4 * g);
                            slo[g & 1][m] = _mm256_dpbusd_epi32(slo[g & 1][m], lo, _mm256_set1_epi32((int)rd_u32(xb)));
                            shi[g & 1][m] = _mm256_dpbusd_epi32(shi[g & 1][m], hi, _mm256_set1_epi32((int)rd_u32(xb + 32)));
                        }
                    }
                    for (int m = 0; m < MR; ++m) {
                        slo[0][m] = _mm256_add_epi32(slo[0][m], slo[1][m]);
                        shi[0][m] = _mm256_add_epi32(shi[0][m], shi[1][m]);
                    }
                    const __m256i sl = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(pb + HZ_Q4K_PANEL_SC + 16 * j)));
                    const __m256i sh = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(pb + HZ_Q4K_PANEL_SC + 16 * j + 8)));
                    for (int m = 0; m < MR; ++m)
                        is[m] = _mm256_add_epi32(_mm256_add_epi32(is[m], _mm256_mullo_epi32(slo[0][m], sl)),
                                                 _mm256_mullo_epi32(shi[0][m], sh));
#else
                    // int16 sums of the 8 vpmaddubsw per sub-block are exact (|sum| <= 8 * 2 * 15 * 128)
                    __m256i slo[MR], shi[MR];
                    for (int m = 0; m < MR; ++m) slo[m] = shi[m] = _mm256_setzero_si256();
                    for (int g = 0; g < 8; ++g) {
                        const __m256i w = _mm256_loadu_si256(wq + g);
                        const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
                        for (int m = 0; m < MR; ++m) {
                            const uint8_t* xb = (const uint8_t*)(xq[m] + b * 256 + 64 * j + 4 * g);
                            slo[m] = _mm256_add_epi16(slo[m], _mm256_maddubs_epi16(lo, _mm256_set1_epi32((int)rd_u32(xb))));
                            shi[m] = _mm256_add_epi16(shi[m], _mm256_maddubs_epi16(hi, _mm256_set1_epi32((int)rd_u32(xb + 32))));
                            __asm__("" : "+x"(slo[m]), "+x"(shi[m]));  // keep the chains (see gemm_il_q4k)
                        }
                    }
                    __m256i sl = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(pb + HZ_Q4K_PANEL_SC + 16 * j)));
                    __m256i sh = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(pb + HZ_Q4K_PANEL_SC + 16 * j + 8)));
                    sl = _mm256_or_si256(sl, _mm256_slli_epi32(sl, 16));  // the scale in both int16 halves
                    sh = _mm256_or_si256(sh, _mm256_slli_epi32(sh, 16));
                    for (int m = 0; m < MR; ++m)
                        is[m] = _mm256_add_epi32(_mm256_add_epi32(is[m], _mm256_madd_epi16(slo[m], sl)),
                                                 _mm256_madd_epi16(shi[m], sh));
#endif
                }
                for (int m = 0; m < MR; ++m) {
                    const __m256i xp = _mm256_broadcastsi128_si256(xpv[m * nb + b]);
                    __m256i ms = _mm256_madd_epi16(mn[0], _mm256_shuffle_epi32(xp, 0x00));
                    ms = _mm256_add_epi32(ms, _mm256_madd_epi16(mn[1], _mm256_shuffle_epi32(xp, 0x55)));
                    ms = _mm256_add_epi32(ms, _mm256_madd_epi16(mn[2], _mm256_shuffle_epi32(xp, 0xaa)));
                    ms = _mm256_add_epi32(ms, _mm256_madd_epi16(mn[3], _mm256_shuffle_epi32(xp, 0xff)));
                    const __m256 dx = _mm256_broadcast_ss(xd[m] + b);
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[m]), _mm256_mul_ps(d8, dx), acc[m]);
                    acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_mul_ps(dm8, dx), acc[m]);
                }
            }
            const int64_t r0 = n0 > grp * 8 ? n0 - grp * 8 : 0;
            const int64_t r1 = hz_min<int64_t>(8, n1 - grp * 8);
            for (int m = 0; m < MR; ++m) {
                alignas(32) float o[8];
                _mm256_store_ps(o, acc[m]);
                float* dst = y + (m0 + m) * ldy + grp * 8 - n0;
                for (int64_t r = r0; r < r1; ++r) dst[r] = kp == 0 ? o[r] : dst[r] + o[r];
            }
        }
    }
    if (xpv != xp_stack) free(xpv);
}

// y[m * ldy + n - n0] for n in [n0, n1) (rows of the panels P of a [N, K] Q4_K weight, N a
// multiple of 8), m in [0, M). Groups that [n0, n1) covers in part are computed whole and stored in part.
static void matvec_panels_q4k(const uint8_t* P, int64_t K, int64_t n0, int64_t n1, const HzAct* a, int64_t M,
                              float* y, int64_t ldy) {
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) panels_q4k_tile<4>(P, K, n0, n1, a, m0, y, ldy);
    switch (M - m0) {
        case 3: panels_q4k_tile<3>(P, K, n0, n1, a, m0, y, ldy); break;
        case 2: panels_q4k_tile<2>(P, K, n0, n1, a, m0, y, ldy); break;
        case 1: panels_q4k_tile<1>(P, K, n0, n1, a, m0, y, ldy); break;
        default: break;
    }
}

// Q6_K planes ("Q6_K planes", the avx2 level's panels of Q6_K): the rows' own order and size, 210
// bytes per 256-value block, each block with its half h (values 128h .. 128h + 127, chunks k = 0..3
// of 32 values each) in bytes [96h, 96h + 96) as three 32-byte planes j = 0..2:
//   plane j byte l = q(128h + 32j + l) | ((q(128h + 96 + l) >> 2j) & 3) << 6
// with q the unsigned six-bit value (0..63) of the rows (ql's nibble | qh's pair << 4); the scales
// and d stay at the rows' offsets [192, 210). A half's four chunks then take 11 vector ops (a mask
// each for chunks 0-2; three masks, three shifts and two ors for chunk 3) against 17 from ql and qh, in a kernel that
// on AVX2 runs out of instructions before memory (one thread, L2-resident [512, 1536], Zen 4:
// 26-28 GB/s of rows, 32-33 of planes). The integers are the rows' (Hooks<FQ6_KP>), so a row's
// result is the bits the rows give it.
// y[m * ldy + n - n0] for n in [n0, n1) (rows of the planes P of a [N, K] Q6_K weight), m in [0, M).
static void matvec_planes_q6k(const uint8_t* P, int64_t K, int64_t n0, int64_t n1, const HzAct* a, int64_t M,
                              float* y, int64_t ldy) {
    const int64_t rb = K / 256 * FQ6_K::BYTES;
    matvec_simd<FQ6_KP>(P + n0 * rb, rb, 0, n1 - n0, a, M, y, ldy);
}
