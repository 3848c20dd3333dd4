// CPU kernels of the small fused transformer ops (hanzo::rms_norm, add_rms_norm, qk_norm_rope,
// swiglu, kv_cache_write, qk_norm_rope_kv_write, attention, moe_route). Each is one pass of plain
// loops over rows in float32 (f16/bf16 inputs are converted per element, results rounded once to the input dtype),
// with the same maths as the references in hanzo_torch/ops/fused.py. The KV cache may be float32,
// float16, bfloat16 or q8_0 blocks whatever the activation dtype (see "KV cache element formats").
// Attention runs as flash-style tiles (attention_flash): query tiles x key tiles with an online
// softmax, each key tile read from the cache once (converted to float32 once) for a tile of tokens
// and all the query heads of its group; one query token (decode) is a tile of the G heads of a
// group, its key range split into units for the threads. Two other kernels stay selectable in
// process for A/B: of prompts, two ATen/BLAS GEMMs per token tile on a float32 copy of the live
// prefix (set_attention_prefill); of one token, split-K over one key or value row at a time
// (attention_decode, set_attention_decode).
//
// Registered with the torch dispatcher as the namespace ``hanzo_cpu`` (so this file needs no hook in
// the pybind module of ops.cpp); hanzo_torch/backends/cpu/fused.py calls them after the op wrappers in
// hanzo_torch/ops/fused.py have checked shapes and dtypes. The kernels re-check what guards memory
// (shapes, position bounds) and make their inputs contiguous.
//
// Threading: decode shapes are a few thousand floats per op, where waking the intra-op pool costs
// more than the work, so a parallel region (hz_run_tasks of threading.h: each thread's own range of
// tasks, then the others', run serially while the adaptive controller holds regions serial) is opened only above
// kParallelWork floats of work; attention only above ~4 MFLOP (attention_decode: kAttnParallelWork). No split depends
// on the thread count, so results are the same bits with any number of threads.
#include <torch/library.h>
#include "../common/hz_constants.h"
#include "hz_api.h"
#include "threading.h"
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <limits>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kParallelWork = 1 << 16;  // floats touched below which one thread does the op
// Decode attention: work (keys x D x (2G + 1)) below which one thread does it, ~0.5 M multiply-adds
// (tens of microseconds; a context of ~160 for 12 query heads on 2 KV heads of 128): below it a
// fork-join per layer saves little on an idle machine and risks a wait on a busy one.
constexpr int64_t kAttnParallelWork = 1 << 19;
constexpr int64_t kAttnTileMinT = 8;        // attention: query tokens from which the GEMM tiles run
constexpr int64_t kAttnTileRows = 192;      // attention: query rows (heads x tokens) per GEMM tile
constexpr int64_t kAttnChunk = 256;         // attention: keys per decode work unit (split-K)


template <typename T>
inline float ld(T v) { return static_cast<float>(v); }
template <typename T>
inline T st(float v) { return static_cast<T>(v); }

// Runs body(i0, i1) over [0, n): inline when the total work (n * per_item floats) is small, else in
// tasks of ~kParallelWork/4 floats (hz_run_tasks: each thread's own range first, then the others').
template <typename F>
void for_rows(int64_t n, int64_t per_item, const F& body) {
    if (n <= 0) return;
    if (n * std::max<int64_t>(per_item, 1) < kParallelWork || at::get_num_threads() == 1) {
        body(0, n);
        return;
    }
    const int64_t grain = std::max<int64_t>(1, kParallelWork / 4 / std::max<int64_t>(per_item, 1));
    hz_run_tasks((n + grain - 1) / grain, at::get_num_threads(),
                 [&](int64_t i) { body(i * grain, std::min(n, (i + 1) * grain)); });
}

// 8 independent partial sums so the compiler can vectorize the reduction.
inline float dot_f32(const float* a, const float* b, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

inline float sumsq_f32(const float* a, int64_t n) { return dot_f32(a, a, n); }

// A norm weight as float32 values: read in place when it is contiguous float32 (no copy, no
// dispatcher call), else a converted copy that this object keeps.
struct WeightF32 {
    at::Tensor own;
    const float* p = nullptr;
    explicit WeightF32(const at::Tensor& w) {
        own = w.scalar_type() == at::kFloat && w.is_contiguous() ? w : w.to(at::kFloat).contiguous();
        p = own.data_ptr<float>();
    }
    const float* data() const { return p; }
};

void check_cpu(const at::Tensor& t, const char* op, const char* name) {
    TORCH_CHECK(t.device().is_cpu(), "hanzo_cpu.", op, ": ", name, " must be a CPU tensor");
}

// y = x * rsqrt(mean(x^2) + eps) * w over one row of H floats (in place allowed).
inline void norm_row(const float* x, const float* w, float eps, int64_t H, float* y) {
    const float inv = 1.0f / std::sqrt(sumsq_f32(x, H) / static_cast<float>(H) + eps);
    for (int64_t i = 0; i < H; ++i) y[i] = (x[i] * inv) * w[i];
}

// ---------------------------------------------------------------------------------------------
// rms_norm / add_rms_norm
// ---------------------------------------------------------------------------------------------
// out: where the result goes (a defined tensor of x's shape and dtype, contiguous), else a new one.
at::Tensor rms_norm_out(const at::Tensor& x_in, const at::Tensor& w, double eps, const at::Tensor* out) {
    check_cpu(x_in, "rms_norm", "x");
    TORCH_CHECK(w.dim() == 1 && x_in.dim() >= 1 && w.size(0) == x_in.size(-1), "hanzo_cpu.rms_norm: w must be [H]");
    const at::Tensor x = x_in.contiguous();
    at::Tensor y = out ? *out : at::empty_like(x);
    const int64_t H = x.size(-1), R = H ? x.numel() / H : 0;
    const WeightF32 wf(w);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "hanzo_cpu_rms_norm", [&] {
        const scalar_t* xp = x.data_ptr<scalar_t>();
        scalar_t* yp = y.data_ptr<scalar_t>();
        for_rows(R, H, [&](int64_t r0, int64_t r1) {
            if constexpr (std::is_same_v<scalar_t, float>) {  // float32 rows are normed in place, no copy
                const float* xf = reinterpret_cast<const float*>(xp);
                float* yf = reinterpret_cast<float*>(yp);
                for (int64_t r = r0; r < r1; ++r) norm_row(xf + r * H, wf.data(), static_cast<float>(eps), H, yf + r * H);
                return;
            }
            std::vector<float> buf(H);
            for (int64_t r = r0; r < r1; ++r) {
                for (int64_t i = 0; i < H; ++i) buf[i] = ld(xp[r * H + i]);
                norm_row(buf.data(), wf.data(), static_cast<float>(eps), H, buf.data());
                for (int64_t i = 0; i < H; ++i) yp[r * H + i] = st<scalar_t>(buf[i]);
            }
        });
    });
    return y;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) { return rms_norm_out(x, w, eps, nullptr); }

// y_out / s_out: where the results go (defined, x's shape and dtype, contiguous), else new tensors.
std::tuple<at::Tensor, at::Tensor> add_rms_norm_out(const at::Tensor& x_in, const at::Tensor& r_in, const at::Tensor& w,
                                                    double eps, const at::Tensor* y_out, const at::Tensor* s_out) {
    check_cpu(x_in, "add_rms_norm", "x");
    TORCH_CHECK(x_in.sizes() == r_in.sizes() && x_in.scalar_type() == r_in.scalar_type(),
                "hanzo_cpu.add_rms_norm: x and residual must match");
    TORCH_CHECK(w.dim() == 1 && x_in.dim() >= 1 && w.size(0) == x_in.size(-1), "hanzo_cpu.add_rms_norm: w must be [H]");
    const at::Tensor x = x_in.contiguous(), res = r_in.contiguous();
    at::Tensor y = y_out ? *y_out : at::empty_like(x), s = s_out ? *s_out : at::empty_like(x);
    const int64_t H = x.size(-1), R = H ? x.numel() / H : 0;
    const WeightF32 wf(w);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "hanzo_cpu_add_rms_norm", [&] {
        const scalar_t* xp = x.data_ptr<scalar_t>();
        const scalar_t* rp = res.data_ptr<scalar_t>();
        scalar_t* yp = y.data_ptr<scalar_t>();
        scalar_t* sp = s.data_ptr<scalar_t>();
        for_rows(R, 3 * H, [&](int64_t r0, int64_t r1) {
            if constexpr (std::is_same_v<scalar_t, float>) {  // float32: the sum is normed where it is stored
                const float* xf = reinterpret_cast<const float*>(xp);
                const float* rf = reinterpret_cast<const float*>(rp);
                float* sf = reinterpret_cast<float*>(sp);
                float* yf = reinterpret_cast<float*>(yp);
                for (int64_t r = r0; r < r1; ++r) {
                    for (int64_t i = 0; i < H; ++i) sf[r * H + i] = xf[r * H + i] + rf[r * H + i];
                    norm_row(sf + r * H, wf.data(), static_cast<float>(eps), H, yf + r * H);
                }
                return;
            }
            std::vector<float> buf(H);
            for (int64_t r = r0; r < r1; ++r) {
                for (int64_t i = 0; i < H; ++i) {
                    // the sum is rounded to the activation dtype (as x + residual is), then normed
                    const scalar_t si = st<scalar_t>(ld(xp[r * H + i]) + ld(rp[r * H + i]));
                    sp[r * H + i] = si;
                    buf[i] = ld(si);
                }
                norm_row(buf.data(), wf.data(), static_cast<float>(eps), H, buf.data());
                for (int64_t i = 0; i < H; ++i) yp[r * H + i] = st<scalar_t>(buf[i]);
            }
        });
    });
    return {y, s};
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w,
                                                double eps) {
    return add_rms_norm_out(x, r, w, eps, nullptr, nullptr);
}

// ---------------------------------------------------------------------------------------------
// swiglu
// ---------------------------------------------------------------------------------------------
at::Tensor swiglu(const at::Tensor& g_in, const at::Tensor& u_in) {
    check_cpu(g_in, "swiglu", "gate");
    TORCH_CHECK(g_in.sizes() == u_in.sizes() && g_in.scalar_type() == u_in.scalar_type(),
                "hanzo_cpu.swiglu: gate and up must match");
    const at::Tensor g = g_in.contiguous(), u = u_in.contiguous();
    at::Tensor y = at::empty_like(g);
    const int64_t n = g.numel();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "hanzo_cpu_swiglu", [&] {
        const scalar_t* gp = g.data_ptr<scalar_t>();
        const scalar_t* up = u.data_ptr<scalar_t>();
        scalar_t* yp = y.data_ptr<scalar_t>();
        // weight 4 per element: the exp costs a few loads and stores even 8 lanes at a time
        for_rows(n, 4, [&](int64_t i0, int64_t i1) {
            if constexpr (std::is_same_v<scalar_t, float>) {
                hz_silu_mul(reinterpret_cast<const float*>(gp) + i0, reinterpret_cast<const float*>(up) + i0,
                            reinterpret_cast<float*>(yp) + i0, i1 - i0);
            } else {
                float a[256], b[256];
                for (int64_t c0 = i0; c0 < i1; c0 += 256) {
                    const int64_t c = std::min<int64_t>(256, i1 - c0);
                    for (int64_t j = 0; j < c; ++j) { a[j] = ld(gp[c0 + j]); b[j] = ld(up[c0 + j]); }
                    hz_silu_mul(a, b, a, c);
                    for (int64_t j = 0; j < c; ++j) yp[c0 + j] = st<scalar_t>(a[j]);
                }
            }
        });
    });
    return y;
}

// ---------------------------------------------------------------------------------------------
// qk_norm_rope
// ---------------------------------------------------------------------------------------------
at::Tensor positions_long(const at::Tensor& p) {
    return p.scalar_type() == at::kLong && p.is_contiguous() ? p : p.to(at::kLong).contiguous();
}

// inv_freq[i] = 1 / theta^(2i/D), i < D/2, every step in float32 as the reference (torch)
// computes it; the last (theta, D) asked for on this thread is kept, since a model asks for one.
const std::vector<float>& rope_inv_freq(float theta, int64_t D) {
    thread_local float cached_theta = 0.0f;
    thread_local std::vector<float> inv_freq;
    if (cached_theta != theta || static_cast<int64_t>(inv_freq.size()) != D / 2) {
        inv_freq.resize(static_cast<size_t>(D / 2));
        for (int64_t i = 0; i < D / 2; ++i) {
            const float e = static_cast<float>(2 * i) / static_cast<float>(D);
            inv_freq[i] = 1.0f / std::pow(theta, e);
        }
        cached_theta = theta;
    }
    return inv_freq;
}

// q_out: where the rotated q goes (defined, q's shape and dtype, contiguous), else a new tensor.
std::tuple<at::Tensor, at::Tensor> qk_norm_rope_out(const at::Tensor& q_in, const at::Tensor& k_in,
                                                    const std::optional<at::Tensor>& q_w,
                                                    const std::optional<at::Tensor>& k_w, const at::Tensor& positions,
                                                    double theta, double eps, const at::Tensor* q_out) {
    check_cpu(q_in, "qk_norm_rope", "q");
    TORCH_CHECK(q_in.dim() == 4 && k_in.dim() == 4 && q_in.scalar_type() == k_in.scalar_type(),
                "hanzo_cpu.qk_norm_rope: q and k must be [B, T, H, D] of one dtype");
    const int64_t B = q_in.size(0), T = q_in.size(1), Hq = q_in.size(2), D = q_in.size(3), Hk = k_in.size(2);
    TORCH_CHECK(k_in.size(0) == B && k_in.size(1) == T && k_in.size(3) == D && D % 2 == 0,
                "hanzo_cpu.qk_norm_rope: k does not match q, or odd head dim");
    TORCH_CHECK(positions.dim() == 2 && positions.size(0) == B && positions.size(1) == T,
                "hanzo_cpu.qk_norm_rope: positions must be [B, T]");
    TORCH_CHECK(q_w.has_value() == k_w.has_value(), "hanzo_cpu.qk_norm_rope: give both norm weights or neither");
    const bool norm = q_w.has_value();
    std::optional<WeightF32> qwf, kwf;
    if (norm) {
        TORCH_CHECK(q_w->numel() == D && k_w->numel() == D, "hanzo_cpu.qk_norm_rope: norm weights must be [D]");
        qwf.emplace(*q_w);
        kwf.emplace(*k_w);
    }
    const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), pos = positions_long(positions);
    at::Tensor qo = q_out ? *q_out : at::empty_like(q), ko = at::empty_like(k);
    const int64_t half = D / 2;
    const std::vector<float>& inv_freq = rope_inv_freq(static_cast<float>(theta), D);
    const int64_t* pp = pos.data_ptr<int64_t>();
    const float eps_f = static_cast<float>(eps);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "hanzo_cpu_qk_norm_rope", [&] {
        const scalar_t* qp = q.data_ptr<scalar_t>();
        const scalar_t* kp = k.data_ptr<scalar_t>();
        scalar_t* qop = qo.data_ptr<scalar_t>();
        scalar_t* kop = ko.data_ptr<scalar_t>();
        for_rows(B * T, (Hq + Hk) * D * 2, [&](int64_t r0, int64_t r1) {
            std::vector<float> cs(half), sn(half), buf(D);
            auto rotate = [&](const scalar_t* src, scalar_t* dst, const std::optional<WeightF32>& w) {
                for (int64_t i = 0; i < D; ++i) buf[i] = ld(src[i]);
                if (norm) norm_row(buf.data(), w->data(), eps_f, D, buf.data());
                for (int64_t i = 0; i < half; ++i) {
                    const float x1 = buf[i], x2 = buf[i + half];
                    dst[i] = st<scalar_t>(x1 * cs[i] - x2 * sn[i]);
                    dst[i + half] = st<scalar_t>(x2 * cs[i] + x1 * sn[i]);
                }
            };
            for (int64_t r = r0; r < r1; ++r) {
                const float p = static_cast<float>(pp[r]);
                for (int64_t i = 0; i < half; ++i) {
                    const float a = p * inv_freq[i];
                    cs[i] = std::cos(a);
                    sn[i] = std::sin(a);
                }
                for (int64_t h = 0; h < Hq; ++h) rotate(qp + (r * Hq + h) * D, qop + (r * Hq + h) * D, qwf);
                for (int64_t h = 0; h < Hk; ++h) rotate(kp + (r * Hk + h) * D, kop + (r * Hk + h) * D, kwf);
            }
        });
    });
    return {qo, ko};
}

std::tuple<at::Tensor, at::Tensor> qk_norm_rope(const at::Tensor& q, const at::Tensor& k,
                                                const std::optional<at::Tensor>& q_w,
                                                const std::optional<at::Tensor>& k_w, const at::Tensor& positions,
                                                double theta, double eps) {
    return qk_norm_rope_out(q, k, q_w, k_w, positions, theta, eps, nullptr);
}

// ---------------------------------------------------------------------------------------------
// KV cache element formats
// ---------------------------------------------------------------------------------------------
// A cache is float32, float16 or bfloat16 [B, S, Hk, D], or q8_0: uint8 [B, S, Hk, D/32*34], each
// row of D values stored as D/32 ggml block_q8_0 (an f16 scale d, then 32 int8 codes q; x = d*q).
// Rows are converted to float32 when read; scores, softmax and P*V are float32 for every kind.
enum class KvKind { F32, F16, BF16, Q8_0 };
constexpr int64_t kQ8Block = HZ_Q8_0_BLOCK;  // values per block_q8_0
constexpr int64_t kQ8Bytes = HZ_Q8_0_BYTES;  // bytes per block_q8_0

KvKind kv_kind(const at::Tensor& c, const char* op) {
    switch (c.scalar_type()) {
        case at::kFloat: return KvKind::F32;
        case at::kHalf: return KvKind::F16;
        case at::kBFloat16: return KvKind::BF16;
        case at::kByte: return KvKind::Q8_0;
        default: break;
    }
    TORCH_CHECK(false, "hanzo_cpu.", op, ": cache dtype ", c.scalar_type(),
                " is not float32, float16, bfloat16 or uint8 (q8_0 blocks)");
    return KvKind::F32;
}

// Bytes of one cache row of D values.
int64_t kv_row_bytes(KvKind kind, int64_t D) {
    switch (kind) {
        case KvKind::F32: return 4 * D;
        case KvKind::F16:
        case KvKind::BF16: return 2 * D;
        case KvKind::Q8_0: return hz_q8_0_row_bytes(D);
    }
    return 0;
}

// Whether a cache whose last dim is `last` holds rows of D values.
bool kv_fits(KvKind kind, int64_t last, int64_t D) {
    return kind == KvKind::Q8_0 ? D % kQ8Block == 0 && last == hz_q8_0_row_bytes(D) : last == D;
}

inline float half_bits_to_f32(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// f16 -> f32 with the F16C instructions (exact, like the scalar conversion), chosen at run time.
__attribute__((target("avx,f16c"))) void f16_row_f16c(const uint16_t* s, float* d, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
    for (; i < n; ++i) d[i] = half_bits_to_f32(s[i]);
}
bool has_f16c() {
    static const bool yes = (__builtin_cpu_init(), __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c"));
    return yes;
}
#else
void f16_row_f16c(const uint16_t*, float*, int64_t) {}
bool has_f16c() { return false; }
#endif

// The two inner loops of decode attention, per key (or value) row r of D floats, for the G query
// heads of a group: scores s[g * ss] = (q_g . r) * sc, and acc[g][:] += p[g * ps] * r.
// And the softmax numerators: s[j] = exp(s[j] - m) for j < n, returning their sum.
struct DecodeLoops {
    void (*scores)(const float* q, int64_t G, const float* r, int64_t D, float sc, float* s, int64_t ss);
    void (*pv)(const float* p, int64_t ps, int64_t G, const float* r, int64_t D, float* acc);
    float (*exp_sum)(float* s, int64_t n, float m);
};

float exp_sum_generic(float* s, int64_t n, float m) {
    float l = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
        s[j] = std::exp(s[j] - m);
        l += s[j];
    }
    return l;
}

void scores_generic(const float* q, int64_t G, const float* r, int64_t D, float sc, float* s, int64_t ss) {
    for (int64_t g = 0; g < G; ++g) s[g * ss] = dot_f32(q + g * D, r, D) * sc;
}
void pv_generic(const float* p, int64_t ps, int64_t G, const float* r, int64_t D, float* acc) {
    for (int64_t g = 0; g < G; ++g) {
        const float pg = p[g * ps];
        float* a = acc + g * D;
        for (int64_t d = 0; d < D; ++d) a[d] += pg * r[d];
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
// Four query heads per pass over the row: the row's 8-float loads are shared and the four
// accumulators are independent FMA chains.
__attribute__((target("avx2,fma"))) void scores_avx2(const float* q, int64_t G, const float* r, int64_t D, float sc,
                                                    float* s, int64_t ss) {
    if (D % 8) return scores_generic(q, G, r, D, sc, s, ss);
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) {
        const float* q0 = q + g * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t i = 0; i < D; i += 8) {
            const __m256 rv = _mm256_loadu_ps(r + i);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + i), rv, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + D + i), rv, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 2 * D + i), rv, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 3 * D + i), rv, a3);
        }
        s[g * ss] = hsum8(a0) * sc;
        s[(g + 1) * ss] = hsum8(a1) * sc;
        s[(g + 2) * ss] = hsum8(a2) * sc;
        s[(g + 3) * ss] = hsum8(a3) * sc;
    }
    for (; g < G; ++g) {
        const float* qg = q + g * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        int64_t i = 0;
        for (; i + 16 <= D; i += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), _mm256_loadu_ps(r + i), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i + 8), _mm256_loadu_ps(r + i + 8), a1);
        }
        if (i < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), _mm256_loadu_ps(r + i), a0);
        s[g * ss] = hsum8(_mm256_add_ps(a0, a1)) * sc;
    }
}
__attribute__((target("avx2,fma"))) void pv_avx2(const float* p, int64_t ps, int64_t G, const float* r, int64_t D,
                                                float* acc) {
    if (D % 8) return pv_generic(p, ps, G, r, D, acc);
    for (int64_t g = 0; g < G; ++g) {
        const __m256 pg = _mm256_set1_ps(p[g * ps]);
        float* a = acc + g * D;
        for (int64_t i = 0; i < D; i += 8)
            _mm256_storeu_ps(a + i, _mm256_fmadd_ps(pg, _mm256_loadu_ps(r + i), _mm256_loadu_ps(a + i)));
    }
}
// exp(x) for 8 lanes, x <= 0 here: 2^n * e^r with n = round(x / ln 2), |r| <= ln(2)/2, e^r by
// a degree-6 polynomial (Cephes expf coefficients; about 1 ulp). x below -87.3 gives 2^-126
// times a value near 1 instead of 0 or a denormal: nothing next to the row's maximum, e^0 = 1.
// A NaN lane stays NaN (as std::exp keeps it).
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.3f), x);  // the second operand is returned for NaN
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
__attribute__((target("avx2,fma"))) float exp_sum_avx2(float* s, int64_t n, float m) {
    const __m256 mv = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    float l = hsum8(acc);
    for (; j < n; ++j) {
        s[j] = std::exp(s[j] - m);
        l += s[j];
    }
    return l;
}
// silu(a) * b for 8 lanes (silu_mul below).
__attribute__((target("avx2,fma"))) inline __m256 silu_mul8(__m256 a, __m256 b) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 x = _mm256_or_ps(a, _mm256_set1_ps(-0.0f));  // -|a|
    const __m256 e = _mm256_and_ps(exp8(x), _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GT_OQ));
    const __m256 num = _mm256_blendv_ps(one, e, a);  // e where a's sign bit is set
    return _mm256_mul_ps(_mm256_mul_ps(a, _mm256_div_ps(num, _mm256_add_ps(one, e))), b);
}
__attribute__((target("avx2,fma"))) void silu_mul_avx2(const float* g, const float* u, float* y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < n) {  // the tail through the same lanes: an element's bits do not depend on where it sits
        alignas(32) float tg[8] = {0}, tu[8] = {0}, ty[8];
        std::memcpy(tg, g + i, (n - i) * sizeof(float));
        std::memcpy(tu, u + i, (n - i) * sizeof(float));
        _mm256_store_ps(ty, silu_mul8(_mm256_load_ps(tg), _mm256_load_ps(tu)));
        std::memcpy(y + i, ty, (n - i) * sizeof(float));
    }
}
bool has_avx2_fma() {
    static const bool yes = (__builtin_cpu_init(), __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
    return yes;
}
#else
void scores_avx2(const float* q, int64_t G, const float* r, int64_t D, float sc, float* s, int64_t ss) {
    scores_generic(q, G, r, D, sc, s, ss);
}
void pv_avx2(const float* p, int64_t ps, int64_t G, const float* r, int64_t D, float* acc) {
    pv_generic(p, ps, G, r, D, acc);
}
float exp_sum_avx2(float* s, int64_t n, float m) { return exp_sum_generic(s, n, m); }
void silu_mul_avx2(const float*, const float*, float*, int64_t) {}
bool has_avx2_fma() { return false; }
#endif

// AVX2+FMA loops where the CPU has them, unless the backend's instruction set is scalar
// (hz_active_isa: HANZO_CPU_ISA at import, or hanzo_torch.backends.cpu.use_isa in process).
DecodeLoops decode_loops() {
    if (has_avx2_fma() && hz_active_isa.load(std::memory_order_relaxed) >= 1) return {scores_avx2, pv_avx2, exp_sum_avx2};
    return {scores_generic, pv_generic, exp_sum_generic};
}

// ---------------------------------------------------------------------------------------------
// Loops of the prefill (flash) attention. Scores: S[r][j] = Q[r] . K[j] for R query rows and nk
// key rows (both D floats, row strides D and ldk). P*V: C[R x N] (+)= A[R x K] B[K x N] with row
// strides lda, ldb, ldc (A = probabilities, B = value rows, C = accumulators). scale_max:
// s[j] *= sc for j < n, returning the maximum.
// ---------------------------------------------------------------------------------------------
struct FlashLoops {
    void (*scores)(const float* Q, int64_t R, int64_t D, const float* K, int64_t ldk, int64_t nk, float* S,
                   int64_t lds);
    void (*gemm)(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t R,
                 int64_t N, int64_t K, bool accumulate);
    float (*scale_max)(float* s, int64_t n, float sc);
    float (*exp_sum)(float* s, int64_t n, float m);
    // scores and P*V (accumulating, N a multiple of 16) on f16 rows read in place; null without them
    void (*scores_f16)(const float* Q, int64_t R, int64_t D, const uint16_t* K, int64_t ldk, int64_t nk, float* S,
                       int64_t lds);
    void (*pv_f16)(const float* A, int64_t lda, const uint16_t* B, int64_t ldb, float* C, int64_t ldc, int64_t R,
                   int64_t N, int64_t K);
    // dst[d * ldd + j] = src[j * lds + d] for j < n, d < D: a key tile as the B operand of gemm
    void (*transpose)(const float* src, int64_t lds, int64_t n, int64_t D, float* dst, int64_t ldd);
};

void transpose_generic(const float* src, int64_t lds, int64_t n, int64_t D, float* dst, int64_t ldd) {
    for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < D; ++d) dst[d * ldd + j] = src[j * lds + d];
}

void qk_generic(const float* Q, int64_t R, int64_t D, const float* K, int64_t ldk, int64_t nk, float* S,
                int64_t lds) {
    for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j < nk; ++j) S[r * lds + j] = dot_f32(Q + r * D, K + j * ldk, D);
}

float scale_max_generic(float* s, int64_t n, float sc) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) {
        s[j] *= sc;
        mx = std::max(mx, s[j]);
    }
    return mx;
}

void gemm_generic(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t R,
                  int64_t N, int64_t K, bool accumulate) {
    for (int64_t r = 0; r < R; ++r) {
        float* c = C + r * ldc;
        if (!accumulate) std::fill(c, c + N, 0.0f);
        for (int64_t k = 0; k < K; ++k) {
            const float a = A[r * lda + k];
            const float* b = B + k * ldb;
            for (int64_t n = 0; n < N; ++n) c[n] += a * b[n];
        }
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// Register tile of MR rows x 8*NV columns: MR*NV accumulators (at most 12 of the 16 ymm
// registers), NV loads of B and MR broadcasts of A per step of k.
template <int MR, int NV>
__attribute__((target("avx2,fma"))) inline void gemm_tile_avx2(const float* A, int64_t lda, const float* B,
                                                              int64_t ldb, float* C, int64_t ldc, int64_t K,
                                                              bool accumulate) {
    __m256 c[MR][NV];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) c[r][v] = accumulate ? _mm256_loadu_ps(C + r * ldc + 8 * v) : _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        const float* b = B + k * ldb;
        __m256 bv[NV];
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) bv[v] = _mm256_loadu_ps(b + 8 * v);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
            const __m256 a = _mm256_broadcast_ss(A + r * lda + k);
#pragma GCC unroll 2
            for (int v = 0; v < NV; ++v) c[r][v] = _mm256_fmadd_ps(a, bv[v], c[r][v]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) _mm256_storeu_ps(C + r * ldc + 8 * v, c[r][v]);
}

template <int NV>
__attribute__((target("avx2,fma"))) void gemm_rows_avx2(const float* A, int64_t lda, const float* B, int64_t ldb,
                                                       float* C, int64_t ldc, int64_t R, int64_t K, bool accumulate) {
    int64_t r = 0;
    for (; r + 6 <= R; r += 6) gemm_tile_avx2<6, NV>(A + r * lda, lda, B, ldb, C + r * ldc, ldc, K, accumulate);
    const float* a = A + r * lda;
    float* c = C + r * ldc;
    switch (R - r) {
        case 5: gemm_tile_avx2<5, NV>(a, lda, B, ldb, c, ldc, K, accumulate); break;
        case 4: gemm_tile_avx2<4, NV>(a, lda, B, ldb, c, ldc, K, accumulate); break;
        case 3: gemm_tile_avx2<3, NV>(a, lda, B, ldb, c, ldc, K, accumulate); break;
        case 2: gemm_tile_avx2<2, NV>(a, lda, B, ldb, c, ldc, K, accumulate); break;
        case 1: gemm_tile_avx2<1, NV>(a, lda, B, ldb, c, ldc, K, accumulate); break;
        default: break;
    }
}

// Scores as dot products over D: a register tile of MR query rows x NR keys (8 accumulators
// at most: MR + NR loads per MR * NR FMAs), each accumulator reduced across its 8 lanes at the
// end; four keys' sums are reduced together by two rounds of hadd into one 4-float store.
template <int MR, int NR>
__attribute__((target("avx2,fma"))) inline void qk_tile_avx2(const float* Q, int64_t D, const float* K, int64_t ldk,
                                                            float* S, int64_t lds) {
    __m256 c[MR][NR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) c[r][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 kv[NR];
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) kv[j] = _mm256_loadu_ps(K + j * ldk + d);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
            const __m256 qv = _mm256_loadu_ps(Q + r * D + d);
#pragma GCC unroll 4
            for (int j = 0; j < NR; ++j) c[r][j] = _mm256_fmadd_ps(qv, kv[j], c[r][j]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
        if constexpr (NR == 4) {
            // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]: twice gives
            // [sum0..3 of keys 0..3 | sum4..7 of keys 0..3], then the halves are added
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(c[r][0], c[r][1]), _mm256_hadd_ps(c[r][2], c[r][3]));
            _mm_storeu_ps(S + r * lds, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
        } else {
#pragma GCC unroll 4
            for (int j = 0; j < NR; ++j) S[r * lds + j] = hsum8(c[r][j]);
        }
    }
}

template <int MR>
__attribute__((target("avx2,fma"))) void qk_rows_avx2(const float* Q, int64_t D, const float* K, int64_t ldk,
                                                     int64_t nk, float* S, int64_t lds) {
    int64_t j = 0;
    for (; j + 4 <= nk; j += 4) qk_tile_avx2<MR, 4>(Q, D, K + j * ldk, ldk, S + j, lds);
    switch (nk - j) {
        case 3: qk_tile_avx2<MR, 3>(Q, D, K + j * ldk, ldk, S + j, lds); break;
        case 2: qk_tile_avx2<MR, 2>(Q, D, K + j * ldk, ldk, S + j, lds); break;
        case 1: qk_tile_avx2<MR, 1>(Q, D, K + j * ldk, ldk, S + j, lds); break;
        default: break;
    }
}

__attribute__((target("avx2,fma"))) void qk_avx2(const float* Q, int64_t R, int64_t D, const float* K, int64_t ldk,
                                                int64_t nk, float* S, int64_t lds) {
    if (D % 8) return qk_generic(Q, R, D, K, ldk, nk, S, lds);
    int64_t r = 0;
    for (; r + 2 <= R; r += 2) qk_rows_avx2<2>(Q + r * D, D, K, ldk, nk, S + r * lds, lds);
    if (r < R) qk_rows_avx2<1>(Q + r * D, D, K, ldk, nk, S + r * lds, lds);
}

__attribute__((target("avx2,fma"))) float scale_max_avx2(float* s, int64_t n, float sc) {
    const __m256 scv = _mm256_set1_ps(sc);
    __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(s + j), scv);
        _mm256_storeu_ps(s + j, v);
        mv = _mm256_max_ps(v, mv);  // a NaN score is passed over (the second operand is kept)
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mv);
    float mx = lanes[0];
    for (int i = 1; i < 8; ++i) mx = std::max(mx, lanes[i]);
    for (; j < n; ++j) {
        s[j] *= sc;
        mx = std::max(mx, s[j]);
    }
    return mx;
}

// 8 x 8 blocks through registers (unpack, shuffle, 128-bit permute), the rest element by element.
__attribute__((target("avx2,fma"))) void transpose_avx2(const float* src, int64_t lds, int64_t n, int64_t D,
                                                       float* dst, int64_t ldd) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) {
            __m256 r[8], t[8];
#pragma GCC unroll 8
            for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + (j + i) * lds + d);
#pragma GCC unroll 4
            for (int i = 0; i < 8; i += 2) {
                t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
                t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
            }
#pragma GCC unroll 2
            for (int i = 0; i < 8; i += 4) {
                r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
                r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
                r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
                r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
            }
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) {
                _mm256_storeu_ps(dst + (d + i) * ldd + j, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
                _mm256_storeu_ps(dst + (d + i + 4) * ldd + j, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
            }
        }
        for (; d < D; ++d)
            for (int64_t i = 0; i < 8; ++i) dst[d * ldd + j + i] = src[(j + i) * lds + d];
    }
    transpose_generic(src + j * lds, lds, n - j, D, dst + j, ldd);
}

// Column blocks of 16, then 8, then the last N % 8 columns by the portable loop.
__attribute__((target("avx2,fma"))) void gemm_avx2(const float* A, int64_t lda, const float* B, int64_t ldb,
                                                  float* C, int64_t ldc, int64_t R, int64_t N, int64_t K,
                                                  bool accumulate) {
    int64_t n = 0;
    for (; n + 16 <= N; n += 16) gemm_rows_avx2<2>(A, lda, B + n, ldb, C + n, ldc, R, K, accumulate);
    if (n + 8 <= N) {
        gemm_rows_avx2<1>(A, lda, B + n, ldb, C + n, ldc, R, K, accumulate);
        n += 8;
    }
    if (n < N) gemm_generic(A, lda, B + n, ldb, C + n, ldc, R, N - n, K, accumulate);
}

// Decode tiles on an f16 cache read in place (no float32 copy of the key and value tiles): each
// 8-value load is converted by vcvtph2ps as it is used. Scores: up to 6 query rows x 2 keys (12
// accumulators), so a key row is converted once per 6 rows; P*V: 6 x 16 register tiles as
// gemm_tile_avx2, a value row converted once per 6 rows. Used where the rows of a tile are few
// (decode: the G heads of one group), where converting a tile once and reading it back is the
// larger cost; D must be a multiple of 16.
__attribute__((target("avx2,fma,f16c"))) inline __m256 ldh8(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int MR, int NR>
__attribute__((target("avx2,fma,f16c"))) inline void qk_tile_f16(const float* Q, int64_t D, const uint16_t* K,
                                                                int64_t ldk, float* S, int64_t lds) {
    __m256 c[MR][NR];
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
        for (int j = 0; j < NR; ++j) c[r][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 kv[NR];
#pragma GCC unroll 2
        for (int j = 0; j < NR; ++j) kv[j] = ldh8(K + j * ldk + d);
#pragma GCC unroll 6
        for (int r = 0; r < MR; ++r) {
            const __m256 qv = _mm256_loadu_ps(Q + r * D + d);
#pragma GCC unroll 2
            for (int j = 0; j < NR; ++j) c[r][j] = _mm256_fmadd_ps(qv, kv[j], c[r][j]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
        if constexpr (NR == 2) {  // [k0 0+1, k0 2+3, k1 0+1, k1 2+3 | 4..7 likewise], halves added, pairs added
            const __m256 h = _mm256_hadd_ps(c[r][0], c[r][1]);
            const __m128 x = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storel_pi(reinterpret_cast<__m64*>(S + r * lds), _mm_hadd_ps(x, x));
        } else {
            S[r * lds] = hsum8(c[r][0]);
        }
    }
}

template <int MR>
__attribute__((target("avx2,fma,f16c"))) void qk_rows_f16(const float* Q, int64_t D, const uint16_t* K, int64_t ldk,
                                                         int64_t nk, float* S, int64_t lds) {
    int64_t j = 0;
    for (; j + 2 <= nk; j += 2) qk_tile_f16<MR, 2>(Q, D, K + j * ldk, ldk, S + j, lds);
    if (j < nk) qk_tile_f16<MR, 1>(Q, D, K + j * ldk, ldk, S + j, lds);
}

__attribute__((target("avx2,fma,f16c"))) void qk_f16_avx2(const float* Q, int64_t R, int64_t D, const uint16_t* K,
                                                         int64_t ldk, int64_t nk, float* S, int64_t lds) {
    int64_t r = 0;
    for (; r + 6 <= R; r += 6) qk_rows_f16<6>(Q + r * D, D, K, ldk, nk, S + r * lds, lds);
    const float* q = Q + r * D;
    float* s = S + r * lds;
    switch (R - r) {
        case 5: qk_rows_f16<5>(q, D, K, ldk, nk, s, lds); break;
        case 4: qk_rows_f16<4>(q, D, K, ldk, nk, s, lds); break;
        case 3: qk_rows_f16<3>(q, D, K, ldk, nk, s, lds); break;
        case 2: qk_rows_f16<2>(q, D, K, ldk, nk, s, lds); break;
        case 1: qk_rows_f16<1>(q, D, K, ldk, nk, s, lds); break;
        default: break;
    }
}

template <int MR>
__attribute__((target("avx2,fma,f16c"))) inline void pv_tile_f16(const float* A, int64_t lda, const uint16_t* B,
                                                                int64_t ldb, float* C, int64_t ldc, int64_t K) {
    __m256 c[MR][2];
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
        c[r][0] = _mm256_loadu_ps(C + r * ldc);
        c[r][1] = _mm256_loadu_ps(C + r * ldc + 8);
    }
    for (int64_t k = 0; k < K; ++k) {
        const __m256 b0 = ldh8(B + k * ldb), b1 = ldh8(B + k * ldb + 8);
#pragma GCC unroll 6
        for (int r = 0; r < MR; ++r) {
            const __m256 a = _mm256_broadcast_ss(A + r * lda + k);
            c[r][0] = _mm256_fmadd_ps(a, b0, c[r][0]);
            c[r][1] = _mm256_fmadd_ps(a, b1, c[r][1]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
        _mm256_storeu_ps(C + r * ldc, c[r][0]);
        _mm256_storeu_ps(C + r * ldc + 8, c[r][1]);
    }
}

// C[R x N] += A[R x K] B[K x N], B an f16 row-major tile (row stride ldb), N a multiple of 16.
__attribute__((target("avx2,fma,f16c"))) void pv_f16_avx2(const float* A, int64_t lda, const uint16_t* B, int64_t ldb,
                                                         float* C, int64_t ldc, int64_t R, int64_t N, int64_t K) {
    for (int64_t n = 0; n < N; n += 16) {
        int64_t r = 0;
        for (; r + 6 <= R; r += 6) pv_tile_f16<6>(A + r * lda, lda, B + n, ldb, C + r * ldc + n, ldc, K);
        const float* a = A + r * lda;
        float* c = C + r * ldc + n;
        switch (R - r) {
            case 5: pv_tile_f16<5>(a, lda, B + n, ldb, c, ldc, K); break;
            case 4: pv_tile_f16<4>(a, lda, B + n, ldb, c, ldc, K); break;
            case 3: pv_tile_f16<3>(a, lda, B + n, ldb, c, ldc, K); break;
            case 2: pv_tile_f16<2>(a, lda, B + n, ldb, c, ldc, K); break;
            case 1: pv_tile_f16<1>(a, lda, B + n, ldb, c, ldc, K); break;
            default: break;
        }
    }
}
#else
void gemm_avx2(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t R,
               int64_t N, int64_t K, bool accumulate) {
    gemm_generic(A, lda, B, ldb, C, ldc, R, N, K, accumulate);
}
void qk_avx2(const float* Q, int64_t R, int64_t D, const float* K, int64_t ldk, int64_t nk, float* S, int64_t lds) {
    qk_generic(Q, R, D, K, ldk, nk, S, lds);
}
float scale_max_avx2(float* s, int64_t n, float sc) { return scale_max_generic(s, n, sc); }
void qk_f16_avx2(const float*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t) {}
void pv_f16_avx2(const float*, int64_t, const uint16_t*, int64_t, float*, int64_t, int64_t, int64_t, int64_t) {}
void transpose_avx2(const float* src, int64_t lds, int64_t n, int64_t D, float* dst, int64_t ldd) {
    transpose_generic(src, lds, n, D, dst, ldd);
}
#endif

FlashLoops flash_loops() {
    if (has_avx2_fma() && hz_active_isa.load(std::memory_order_relaxed) >= 1)
        return {qk_avx2, gemm_avx2, scale_max_avx2, exp_sum_avx2, has_f16c() ? qk_f16_avx2 : nullptr,
                has_f16c() ? pv_f16_avx2 : nullptr, transpose_avx2};
    return {qk_generic, gemm_generic, scale_max_generic, exp_sum_generic, nullptr, nullptr, transpose_generic};
}

// One cache row (D values at src) -> float32 dst[D].
inline void kv_load_row(KvKind kind, const uint8_t* src, int64_t D, float* dst) {
    switch (kind) {
        case KvKind::F32: std::memcpy(dst, src, static_cast<size_t>(D) * 4); return;
        case KvKind::F16: {
            const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
            if (has_f16c()) {
                f16_row_f16c(s, dst, D);
            } else {
                for (int64_t i = 0; i < D; ++i) dst[i] = half_bits_to_f32(s[i]);
            }
            return;
        }
        case KvKind::BF16: {
            const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
            for (int64_t i = 0; i < D; ++i) {
                const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
                std::memcpy(dst + i, &u, 4);
            }
            return;
        }
        case KvKind::Q8_0:
            for (int64_t b = 0; b < D / kQ8Block; ++b) {
                const uint8_t* blk = src + b * kQ8Bytes;
                uint16_t h;
                std::memcpy(&h, blk, 2);
                const float d = half_bits_to_f32(h);
                const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
                float* o = dst + b * kQ8Block;
                for (int64_t j = 0; j < kQ8Block; ++j) o[j] = static_cast<float>(q[j]) * d;
            }
            return;
    }
}

// float32 x[D] -> one cache row at dst: f16/bf16 round to nearest even (as Tensor.to does); q8_0
// as ggml's quantize_row_q8_0_ref (d = amax/127 in float32 stored as f16, q = roundf(x / d),
// clipped to [-128, 127], non-finite products 0), the bytes of hanzo_torch.quantize(x, "Q8_0").
inline void kv_store_row(KvKind kind, const float* x, int64_t D, uint8_t* dst) {
    switch (kind) {
        case KvKind::F32: std::memcpy(dst, x, static_cast<size_t>(D) * 4); return;
        case KvKind::F16: {
            c10::Half* o = reinterpret_cast<c10::Half*>(dst);
            for (int64_t i = 0; i < D; ++i) o[i] = c10::Half(x[i]);
            return;
        }
        case KvKind::BF16: {
            c10::BFloat16* o = reinterpret_cast<c10::BFloat16*>(dst);
            for (int64_t i = 0; i < D; ++i) o[i] = c10::BFloat16(x[i]);
            return;
        }
        case KvKind::Q8_0:
            for (int64_t b = 0; b < D / kQ8Block; ++b) {
                const float* xb = x + b * kQ8Block;
                float amax = 0.0f;
                for (int64_t j = 0; j < kQ8Block; ++j) {
                    const float a = std::fabs(xb[j]);
                    if (a > amax || std::isnan(a)) amax = a;  // a NaN stays (torch's amax propagates it)
                    if (std::isnan(amax)) break;
                }
                const float d = amax / 127.0f;
                const float id = d == 0.0f ? 0.0f : 1.0f / d;
                uint8_t* blk = dst + b * kQ8Bytes;
                const uint16_t h = c10::Half(d).x;
                std::memcpy(blk, &h, 2);
                int8_t* q = reinterpret_cast<int8_t*>(blk + 2);
                for (int64_t j = 0; j < kQ8Block; ++j) {
                    const float r = std::round(xb[j] * id);  // ties away from zero, as C roundf
                    q[j] = std::isfinite(r) ? static_cast<int8_t>(std::min(127.0f, std::max(-128.0f, r))) : 0;
                }
            }
            return;
    }
}

// ---------------------------------------------------------------------------------------------
// kv_cache_write
// ---------------------------------------------------------------------------------------------
void kv_cache_write(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k_in, const at::Tensor& v_in,
                    const at::Tensor& positions) {
    check_cpu(k_cache, "kv_cache_write", "k_cache");
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_in.dim() == 4 &&
                    k_in.sizes() == v_in.sizes(),
                "hanzo_cpu.kv_cache_write: caches [B, S, Hk, D] (q8_0: [B, S, Hk, D/32*34]) and k, v [B, T, Hk, D] expected");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "hanzo_cpu.kv_cache_write: caches must be contiguous");
    TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_in.scalar_type() == v_in.scalar_type(),
                "hanzo_cpu.kv_cache_write: k_cache and v_cache, and k and v, must share a dtype");
    const KvKind kind = kv_kind(k_cache, "kv_cache_write");
    const auto kt = k_in.scalar_type();
    TORCH_CHECK(kt == at::kFloat || kt == at::kHalf || kt == at::kBFloat16,
                "hanzo_cpu.kv_cache_write: k and v must be float32, float16 or bfloat16");
    const int64_t B = k_cache.size(0), S = k_cache.size(1), Hk = k_cache.size(2), D = k_in.size(3);
    const int64_t T = k_in.size(1);
    TORCH_CHECK(k_in.size(0) == B && k_in.size(2) == Hk && kv_fits(kind, k_cache.size(3), D),
                "hanzo_cpu.kv_cache_write: k does not fit the cache");
    TORCH_CHECK(positions.dim() == 2 && positions.size(0) == B && positions.size(1) == T,
                "hanzo_cpu.kv_cache_write: positions must be [B, T]");
    const at::Tensor k = k_in.contiguous(), v = v_in.contiguous(), pos = positions_long(positions);
    const int64_t* pp = pos.data_ptr<int64_t>();
    for (int64_t i = 0; i < B * T; ++i)
        TORCH_CHECK(pp[i] >= 0 && pp[i] < S, "hanzo_cpu.kv_cache_write: position ", pp[i], " outside [0, ", S, ")");
    const int64_t rb = kv_row_bytes(kind, D), cache_row = Hk * rb;  // one head, one position
    uint8_t* kd = static_cast<uint8_t*>(k_cache.data_ptr());
    uint8_t* vd = static_cast<uint8_t*>(v_cache.data_ptr());
    // Rows are written in order, so a position repeated within one call keeps its last entry,
    // as index_put_ does on the CPU.
    if (kt == k_cache.scalar_type()) {
        const char* ks = static_cast<const char*>(k.data_ptr());
        const char* vs = static_cast<const char*>(v.data_ptr());
        for (int64_t b = 0; b < B; ++b)
            for (int64_t t = 0; t < T; ++t) {
                const int64_t src = (b * T + t) * cache_row, dst = (b * S + pp[b * T + t]) * cache_row;
                std::memcpy(kd + dst, ks + src, cache_row);
                std::memcpy(vd + dst, vs + src, cache_row);
            }
        return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kt, "hanzo_cpu_kv_cache_write", [&] {
        const scalar_t* ks = k.data_ptr<scalar_t>();
        const scalar_t* vs = v.data_ptr<scalar_t>();
        std::vector<float> buf(static_cast<size_t>(D));
        for (int64_t b = 0; b < B; ++b)
            for (int64_t t = 0; t < T; ++t) {
                const int64_t dst = (b * S + pp[b * T + t]) * cache_row;
                for (int64_t h = 0; h < Hk; ++h) {
                    const int64_t src = ((b * T + t) * Hk + h) * D;
                    for (int64_t i = 0; i < D; ++i) buf[i] = ld(ks[src + i]);
                    kv_store_row(kind, buf.data(), D, kd + dst + h * rb);
                    for (int64_t i = 0; i < D; ++i) buf[i] = ld(vs[src + i]);
                    kv_store_row(kind, buf.data(), D, vd + dst + h * rb);
                }
            }
    });
}

// ---------------------------------------------------------------------------------------------
// qk_norm_rope_kv_write
// ---------------------------------------------------------------------------------------------
// qk_norm_rope, then kv_cache_write of the rotated k (rounded to the activation dtype, as the
// two ops give it) and of v. Both kernels run inline at decode sizes (for_rows), so this adds no
// parallel region; it saves the dispatcher round trip of the second op.
at::Tensor qk_norm_rope_kv_write_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const std::optional<at::Tensor>& q_w, const std::optional<at::Tensor>& k_w,
                                     at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& positions, double theta,
                                     double eps, const at::Tensor* q_out) {
    auto qk = qk_norm_rope_out(q, k, q_w, k_w, positions, theta, eps, q_out);
    kv_cache_write(k_cache, v_cache, std::get<1>(qk), v, positions);
    return std::get<0>(qk);
}

at::Tensor qk_norm_rope_kv_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const std::optional<at::Tensor>& q_w, const std::optional<at::Tensor>& k_w,
                                 at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& positions, double theta,
                                 double eps) {
    return qk_norm_rope_kv_write_out(q, k, v, q_w, k_w, k_cache, v_cache, positions, theta, eps, nullptr);
}

// ---------------------------------------------------------------------------------------------
// attention
// ---------------------------------------------------------------------------------------------
// Decode-sized calls (few query rows), split-K: a work unit is (b, t, kv head, chunk of up to
// kAttnChunk keys of 0..position). Each key row and value row of the chunk is read (and converted
// to float32) once for all G query heads of the group, while it is in L1. A unit leaves per head
// its score max m, sum l = sum exp(s - m) and unnormalized acc = sum exp(s - m) v (float32); the
// units of one (b, t, kv head) are then merged: out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c.
// One chunk is the exact max-subtracted softmax; more chunks let a long context use every thread.
void attention_decode(const float* qp, const uint8_t* kp, const uint8_t* vp, float* op, const int64_t* pp, int64_t B,
                      int64_t T, int64_t Hq, int64_t Hk, int64_t D, int64_t S, KvKind kind, float sc) {
    const int64_t G = Hq / Hk, rb = kv_row_bytes(kind, D), key_stride = Hk * rb, batch_stride = S * Hk * rb;
    struct Unit { int64_t bt, hk, j0, j1; };
    std::vector<Unit> units;
    std::vector<int64_t> first(static_cast<size_t>(B * T * Hk + 1));
    int64_t keys = 0;
    for (int64_t bt = 0; bt < B * T; ++bt) {
        const int64_t n = pp[bt] + 1;  // keys 0..position
        for (int64_t hk = 0; hk < Hk; ++hk) {
            first[bt * Hk + hk] = static_cast<int64_t>(units.size());
            for (int64_t j0 = 0; j0 < n; j0 += kAttnChunk) units.push_back({bt, hk, j0, std::min(n, j0 + kAttnChunk)});
            keys += n;
        }
    }
    const int64_t nu = static_cast<int64_t>(units.size());
    first[B * T * Hk] = nu;
    const int64_t stride = G * (D + 2);  // per unit: m[G], l[G], acc[G][D]
    std::vector<float> part(static_cast<size_t>(nu * stride));
    const bool direct = kind == KvKind::F32;  // float32 rows are read in place
    const DecodeLoops loops = decode_loops();
    auto run = [&](int64_t u0, int64_t u1) {
        std::vector<float> row(static_cast<size_t>(D)), s(static_cast<size_t>(G * kAttnChunk));
        for (int64_t u = u0; u < u1; ++u) {
            const Unit& un = units[static_cast<size_t>(u)];
            const int64_t b = un.bt / T, nk = un.j1 - un.j0;
            const float* qg = qp + (un.bt * Hq + un.hk * G) * D;  // the group's G query heads, contiguous
            const uint8_t* kb = kp + b * batch_stride + un.hk * rb + un.j0 * key_stride;
            const uint8_t* vb = vp + b * batch_stride + un.hk * rb + un.j0 * key_stride;
            for (int64_t j = 0; j < nk; ++j) {
                const float* kr = reinterpret_cast<const float*>(kb + j * key_stride);
                if (!direct) {
                    kv_load_row(kind, kb + j * key_stride, D, row.data());
                    kr = row.data();
                }
                loops.scores(qg, G, kr, D, sc, s.data() + j, kAttnChunk);
            }
            float* m = part.data() + u * stride;
            float* l = m + G;
            float* acc = m + 2 * G;
            for (int64_t g = 0; g < G; ++g) {
                float* sg = s.data() + g * kAttnChunk;
                float mg = -std::numeric_limits<float>::infinity();
                for (int64_t j = 0; j < nk; ++j) mg = std::max(mg, sg[j]);
                m[g] = mg;
                l[g] = loops.exp_sum(sg, nk, mg);
            }
            std::fill(acc, acc + G * D, 0.0f);
            for (int64_t j = 0; j < nk; ++j) {
                const float* vr = reinterpret_cast<const float*>(vb + j * key_stride);
                if (!direct) {
                    kv_load_row(kind, vb + j * key_stride, D, row.data());
                    vr = row.data();
                }
                loops.pv(s.data() + j, kAttnChunk, G, vr, D, acc);
            }
        }
    };
    // work ~ (2G dots + conversion) per key; below kAttnParallelWork one thread does it all
    if (keys * D * (2 * G + 1) < kAttnParallelWork || at::get_num_threads() == 1 || nu == 1)
        run(0, nu);
    else
        hz_run_tasks(nu, at::get_num_threads(), [&](int64_t u) { run(u, u + 1); });
    for (int64_t i = 0; i < B * T * Hk; ++i) {
        const int64_t bt = i / Hk, hk = i % Hk, c0 = first[i], c1 = first[i + 1];
        for (int64_t g = 0; g < G; ++g) {
            float M = -std::numeric_limits<float>::infinity();
            for (int64_t c = c0; c < c1; ++c) M = std::max(M, part[c * stride + g]);
            float L = 0.0f;
            float* o = op + (bt * Hq + hk * G + g) * D;
            std::fill(o, o + D, 0.0f);
            for (int64_t c = c0; c < c1; ++c) {
                const float* pc = part.data() + c * stride;
                const float w = c1 - c0 == 1 ? 1.0f : std::exp(pc[g] - M);
                L += w * pc[G + g];
                const float* a = pc + 2 * G + g * D;
                for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
            }
            const float inv = 1.0f / L;
            for (int64_t d = 0; d < D; ++d) o[d] *= inv;
        }
    }
}

// Prefill-sized calls: one item = (b, kv head, tile of Tq tokens). The tile's G*Tq query rows
// (ordered g-major) meet the key prefix 0..kmax-1 (kmax = the tile's largest position + 1) in
// two float32 GEMMs of ATen/BLAS: S = (Q K^T) * scale, masked to -inf past each row's position,
// P = softmax(S) (ATen's, exact: max-subtracted, not online), O = P V. Masking costs at most the
// diagonal block (Tq/2 keys per row on average) over the exact causal work.
void attention_tiles(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, at::Tensor& out,
                     const int64_t* pp, double scale) {
    const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), Hk = kc.size(2);
    const int64_t G = Hq / Hk;
    // ~192 query rows per GEMM: big enough for BLAS efficiency, small waste on the diagonal
    const int64_t Tq = std::max<int64_t>(1, std::min<int64_t>(T, kAttnTileRows / G));
    const int64_t nt = (T + Tq - 1) / Tq;
    struct Item { int64_t b, hk, t0, t1, kmax; };
    std::vector<Item> items;
    items.reserve(static_cast<size_t>(B * Hk * nt));
    int64_t flops = 0;  // of the two GEMMs, all tiles
    for (int64_t b = 0; b < B; ++b)
        for (int64_t t0 = 0; t0 < T; t0 += Tq) {
            const int64_t t1 = std::min(T, t0 + Tq);
            int64_t kmax = 0;
            for (int64_t t = t0; t < t1; ++t) kmax = std::max(kmax, pp[b * T + t] + 1);
            for (int64_t hk = 0; hk < Hk; ++hk) items.push_back({b, hk, t0, t1, kmax});
            flops += 4 * Hq * (t1 - t0) * kmax * D;
        }
    // Largest first, handed out one at a time: causal tiles differ in cost by up to T/Tq times.
    std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) {
        return x.kmax * (x.t1 - x.t0) > y.kmax * (y.t1 - y.t0);
    });
    std::atomic<int64_t> next{0};
    const int64_t n_items = static_cast<int64_t>(items.size());
    const float sc = static_cast<float>(scale);
    auto work = [&](const Item& it) {
        const int64_t tq = it.t1 - it.t0, R = G * tq, n = it.kmax;
        // [tq, G, D] view of the group's queries -> rows (g, t), contiguous
        const at::Tensor qt = q.select(0, it.b).narrow(0, it.t0, tq).narrow(1, it.hk * G, G).transpose(0, 1)
                                  .reshape({R, D});
        const at::Tensor kt = kc.select(0, it.b).narrow(0, 0, n).select(1, it.hk);  // [n, D], row stride Hk*D
        const at::Tensor vt = vc.select(0, it.b).narrow(0, 0, n).select(1, it.hk);
        at::Tensor s = at::mm(qt, kt.t());  // [R, n]
        float* sp = s.data_ptr<float>();
        const float ninf = -std::numeric_limits<float>::infinity();
        for (int64_t g = 0; g < G; ++g)
            for (int64_t t = 0; t < tq; ++t) {
                float* row = sp + (g * tq + t) * n;
                const int64_t vis = pp[it.b * T + it.t0 + t] + 1;  // keys 0..position
                for (int64_t j = 0; j < vis; ++j) row[j] *= sc;
                for (int64_t j = vis; j < n; ++j) row[j] = ninf;
            }
        const at::Tensor p = at::_softmax(s, 1, false);
        const at::Tensor o = at::mm(p, vt).view({G, tq, D});  // rows (g, t)
        out.select(0, it.b).narrow(0, it.t0, tq).narrow(1, it.hk * G, G).copy_(o.transpose(0, 1));
    };
    // below ~4 MFLOP (~0.1 ms) waking the pool costs more than it saves
    const int64_t nthreads = flops < (int64_t(1) << 22) ? 1 : std::min<int64_t>(at::get_num_threads(), n_items);
    if (nthreads <= 1) {
        for (const Item& it : items) work(it);
        return;
    }
    // The tile work calls ATen ops: the pool threads get the caller's thread-local state
    // (inference mode, grad mode, dispatch keys), as at::launch does, or writing into `out` (an
    // inference tensor under torch.inference_mode) would be refused there.
    const at::ThreadLocalState tls;
    at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
        at::ThreadLocalStateGuard guard(tls);
        for (int64_t i = next++; i < n_items; i = next++) work(items[static_cast<size_t>(i)]);
    });
}


// Prefill-sized calls, flash style. A query tile is (b, kv head, Tq tokens): its R = Tq*G query
// rows, ordered token-major (row t*G + g is query head hk*G + g of token t0 + t), meet the keys
// 0..kmax-1 (kmax = the tile's largest position + 1) in key tiles of kFlashKeys. Each key tile is
// read from the cache once for all R rows (float32 rows in place, others converted to float32
// once), scored, then per row the online softmax:
//   s = (q . k) * scale for the keys 0..position of that row, m' = max(m, max s),
//   p = exp(s - m'), l = l e^(m - m') + sum p, acc = acc e^(m - m') + p V
// (running max m, sum l and accumulator acc in float32; p V by a register-tiled GEMM over the
// tile's rows), out = acc / l. A row that sees no key
// of a tile, or whose maximum is still -inf, takes nothing from it (no -inf - -inf).
// Work per query tile is O(R * kmax * D): no score row longer than one key tile exists. When
// there are fewer than kFlashUnits query tiles (short prompts on a long context), a tile's key
// range is split into units of at least kFlashSplitKeys keys, merged afterwards by their maxima
// and sums as the decode kernel's chunks are. The split depends on the shapes only, never on the
// thread count, so the results are the same bits with any number of threads.
// Scores: a tile of at least kFlashGemmRows query rows (a prompt's) multiplies them by the key
// tile transposed to [D, keys] (float32, in the thread's buffer) with the register-tiled GEMM of
// P*V: 6 x 16 outputs per step, 12 FMAs per 2 loads and 6 broadcasts, no horizontal sums. Zen 4,
// one thread, 48 rows x 64 keys x D 128 in L1: 117 GFLOP/s against 85 for the dot products over D
// (2 x 4 outputs, 8 FMAs per 6 loads, each output summed across its lanes at the end), which the
// f16 tiles of a few rows (decode) keep. The transpose is 8 x 8 blocks through registers: 6% of a
// 2,048-token prompt's attention time in perf samples (one thread), the GEMM tiles 74%.
// set_attention_prefill(2) scores every tile by the dot products, for A/B.
constexpr int64_t kFlashKeys = 64;         // keys per key tile
constexpr int64_t kFlashGemmRows = 24;     // query rows from which a tile's scores run as a GEMM
constexpr int64_t kFlashRows = 48;         // query rows (tokens x group heads) per query tile, target
constexpr int64_t kFlashSplitKeys = 512;   // least keys per unit of a split key range
constexpr int64_t kFlashUnits = 8;         // work units wanted (2 per thread on 4 threads)

void attention_flash(const float* qp, const uint8_t* kp, const uint8_t* vp, float* op, const int64_t* pp, int64_t B,
                     int64_t T, int64_t Hq, int64_t Hk, int64_t D, int64_t S, KvKind kind, float sc,
                     bool gemm_scores) {
    const int64_t G = Hq / Hk, rb = kv_row_bytes(kind, D), key_stride = Hk * rb, batch_stride = S * Hk * rb;
    const int64_t Bk = kFlashKeys;
    const int64_t Tq = std::max<int64_t>(1, std::min<int64_t>(T, (kFlashRows + G - 1) / G));
    const int64_t Rmax = G * Tq;
    struct Tile { int64_t b, hk, t0, t1, kmax; };
    struct Unit { int64_t tile, j0, j1, part; };  // part: index of its partial result, -1 if none
    std::vector<Tile> tiles;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t t0 = 0; t0 < T; t0 += Tq) {
            const int64_t t1 = std::min(T, t0 + Tq);
            int64_t kmax = 0;
            for (int64_t t = t0; t < t1; ++t) kmax = std::max(kmax, pp[b * T + t] + 1);
            for (int64_t hk = 0; hk < Hk; ++hk) tiles.push_back({b, hk, t0, t1, kmax});
        }
    const int64_t nt = static_cast<int64_t>(tiles.size());
    const int64_t threads = at::get_num_threads();
    const int64_t want = nt < kFlashUnits ? (kFlashUnits + nt - 1) / nt : 1;
    std::vector<Unit> units;
    std::vector<int64_t> first(static_cast<size_t>(nt + 1));
    int64_t n_parts = 0, flops = 0;
    for (int64_t i = 0; i < nt; ++i) {
        const Tile& tl = tiles[static_cast<size_t>(i)];
        const int64_t n = tl.kmax;
        const int64_t split = std::max<int64_t>(1, std::min(want, n / kFlashSplitKeys));
        const int64_t len = ((n + split - 1) / split + Bk - 1) / Bk * Bk;
        first[i] = static_cast<int64_t>(units.size());
        for (int64_t j0 = 0; j0 < n; j0 += len) units.push_back({i, j0, std::min(n, j0 + len), -1});
        if (static_cast<int64_t>(units.size()) - first[i] > 1)
            for (int64_t u = first[i]; u < static_cast<int64_t>(units.size()); ++u) units[u].part = n_parts++;
        flops += 4 * G * (tl.t1 - tl.t0) * n * D;
    }
    first[nt] = static_cast<int64_t>(units.size());
    const int64_t nu = first[nt];
    const int64_t part_stride = Rmax * (D + 2);  // per unit: m[R], l[R], acc[R][D]
    std::vector<float> part(static_cast<size_t>(n_parts * part_stride));
    // Largest first, handed out one at a time: causal tiles differ in cost by up to T/Tq times.
    std::vector<int64_t> order(static_cast<size_t>(nu));
    for (int64_t u = 0; u < nu; ++u) order[u] = u;
    auto cost = [&](int64_t u) {
        const Unit& x = units[static_cast<size_t>(u)];
        const Tile& tl = tiles[static_cast<size_t>(x.tile)];
        return (x.j1 - x.j0) * (tl.t1 - tl.t0);
    };
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return cost(x) > cost(y); });

    const FlashLoops loops = flash_loops();
    const bool direct = kind == KvKind::F32;  // float32 key and value rows are read in place
    // f16 rows too, by the f16 tiles, where a query tile has at most 12 rows (each row converted
    // at most twice: cheaper than a float32 copy of the tile read back)
    const bool direct16 = kind == KvKind::F16 && loops.scores_f16 && D % 16 == 0 && Rmax <= 12;
    const float ninf = -std::numeric_limits<float>::infinity();
    auto task = [&](int64_t i) {
        // per thread: queries, keys, values (as float32), scores/probabilities, m, l, acc
        thread_local std::vector<float> qb, kb, vb, sb, ml, acc, kt_buf;
        qb.resize(static_cast<size_t>(Rmax * D));
        if (gemm_scores && Rmax >= kFlashGemmRows) kt_buf.resize(static_cast<size_t>(Bk * D));
        kb.resize(static_cast<size_t>(Bk * D));
        vb.resize(static_cast<size_t>(Bk * D));
        sb.resize(static_cast<size_t>(Rmax * Bk));
        ml.resize(static_cast<size_t>(2 * Rmax));
        acc.resize(static_cast<size_t>(Rmax * D));
        {
            const Unit& un = units[static_cast<size_t>(order[static_cast<size_t>(i)])];
            const Tile& tl = tiles[static_cast<size_t>(un.tile)];
            const int64_t b = tl.b, hk = tl.hk, t0 = tl.t0, tq = tl.t1 - tl.t0, R = G * tq;
            const int64_t* pt = pp + b * T + t0;
            for (int64_t t = 0; t < tq; ++t)  // the group's G heads of one token are contiguous
                std::memcpy(qb.data() + t * G * D, qp + ((b * T + t0 + t) * Hq + hk * G) * D,
                            static_cast<size_t>(G * D) * sizeof(float));
            float* m = ml.data();
            float* l = m + Rmax;
            std::fill(m, m + R, ninf);
            std::fill(l, l + R, 0.0f);
            std::fill(acc.begin(), acc.begin() + R * D, 0.0f);
            const uint8_t* kbase = kp + b * batch_stride + hk * rb;
            const uint8_t* vbase = vp + b * batch_stride + hk * rb;
            for (int64_t j0 = un.j0; j0 < un.j1; j0 += Bk) {
                const int64_t nk = std::min(Bk, un.j1 - j0);
                auto vis = [&](int64_t t) { return std::min(nk, std::max<int64_t>(0, pt[t] + 1 - j0)); };
                int64_t tlo = 0, thi = tq;
                while (tlo < tq && vis(tlo) == 0) ++tlo;
                while (thi > tlo && vis(thi - 1) == 0) --thi;
                if (tlo == thi) continue;  // no row of the tile sees these keys
                const int64_t rlo = tlo * G, rhi = thi * G;
                float* s = sb.data();
                if (direct16) {
                    loops.scores_f16(qb.data() + rlo * D, rhi - rlo, D,
                                     reinterpret_cast<const uint16_t*>(kbase + j0 * key_stride), Hk * D, nk,
                                     s + rlo * Bk, Bk);
                } else {
                    const float* kt = reinterpret_cast<const float*>(kbase + j0 * key_stride);
                    int64_t ldk = Hk * D;
                    if (!direct) {
                        for (int64_t j = 0; j < nk; ++j)
                            kv_load_row(kind, kbase + (j0 + j) * key_stride, D, kb.data() + j * D);
                        kt = kb.data();
                        ldk = D;
                    }
                    if (gemm_scores && rhi - rlo >= kFlashGemmRows) {
                        loops.transpose(kt, ldk, nk, D, kt_buf.data(), Bk);
                        loops.gemm(qb.data() + rlo * D, D, kt_buf.data(), Bk, s + rlo * Bk, Bk, rhi - rlo, nk, D, false);
                    } else {
                        loops.scores(qb.data() + rlo * D, rhi - rlo, D, kt, ldk, nk, s + rlo * Bk, Bk);
                    }
                }
                for (int64_t t = tlo; t < thi; ++t) {
                    const int64_t nv = vis(t);
                    for (int64_t r = t * G; r < (t + 1) * G; ++r) {
                        float* sr = s + r * Bk;
                        const float mx = loops.scale_max(sr, nv, sc);
                        const float mn = std::max(m[r], mx);
                        if (nv == 0 || mn == ninf) {  // nothing (finite) to add from this tile
                            std::fill(sr, sr + nk, 0.0f);
                            continue;
                        }
                        const float corr = m[r] == ninf ? 0.0f : std::exp(m[r] - mn);
                        const float ls = loops.exp_sum(sr, nv, mn);
                        std::fill(sr + nv, sr + nk, 0.0f);
                        l[r] = l[r] * corr + ls;
                        if (corr != 1.0f) {
                            float* a = acc.data() + r * D;
                            for (int64_t d = 0; d < D; ++d) a[d] *= corr;
                        }
                        m[r] = mn;
                    }
                }
                if (direct16) {
                    loops.pv_f16(s + rlo * Bk, Bk, reinterpret_cast<const uint16_t*>(vbase + j0 * key_stride), Hk * D,
                                 acc.data() + rlo * D, D, rhi - rlo, D, nk);
                    continue;
                }
                const float* vt = reinterpret_cast<const float*>(vbase + j0 * key_stride);
                int64_t ldv = Hk * D;
                if (!direct) {
                    for (int64_t j = 0; j < nk; ++j) kv_load_row(kind, vbase + (j0 + j) * key_stride, D, vb.data() + j * D);
                    vt = vb.data();
                    ldv = D;
                }
                loops.gemm(s + rlo * Bk, Bk, vt, ldv, acc.data() + rlo * D, D, rhi - rlo, D, nk, true);
            }
            if (un.part < 0) {
                for (int64_t r = 0; r < R; ++r) {
                    const int64_t t = r / G, g = r % G;
                    float* o = op + ((b * T + t0 + t) * Hq + hk * G + g) * D;
                    const float inv = 1.0f / l[r];
                    const float* a = acc.data() + r * D;
                    for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
                }
            } else {
                float* pu = part.data() + un.part * part_stride;
                std::copy(m, m + R, pu);
                std::copy(l, l + R, pu + Rmax);
                std::copy(acc.begin(), acc.begin() + R * D, pu + 2 * Rmax);
            }
        }
    };
    // below ~4 MFLOP (~0.1 ms) waking the pool costs more than it saves
    hz_run_tasks(nu, flops < (int64_t(1) << 22) ? 1 : threads, task);
    // merge the units of split tiles: out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c
    for (int64_t i = 0; i < nt; ++i) {
        const int64_t c0 = first[i], c1 = first[i + 1];
        if (c1 - c0 < 2) continue;
        const Tile& tl = tiles[static_cast<size_t>(i)];
        const int64_t tq = tl.t1 - tl.t0;
        for (int64_t r = 0; r < G * tq; ++r) {
            const int64_t t = r / G, g = r % G;
            float M = ninf;
            for (int64_t c = c0; c < c1; ++c) M = std::max(M, part[units[c].part * part_stride + r]);
            float L = 0.0f;
            float* o = op + ((tl.b * T + tl.t0 + t) * Hq + tl.hk * G + g) * D;
            std::fill(o, o + D, 0.0f);
            for (int64_t c = c0; c < c1; ++c) {
                const float* pc = part.data() + units[c].part * part_stride;
                if (pc[r] == ninf) continue;  // this unit saw no key of the row
                const float w = std::exp(pc[r] - M);
                L += w * pc[Rmax + r];
                const float* a = pc + 2 * Rmax + r * D;
                for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
            }
            const float inv = 1.0f / L;
            for (int64_t d = 0; d < D; ++d) o[d] *= inv;
        }
    }
}

// The live prefix [B, live, Hk, *] of a cache as float32 [B, live, Hk, D], contiguous (a copy
// unless the cache is float32 and the prefix contiguous).
at::Tensor kv_prefix_f32(const at::Tensor& cache, KvKind kind, int64_t live, int64_t D) {
    const at::Tensor c = cache.narrow(1, 0, live);
    if (kind != KvKind::Q8_0) return c.to(at::kFloat).contiguous();
    const at::Tensor src = c.contiguous();
    const int64_t rows = src.size(0) * live * src.size(2), rb = kv_row_bytes(kind, D);
    at::Tensor out = at::empty({src.size(0), live, src.size(2), D}, cache.options().dtype(at::kFloat));
    const uint8_t* sp = src.data_ptr<uint8_t>();
    float* dp = out.data_ptr<float>();
    for_rows(rows, D, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) kv_load_row(kind, sp + r * rb, D, dp + r * D);
    });
    return out;
}

// Which kernel runs attention calls of T > 1 query tokens: kPrefillFlash (attention_flash), or
// kPrefillGemm, the ATen GEMM tiles (attention_tiles) from kAttnTileMinT tokens and the decode
// kernel below that. Both stay built so that one process can compare them (set_attention_prefill).
// kPrefillFlashDot: attention_flash with every tile's scores as dot products over D.
constexpr int64_t kPrefillFlash = 0, kPrefillGemm = 1, kPrefillFlashDot = 2;
std::atomic<int64_t> g_attn_prefill{kPrefillFlash};

int64_t set_attention_prefill(int64_t path) {
    TORCH_CHECK(path == kPrefillFlash || path == kPrefillGemm || path == kPrefillFlashDot,
                "hanzo_cpu.set_attention_prefill: path ", path, " is not 0 (flash), 1 (gemm) or 2 (flash-dot)");
    return g_attn_prefill.exchange(path);
}

// Which kernel runs calls of one query token: kDecodeFlash (attention_flash: key tiles converted
// to float32 once, register-tiled scores and P*V for the G heads of a group), or kDecodeRows
// (attention_decode: one key or value row at a time). set_attention_decode, for A/B in one process.
constexpr int64_t kDecodeFlash = 0, kDecodeRows = 1;
std::atomic<int64_t> g_attn_decode{kDecodeFlash};

int64_t set_attention_decode(int64_t path) {
    TORCH_CHECK(path == kDecodeFlash || path == kDecodeRows, "hanzo_cpu.set_attention_decode: path ", path,
                " is not 0 (flash) or 1 (rows)");
    return g_attn_decode.exchange(path);
}

// out: where the result goes (defined, float32 [B, T, Hq, D] contiguous; float32 q only), else a new tensor.
at::Tensor attention_out(const at::Tensor& q_in, const at::Tensor& kc_in, const at::Tensor& vc_in,
                         const at::Tensor& positions, double scale, const at::Tensor* out_in) {
    check_cpu(q_in, "attention", "q");
    TORCH_CHECK(q_in.dim() == 4 && kc_in.dim() == 4 && kc_in.sizes() == vc_in.sizes(),
                "hanzo_cpu.attention: q [B, T, Hq, D] and caches [B, S, Hk, D] (q8_0: [B, S, Hk, D/32*34]) expected");
    TORCH_CHECK(kc_in.scalar_type() == vc_in.scalar_type(), "hanzo_cpu.attention: k_cache and v_cache must share a dtype");
    const KvKind kind = kv_kind(kc_in, "attention");
    const auto qt = q_in.scalar_type();
    TORCH_CHECK(qt == at::kFloat || qt == at::kHalf || qt == at::kBFloat16,
                "hanzo_cpu.attention: q must be float32, float16 or bfloat16");
    const int64_t B = q_in.size(0), T = q_in.size(1), Hq = q_in.size(2), D = q_in.size(3);
    const int64_t S = kc_in.size(1), Hk = kc_in.size(2);
    TORCH_CHECK(kc_in.size(0) == B && kv_fits(kind, kc_in.size(3), D) && Hk > 0 && Hq % Hk == 0,
                "hanzo_cpu.attention: cache does not match q (B, D or GQA grouping)");
    TORCH_CHECK(positions.dim() == 2 && positions.size(0) == B && positions.size(1) == T,
                "hanzo_cpu.attention: positions must be [B, T]");
    const at::Tensor pos = positions_long(positions);
    const int64_t* pp = pos.data_ptr<int64_t>();
    int64_t live = 0;
    for (int64_t i = 0; i < B * T; ++i) {
        TORCH_CHECK(pp[i] >= 0 && pp[i] < S, "hanzo_cpu.attention: position ", pp[i], " outside [0, ", S, ")");
        live = std::max(live, pp[i] + 1);
    }
    // Only the live prefix [0, live) of each cache is read.
    const at::Tensor q = q_in.scalar_type() == at::kFloat ? q_in.contiguous() : q_in.to(at::kFloat).contiguous();
    TORCH_CHECK(!out_in || qt == at::kFloat, "hanzo_cpu.attention: an output buffer needs float32 q");
    at::Tensor out = out_in ? *out_in : at::empty({B, T, Hq, D}, q.options());
    if (B * T * Hq > 0 && D > 0) {
        const int64_t prefill = g_attn_prefill.load(std::memory_order_relaxed);
        const bool flash = prefill != kPrefillGemm;
        if (!flash && T >= kAttnTileMinT) {
            const at::Tensor kc = kv_prefix_f32(kc_in, kind, live, D), vc = kv_prefix_f32(vc_in, kind, live, D);
            attention_tiles(q, kc, vc, out, pp, scale);
        } else {
            // read in place (and converted row by row or tile by tile) at the cache's own strides:
            // no copy of the prefix
            const at::Tensor kc = kc_in.contiguous(), vc = vc_in.contiguous();
            const auto* kp = static_cast<const uint8_t*>(kc.data_ptr());
            const auto* vp = static_cast<const uint8_t*>(vc.data_ptr());
            if (flash && (T > 1 || g_attn_decode.load(std::memory_order_relaxed) == kDecodeFlash))
                attention_flash(q.data_ptr<float>(), kp, vp, out.data_ptr<float>(), pp, B, T, Hq, Hk, D, S, kind,
                                static_cast<float>(scale), prefill == kPrefillFlash);
            else
                attention_decode(q.data_ptr<float>(), kp, vp, out.data_ptr<float>(), pp, B, T, Hq, Hk, D, S, kind,
                                 static_cast<float>(scale));
        }
    }
    return qt == at::kFloat ? out : out.to(qt);
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& positions,
                     double scale) {
    return attention_out(q, kc, vc, positions, scale, nullptr);
}

// ---------------------------------------------------------------------------------------------
// moe_route
// ---------------------------------------------------------------------------------------------
// probs: the float32 softmax of the router logits (computed by torch's softmax in the caller, so
// the weights are bit-identical to the reference's); this kernel does the top-k and renormalization.
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& probs_in, int64_t k, bool normalize) {
    check_cpu(probs_in, "moe_route", "probs");
    TORCH_CHECK(probs_in.dim() == 2, "hanzo_cpu.moe_route: probs must be [T, E]");
    const int64_t T = probs_in.size(0), E = probs_in.size(1);
    TORCH_CHECK(k >= 1 && k <= E, "hanzo_cpu.moe_route: k=", k, " must be in [1, ", E, "]");
    const at::Tensor pt = probs_in.to(at::kFloat).contiguous();
    at::Tensor wts = at::empty({T, k}, pt.options());
    at::Tensor ids = at::empty({T, k}, pt.options().dtype(at::kLong));
    const float* pp = pt.data_ptr<float>();
    float* wp = wts.data_ptr<float>();
    int64_t* ip = ids.data_ptr<int64_t>();
    for_rows(T, E * 4, [&](int64_t t0, int64_t t1) {
        std::vector<int64_t> order(E);
        for (int64_t t = t0; t < t1; ++t) {
            const float* pr = pp + t * E;
            for (int64_t e = 0; e < E; ++e) order[e] = e;
            // descending probability, NaN above everything (as torch.sort orders it), ties to the
            // lower expert index: a strict weak order even with NaN
            auto gt = [](float x, float y) { return std::isnan(x) ? !std::isnan(y) : (!std::isnan(y) && x > y); };
            std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
                return gt(pr[a], pr[b]) || (!gt(pr[b], pr[a]) && a < b);
            });
            float sum = 0.0f;
            for (int64_t j = 0; j < k; ++j) sum += pr[order[j]];
            for (int64_t j = 0; j < k; ++j) {
                ip[t * k + j] = order[j];
                wp[t * k + j] = normalize ? pr[order[j]] / sum : pr[order[j]];
            }
        }
    });
    return {wts, ids};
}

}  // namespace

// silu(g) * u over n floats (hz_api.h): y = g * s * u, s = 1 / (1 + e) where g >= 0 and e / (1 + e)
// where g < 0, e = exp(-|g|), so the exp never overflows; e is 0 below -87.3 (silu(-inf) is NaN,
// as torch's). exp8's 8 lanes (about 1 ulp) with AVX2+FMA unless the backend's instruction set is
// scalar, std::exp otherwise; the tail goes through the same lanes, so an element's bits do not
// depend on the caller's split of the row.
void hz_silu_mul(const float* g, const float* u, float* y, int64_t n) {
    if (n <= 0) return;
    if (has_avx2_fma() && hz_active_isa.load(std::memory_order_relaxed) >= 1) return silu_mul_avx2(g, u, y, n);
    for (int64_t i = 0; i < n; ++i) {
        const float a = g[i], x = -std::fabs(a);
        const float e = x > -87.3f ? std::exp(x) : 0.0f;
        y[i] = a * ((std::signbit(a) ? e : 1.0f) / (1.0f + e)) * u[i];
    }
}

// Entry points with output buffers for the CPU graphs' nodes (ops.cpp, declared in graph.h).
at::Tensor hz_rms_norm_out(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& out) {
    return rms_norm_out(x, w, eps, &out);
}
void hz_add_rms_norm_out(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w, double eps,
                         const at::Tensor& y, const at::Tensor& s) {
    add_rms_norm_out(x, r, w, eps, &y, &s);
}
void hz_qk_norm_rope_kv_write_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const std::optional<at::Tensor>& q_w, const std::optional<at::Tensor>& k_w,
                                  const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& positions,
                                  double theta, double eps, const at::Tensor& q_out) {
    qk_norm_rope_kv_write_out(q, k, v, q_w, k_w, k_cache, v_cache, positions, theta, eps, &q_out);
}
void hz_attention_out(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& positions,
                      double scale, const at::Tensor& out) {
    attention_out(q, kc, vc, positions, scale, &out);
}

TORCH_LIBRARY(hanzo_cpu, m) {
    m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm);
    m.def("add_rms_norm(Tensor x, Tensor residual, Tensor w, float eps) -> (Tensor, Tensor)", &add_rms_norm);
    m.def("swiglu(Tensor gate, Tensor up) -> Tensor", &swiglu);
    m.def("qk_norm_rope(Tensor q, Tensor k, Tensor? q_w, Tensor? k_w, Tensor positions, float theta, float eps)"
          " -> (Tensor, Tensor)",
          &qk_norm_rope);
    m.def("kv_cache_write(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor positions) -> ()",
          &kv_cache_write);
    m.def("qk_norm_rope_kv_write(Tensor q, Tensor k, Tensor v, Tensor? q_w, Tensor? k_w, Tensor(a!) k_cache, "
          "Tensor(b!) v_cache, Tensor positions, float theta, float eps) -> Tensor",
          &qk_norm_rope_kv_write);
    m.def("attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor positions, float scale) -> Tensor", &attention);
    m.def("set_attention_prefill(int path) -> int", &set_attention_prefill);
    m.def("set_attention_decode(int path) -> int", &set_attention_decode);
    m.def("moe_route(Tensor probs, int k, bool normalize) -> (Tensor, Tensor)", &moe_route);
}
