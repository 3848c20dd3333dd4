// Mat-vec (decode, small M) kernels over the Hooks of kernels.h. Included by kernels.h inside
// namespace hz_<isa>, SIMD path only (HZ_ISA >= 1).

// Mat-vec for MR (1..4) activation rows: each weight block is unpacked once and dotted with
// all MR rows. Rows n0..n1 of W.
template <class T, int MR>
static void matvec_tile(const uint8_t* W, int64_t rb, int64_t n0, int64_t n1, const HzAct* a, int64_t m0,
                        float* y, int64_t ldy) {
    typedef Hooks<T> H;
    const int64_t K = a->K, nb = K / T::QK;
    const int8_t* xq[MR]; const float* xd[MR]; const int16_t* xs[MR];
    for (int m = 0; m < MR; ++m) {
        xq[m] = a->q + (m0 + m) * K; xd[m] = a->d + (m0 + m) * nb; xs[m] = a->s + (m0 + m) * (K / 16);
    }
    const __m256i ones = _mm256_load_si256(hz_ones16());
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = W + n * rb;
        __m256 acc[MR];
        float accs[MR];
        for (int m = 0; m < MR; ++m) { acc[m] = _mm256_setzero_ps(); accs[m] = 0.f; }
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = row + b * T::BYTES;
            for (int off = 0; off < T::BYTES; off += 64) _mm_prefetch((const char*)(blk + hz_prefetch_bytes + off), _MM_HINT_T0);
            typename H::Prep p;
            H::prep(blk, p);
            if constexpr (T::QK == 32) {
                __m256i q = H::chunk(blk, p, 0);
                for (int m = 0; m < MR; ++m) {
                    __m256i x = _mm256_loadu_si256((const __m256i*)(xq[m] + b * 32));
                    __m256i is = dot_acc<H::SIGNED>(_mm256_setzero_si256(), q, x, ones);
                    float dx = xd[m][b];
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_set1_ps(p.d * dx), acc[m]);
                    if constexpr (H::HAS_MIN) accs[m] += p.dmin * dx * (float)(xs[m][2 * b] + xs[m][2 * b + 1]);
                }
            } else {
                __m256i is[MR];
                for (int m = 0; m < MR; ++m) is[m] = _mm256_setzero_si256();
                const ScaleLanes sl = scale_lanes(p.sc16);
                for (int c = 0; c < T::QK / 32; ++c) {
                    __m256i q = H::chunk(blk, p, c);
                    __m256i s = scvec_fast(sl, c);
                    for (int m = 0; m < MR; ++m)
                        is[m] = dot_acc<H::SIGNED>(is[m], q, _mm256_loadu_si256((const __m256i*)(xq[m] + b * T::QK + 32 * c)), s);
                }
                for (int m = 0; m < MR; ++m) {
                    float dx = xd[m][b];
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[m]), _mm256_set1_ps(p.d * dx), acc[m]);
                    if constexpr (H::HAS_MIN) {
                        __m256i mm = _mm256_madd_epi16(p.mn16, _mm256_loadu_si256((const __m256i*)(xs[m] + b * 16)));
                        acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mm), _mm256_set1_ps(p.dmin * dx), acc[m]);
                    }
                }
            }
        }
        for (int m = 0; m < MR; ++m) y[(m0 + m) * ldy + n] = hsum8(acc[m]) - accs[m];
    }
}

template <class T>
static void matvec_simd(const uint8_t* W, int64_t rb, int64_t n0, int64_t n1, const HzAct* a, int64_t M,
                        float* y, int64_t ldy) {
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) matvec_tile<T, 4>(W, rb, n0, n1, a, m0, y, ldy);
    switch (M - m0) {
        case 3: matvec_tile<T, 3>(W, rb, n0, n1, a, m0, y, ldy); break;
        case 2: matvec_tile<T, 2>(W, rb, n0, n1, a, m0, y, ldy); break;
        case 1: matvec_tile<T, 1>(W, rb, n0, n1, a, m0, y, ldy); break;
        default: break;
    }
}
