// Vulkan kernels of the fused transformer ops (hanzo::rms_norm, add_rms_norm, qk_norm_rope,
// swiglu, kv_cache_write, qk_norm_rope_kv_write, attention, moe_route), registered on the
// PrivateUse1 ("vulkan") key.
//
// Each kernel records one compute dispatch of a shader in csrc/vulkan/shaders/ and returns
// without waiting, like a CUDA kernel launch. Tensors reach the shaders as buffer device
// addresses (hz::vk::address) in push constants; dtypes are run-time codes (fused.glsl), so
// one pipeline per op serves f32/f16/bf16 activations and f32/f16/bf16/q8_0 KV caches. The
// maths is the references' (hanzo_torch/ops/fused.py): float32 statistics, softmax and P*V,
// one rounding to nearest even of each result to its dtype.
//
// As the CPU kernels do (csrc/cpu/ops.cpp), a kernel runs when the call fits it (vulkan
// tensors of the dtypes and shapes its shader was written for: what it needs to be memory-safe,
// not a copy of the Python checks) and hands every other call to torch.ops.hanzo_ref.<op>
// (reference mode never reaches these kernels: hanzo_torch/ops/_dispatch.py registers the
// reference in front of them on the PrivateUse1 key), which raises the op's ValueError for bad
// arguments or computes the result. Positions stay on the device: kv_cache_write skips a
// position outside [0, S); attention lets a position >= S see the whole cache and a negative one
// nothing (zeros), as the Triton kernels do.
#include "../common/hz_constants.h"
#include "../cpu/hz_ops.h"
#include "runtime.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace hz {
namespace vk {
namespace fused {

using hz::ops::kOpNames;  // enum Op, N_OPS, kOpNames: generated from the op table (hz_ops.h)
using hz::ops::N_OPS;
using hz::ops::Op;

}  // namespace fused
}  // namespace vk
}  // namespace hz

namespace {

using hz::vk::fused::Op;

template <class Sig>
c10::TypedOperatorHandle<Sig> ref_op(const char* name) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// dtype codes of fused.glsl
constexpr uint32_t kF32 = 0, kF16 = 1, kBF16 = 2, kQ8_0 = 3;
constexpr int64_t kMaxIndex = int64_t(1) << 31;  // the shaders index elements with 32-bit integers

bool on_vk(const at::Tensor& t) { return t.device().type() == c10::DeviceType::PrivateUse1; }

// An activation (f32/f16/bf16) tensor on the device; its dtype code in *dt.
bool act(const at::Tensor& t, uint32_t* dt) {
    if (!on_vk(t)) return false;
    switch (t.scalar_type()) {
        case at::kFloat: *dt = kF32; return true;
        case at::kHalf: *dt = kF16; return true;
        case at::kBFloat16: *dt = kBF16; return true;
        default: return false;
    }
}

// Integer positions [B, T] on the device that the shaders read: int64 or int32 (*pos32).
bool positions_ok(const at::Tensor& pos, int64_t B, int64_t T, uint32_t* pos32) {
    if (!on_vk(pos) || pos.dim() != 2 || pos.size(0) != B || pos.size(1) != T) return false;
    if (pos.scalar_type() == at::kLong) *pos32 = 0;
    else if (pos.scalar_type() == at::kInt) *pos32 = 1;
    else return false;
    return true;
}

// A KV cache [B, S, Hk, D] of f32/f16/bf16, or q8_0 rows (uint8 [B, S, Hk, D/32*34]), for rows of
// D values; its dtype code in *dt.
bool cache_ok(const at::Tensor& c, int64_t D, uint32_t* dt) {
    if (!on_vk(c) || c.dim() != 4) return false;
    if (c.scalar_type() == at::kByte) {
        *dt = kQ8_0;
        return D % HZ_Q8_0_BLOCK == 0 && c.size(3) == hz_q8_0_row_bytes(D);
    }
    return act(c, dt) && c.size(3) == D;
}

uint64_t addr(const at::Tensor& t) { return hz::vk::address(t); }

// Records a dispatch of `groups` workgroups (x up to 65535, the rest in y: fz_group_index).
void dispatch_groups(const char* shader, const void* push, uint32_t bytes, int64_t groups, uint32_t gz = 1) {
    if (groups <= 0) return;
    const int64_t gx = std::min<int64_t>(groups, 65535), gy = (groups + gx - 1) / gx;
    TORCH_CHECK(gy <= 65535, "hanzo vulkan: ", shader, ": ", groups, " workgroups is more than one dispatch holds");
    hz::vk::dispatch(hz::vk::pipeline(shader), push, bytes, static_cast<uint32_t>(gx), static_cast<uint32_t>(gy), gz);
}

// ---------------------------------------------------------------------------------------------
// rms_norm / add_rms_norm
// ---------------------------------------------------------------------------------------------
struct NormPush {
    uint64_t x, r, w, y, s;
    uint32_t rows, H, dt, dt_w;
    float eps;
};

bool norm_ok(const at::Tensor& x, const at::Tensor& w, uint32_t* dt, uint32_t* dt_w) {
    return act(x, dt) && act(w, dt_w) && w.dim() == 1 && x.dim() >= 1 && w.size(0) == x.size(-1) &&
           x.numel() < kMaxIndex;
}

using NormSig = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddNormSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double);

at::Tensor rms_norm_vk(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
    uint32_t dt, dt_w;
    if (!norm_ok(x_in, w_in, &dt, &dt_w)) {
        static auto ref = ref_op<NormSig>("hanzo_ref::rms_norm");
        return ref.call(x_in, w_in, eps);
    }
    const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
    at::Tensor y = at::empty_like(x);
    const int64_t H = x.size(-1), rows = H ? x.numel() / H : 0;
    if (rows == 0 || H == 0) return y;
    NormPush pc{addr(x), 0, addr(w), addr(y), 0, static_cast<uint32_t>(rows), static_cast<uint32_t>(H), dt, dt_w,
                static_cast<float>(eps)};
    dispatch_groups("rms_norm", &pc, sizeof(pc), rows);
    return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_vk(const at::Tensor& x_in, const at::Tensor& r_in,
                                                   const at::Tensor& w_in, double eps) {
    uint32_t dt, dt_w, dt_r;
    if (!norm_ok(x_in, w_in, &dt, &dt_w) || !act(r_in, &dt_r) || dt_r != dt ||
        r_in.sizes() != x_in.sizes()) {
        static auto ref = ref_op<AddNormSig>("hanzo_ref::add_rms_norm");
        return ref.call(x_in, r_in, w_in, eps);
    }
    const at::Tensor x = x_in.contiguous(), r = r_in.contiguous(), w = w_in.contiguous();
    at::Tensor y = at::empty_like(x), s = at::empty_like(x);
    const int64_t H = x.size(-1), rows = H ? x.numel() / H : 0;
    if (rows == 0 || H == 0) return {y, s};
    NormPush pc{addr(x), addr(r), addr(w), addr(y), addr(s), static_cast<uint32_t>(rows), static_cast<uint32_t>(H),
                dt, dt_w, static_cast<float>(eps)};
    dispatch_groups("add_rms_norm", &pc, sizeof(pc), rows);
    return {y, s};
}

// ---------------------------------------------------------------------------------------------
// swiglu
// ---------------------------------------------------------------------------------------------
struct SwigluPush {
    uint64_t g, u, y;
    uint32_t n, dt;
};

at::Tensor swiglu_vk(const at::Tensor& g_in, const at::Tensor& u_in) {
    uint32_t dt, dt_u;
    if (!act(g_in, &dt) || !act(u_in, &dt_u) || dt_u != dt || g_in.sizes() != u_in.sizes() ||
        g_in.numel() >= kMaxIndex) {
        static auto ref = ref_op<at::Tensor(const at::Tensor&, const at::Tensor&)>("hanzo_ref::swiglu");
        return ref.call(g_in, u_in);
    }
    const at::Tensor g = g_in.contiguous(), u = u_in.contiguous();
    at::Tensor y = at::empty_like(g);
    const int64_t n = g.numel();
    SwigluPush pc{addr(g), addr(u), addr(y), static_cast<uint32_t>(n), dt};
    dispatch_groups("swiglu", &pc, sizeof(pc), (n + 127) / 128);  // 128 invocations a workgroup
    return y;
}

// ---------------------------------------------------------------------------------------------
// qk_norm_rope
// ---------------------------------------------------------------------------------------------
struct QkPush {
    uint64_t q, k, qo, ko, qw, kw, pos, inv_freq;
    uint32_t BT, Hq, Hk, D;
    uint32_t dt, dt_w, pos32, norm;
    float eps;
};

// inv_freq[i] = 1 / theta^(2i / D) (float32 [D/2]) on the device, computed by the same torch
// calls as the reference's rope_cos_sin, once per (theta, D, device).
at::Tensor inv_freq_table(double theta, int64_t D, const at::Device& device) {
    static std::mutex mu;
    // never destroyed: the tables may outlive the device runtime at exit
    static auto* tables = new std::map<std::tuple<double, int64_t, int>, at::Tensor>();
    std::lock_guard<std::mutex> lock(mu);
    const auto key = std::make_tuple(theta, D, static_cast<int>(device.index()));
    auto it = tables->find(key);
    if (it != tables->end()) return it->second;
    const at::Tensor exponent = at::arange(0, D, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) / D;
    const at::Tensor inv = at::pow(theta, exponent).reciprocal();
    at::Tensor table = inv.to(device);
    tables->emplace(key, table);
    return table;
}

using QkSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                                 const std::optional<at::Tensor>&, const at::Tensor&, double, double);

std::tuple<at::Tensor, at::Tensor> qk_norm_rope_vk(const at::Tensor& q_in, const at::Tensor& k_in,
                                                   const std::optional<at::Tensor>& qw_in,
                                                   const std::optional<at::Tensor>& kw_in, const at::Tensor& pos_in,
                                                   double theta, double eps) {
    uint32_t dt = 0, dt_k = 0, dt_w = 0, dt_kw = 0, pos32 = 0;
    bool ok = q_in.dim() == 4 && k_in.dim() == 4 && act(q_in, &dt) && act(k_in, &dt_k) &&
              dt_k == dt && q_in.numel() < kMaxIndex && k_in.numel() < kMaxIndex;
    if (ok) {
        const int64_t B = q_in.size(0), T = q_in.size(1), D = q_in.size(3);
        ok = k_in.size(0) == B && k_in.size(1) == T && k_in.size(3) == D && D % 2 == 0 &&
             positions_ok(pos_in, B, T, &pos32) && qw_in.has_value() == kw_in.has_value();
        if (ok && qw_in.has_value())
            ok = qw_in->dim() == 1 && qw_in->size(0) == D && kw_in->dim() == 1 && kw_in->size(0) == D &&
                 act(*qw_in, &dt_w) && act(*kw_in, &dt_kw) && dt_kw == dt_w;
    }
    if (!ok) {
        static auto ref = ref_op<QkSig>("hanzo_ref::qk_norm_rope");
        return ref.call(q_in, k_in, qw_in, kw_in, pos_in, theta, eps);
    }
    const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), pos = pos_in.contiguous();
    at::Tensor qo = at::empty_like(q), ko = at::empty_like(k);
    const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), Hk = k.size(2), D = q.size(3);
    const int64_t rows = B * T * (Hq + Hk);
    if (rows == 0 || D == 0) return {qo, ko};
    at::Tensor qw, kw;
    if (qw_in.has_value()) {
        qw = qw_in->contiguous();
        kw = kw_in->contiguous();
    }
    const at::Tensor inv_freq = inv_freq_table(theta, D, q.device());
    QkPush pc{addr(q), addr(k), addr(qo), addr(ko), qw.defined() ? addr(qw) : 0, kw.defined() ? addr(kw) : 0,
              addr(pos), addr(inv_freq), static_cast<uint32_t>(B * T), static_cast<uint32_t>(Hq),
              static_cast<uint32_t>(Hk), static_cast<uint32_t>(D), dt, dt_w, pos32, qw.defined() ? 1u : 0u,
              static_cast<float>(eps)};
    dispatch_groups("qk_norm_rope", &pc, sizeof(pc), rows);
    return {qo, ko};
}

// ---------------------------------------------------------------------------------------------
// kv_cache_write
// ---------------------------------------------------------------------------------------------
struct KvPush {
    uint64_t kc, vc, k, v, pos;
    uint32_t BT, T, S, Hk, D;
    uint32_t dt, dt_c, pos32;
};

using KvSig = void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);

void kv_cache_write_vk(at::Tensor& kc, at::Tensor& vc, const at::Tensor& k_in, const at::Tensor& v_in,
                       const at::Tensor& pos_in) {
    uint32_t dt = 0, dt_v = 0, dt_c = 0, dt_vc = 0, pos32 = 0;
    bool ok = kc.dim() == 4 && k_in.dim() == 4 && kc.sizes() == vc.sizes() &&
              k_in.sizes() == v_in.sizes() && act(k_in, &dt) && act(v_in, &dt_v) && dt_v == dt &&
              kc.is_contiguous() && vc.is_contiguous() && k_in.numel() < kMaxIndex;
    if (ok) {
        const int64_t D = k_in.size(3);
        ok = cache_ok(kc, D, &dt_c) && cache_ok(vc, D, &dt_vc) && dt_vc == dt_c && k_in.size(0) == kc.size(0) &&
             k_in.size(2) == kc.size(2) && kc.size(1) < kMaxIndex &&
             positions_ok(pos_in, k_in.size(0), k_in.size(1), &pos32);
    }
    if (!ok) {
        static auto ref = ref_op<KvSig>("hanzo_ref::kv_cache_write");
        ref.call(kc, vc, k_in, v_in, pos_in);
        return;
    }
    const at::Tensor k = k_in.contiguous(), v = v_in.contiguous(), pos = pos_in.contiguous();
    const int64_t B = k.size(0), T = k.size(1), Hk = k.size(2), D = k.size(3);
    if (B * T * Hk == 0 || D == 0) return;
    KvPush pc{addr(kc), addr(vc), addr(k), addr(v), addr(pos), static_cast<uint32_t>(B * T), static_cast<uint32_t>(T),
              static_cast<uint32_t>(kc.size(1)), static_cast<uint32_t>(Hk), static_cast<uint32_t>(D), dt, dt_c, pos32};
    dispatch_groups("kv_cache_write", &pc, sizeof(pc), B * T * Hk);
}

// ---------------------------------------------------------------------------------------------
// qk_norm_rope_kv_write
// ---------------------------------------------------------------------------------------------
struct QkKvPush {
    uint64_t q, k, v, qo, kc, vc, qw, kw, pos, inv_freq;
    uint32_t BT, T, S, Hq, Hk, D;
    uint32_t dt, dt_w, dt_c, pos32, norm;
    float eps;
};
static_assert(sizeof(QkKvPush) <= 128, "push constants of qk_norm_rope_kv_write");

constexpr int64_t kQkKvMaxD = 1024;  // FZ_MAX_D of qk_norm_rope_kv_write.comp

using QkKvSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, at::Tensor&, at::Tensor&, const at::Tensor&, double,
                           double);

// One dispatch of qk_norm_rope_kv_write.comp; a call that one of the two halves' kernels would
// hand to its reference runs the op's reference, and
// rows longer than the shader's shared buffer run the two kernels.
at::Tensor qk_norm_rope_kv_write_vk(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                    const std::optional<at::Tensor>& qw_in, const std::optional<at::Tensor>& kw_in,
                                    at::Tensor& kc, at::Tensor& vc, const at::Tensor& pos_in, double theta,
                                    double eps) {
    uint32_t dt = 0, dt_k = 0, dt_v = 0, dt_w = 0, dt_kw = 0, dt_c = 0, dt_vc = 0, pos32 = 0;
    bool ok = q_in.dim() == 4 && k_in.dim() == 4 && act(q_in, &dt) && act(k_in, &dt_k) && act(v_in, &dt_v) &&
              dt_k == dt && dt_v == dt && v_in.sizes() == k_in.sizes() && q_in.numel() < kMaxIndex &&
              k_in.numel() < kMaxIndex && kc.dim() == 4 && kc.sizes() == vc.sizes() && kc.is_contiguous() &&
              vc.is_contiguous();
    if (ok) {
        const int64_t B = q_in.size(0), T = q_in.size(1), D = q_in.size(3);
        ok = k_in.size(0) == B && k_in.size(1) == T && k_in.size(3) == D && D % 2 == 0 &&
             positions_ok(pos_in, B, T, &pos32) && qw_in.has_value() == kw_in.has_value() && cache_ok(kc, D, &dt_c) &&
             cache_ok(vc, D, &dt_vc) && dt_vc == dt_c && kc.size(0) == B && kc.size(2) == k_in.size(2) &&
             kc.size(1) < kMaxIndex;
        if (ok && qw_in.has_value())
            ok = qw_in->dim() == 1 && qw_in->size(0) == D && kw_in->dim() == 1 && kw_in->size(0) == D &&
                 act(*qw_in, &dt_w) && act(*kw_in, &dt_kw) && dt_kw == dt_w;
    }
    if (!ok) {
        static auto ref = ref_op<QkKvSig>("hanzo_ref::qk_norm_rope_kv_write");
        return ref.call(q_in, k_in, v_in, qw_in, kw_in, kc, vc, pos_in, theta, eps);
    }
    if (q_in.size(3) > kQkKvMaxD) {
        auto qk = qk_norm_rope_vk(q_in, k_in, qw_in, kw_in, pos_in, theta, eps);
        kv_cache_write_vk(kc, vc, std::get<1>(qk), v_in, pos_in);
        return std::get<0>(qk);
    }
    const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), pos = pos_in.contiguous();
    at::Tensor qo = at::empty_like(q);
    const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), Hk = k.size(2), D = q.size(3);
    const int64_t rows = B * T * (Hq + Hk);
    if (rows == 0 || D == 0) return qo;
    at::Tensor qw, kw;
    if (qw_in.has_value()) {
        qw = qw_in->contiguous();
        kw = kw_in->contiguous();
    }
    const at::Tensor inv_freq = inv_freq_table(theta, D, q.device());
    QkKvPush pc{addr(q), addr(k), addr(v), addr(qo), addr(kc), addr(vc), qw.defined() ? addr(qw) : 0,
                kw.defined() ? addr(kw) : 0, addr(pos), addr(inv_freq), static_cast<uint32_t>(B * T),
                static_cast<uint32_t>(T), static_cast<uint32_t>(kc.size(1)), static_cast<uint32_t>(Hq),
                static_cast<uint32_t>(Hk), static_cast<uint32_t>(D), dt, dt_w, dt_c, pos32, qw.defined() ? 1u : 0u,
                static_cast<float>(eps)};
    dispatch_groups("qk_norm_rope_kv_write", &pc, sizeof(pc), rows);
    return qo;
}

// ---------------------------------------------------------------------------------------------
// attention
// ---------------------------------------------------------------------------------------------
struct AttnPush {
    uint64_t q, kc, vc, out, pos, part, counter;
    uint32_t BT, T, S, Hq, Hk, D;
    uint32_t dt, dt_c, pos32, nsplit;
    float scale;
};

constexpr int64_t kAttnChunk = 64;        // keys per chunk of the shader (FZ_CHUNK)
constexpr int64_t kAttnBusyGroups = 128;  // (b, t, kv head) workgroups from which no split is needed
constexpr int64_t kAttnMaxSplit = 32;     // key splits per (b, t, kv head) at most
// shared memory of attention.comp: queries and accumulators [2048] each, scores [16 * 64], and
// per-head m, l, correction [16] (a device with less runs the reference)
constexpr uint32_t kAttnSharedBytes = 4 * (2 * 2048 + 16 * 64 + 3 * 16) + 4;

// The split attention's completion counters: int32 [n] zeros on the device, kept between calls
// (the shader leaves every counter it used at 0 again) and grown on demand. Dispatches are
// serialized by the runtime's barriers, so one array serves every call.
at::Tensor attention_counters(int64_t n, const at::Device& device) {
    static std::mutex mu;
    static auto* counters = new std::map<int, at::Tensor>();  // by device index; never destroyed (exit order)
    std::lock_guard<std::mutex> lock(mu);
    at::Tensor& c = (*counters)[static_cast<int>(device.index())];
    if (!c.defined() || c.numel() < n)
        c = at::zeros({std::max<int64_t>(n, 1024)}, at::TensorOptions().dtype(at::kInt).device(device));
    return c;
}

using AttnRefSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                              c10::string_view);

// attention_prefill.comp: blocks of BQ query tokens of one KV head (R = BQ * G rows <= 64 and
// R * D <= 4096 floats of accumulators), key/value tiles of 1024 floats each (D <= 1024), 16 keys
// at most. Taken from kAttnPrefillTokens query tokens per sequence on, where decode's key split
// is not needed to keep the device busy.
struct AttnPrefillPush {
    uint64_t q, kc, vc, out, pos;
    uint32_t B, T, S, Hq, Hk, D;
    uint32_t dt, dt_c, pos32, BQ;
    float scale;
};
constexpr int64_t kAttnPrefillTokens = 8;
constexpr int64_t kAttnPrefillRows = 64, kAttnPrefillAcc = 4096, kAttnPrefillKv = 1024;
// acc [4096], k and v tiles [1024] each, probabilities [64 * 16], m, l, correction, n [64], nmax
constexpr uint32_t kAttnPrefillSharedBytes = 4 * (4096 + 2 * 1024 + 64 * 16 + 4 * 64 + 1);

at::Tensor attention_vk(const at::Tensor& q_in, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& pos_in,
                        double scale, c10::string_view impl) {
    uint32_t dt = 0, dt_c = 0, dt_vc = 0, pos32 = 0;
    bool ok = (impl == "auto" || impl == "eager" || impl == "flash") && q_in.dim() == 4 &&
              act(q_in, &dt) && kc.dim() == 4 && kc.sizes() == vc.sizes() && kc.is_contiguous() && vc.is_contiguous() &&
              q_in.numel() < kMaxIndex;
    if (ok) {
        const int64_t B = q_in.size(0), T = q_in.size(1), Hq = q_in.size(2), D = q_in.size(3), Hk = kc.size(2);
        ok = kc.size(0) == B && cache_ok(kc, D, &dt_c) && cache_ok(vc, D, &dt_vc) && dt_vc == dt_c && Hk > 0 &&
             Hq % Hk == 0 && Hq / Hk <= 16 && (Hq / Hk) * D <= 2048 && kc.size(1) < kMaxIndex &&
             positions_ok(pos_in, B, T, &pos32) && hz::vk::features().shared_memory_bytes >= kAttnSharedBytes;
    }
    if (!ok) {
        static auto ref = ref_op<AttnRefSig>("hanzo_ref::attention");
        return ref.call(q_in, kc, vc, pos_in, scale, impl);
    }
    const at::Tensor q = q_in.contiguous(), pos = pos_in.contiguous();
    at::Tensor out = at::empty_like(q);
    const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), S = kc.size(1), Hk = kc.size(2);
    const int64_t items = B * T * Hk;
    if (items == 0 || D == 0) return out;
    const int64_t G = Hq / Hk;
    if (T >= kAttnPrefillTokens && D <= kAttnPrefillKv && G * D <= kAttnPrefillAcc && G <= kAttnPrefillRows &&
        hz::vk::features().shared_memory_bytes >= kAttnPrefillSharedBytes) {
        const int64_t BQ = std::min({T, kAttnPrefillRows / G, kAttnPrefillAcc / (G * D)});
        AttnPrefillPush pc{addr(q), addr(kc), addr(vc), addr(out), addr(pos), static_cast<uint32_t>(B),
                           static_cast<uint32_t>(T), static_cast<uint32_t>(S), static_cast<uint32_t>(Hq),
                           static_cast<uint32_t>(Hk), static_cast<uint32_t>(D), dt, dt_c, pos32,
                           static_cast<uint32_t>(BQ), static_cast<float>(scale)};
        dispatch_groups("attention_prefill", &pc, sizeof(pc), B * ((T + BQ - 1) / BQ) * Hk);
        return out;
    }
    // Few (b, t, kv head) items (decode): split the keys so that a long cache is read by many
    // workgroups. The split count follows S, not the positions (which stay on the device).
    const int64_t chunks = (S + kAttnChunk - 1) / kAttnChunk;
    const int64_t nsplit = items >= kAttnBusyGroups
                               ? 1
                               : std::max<int64_t>(1, std::min({chunks, kAttnMaxSplit, kAttnBusyGroups / items}));
    AttnPush pc{addr(q), addr(kc), addr(vc), addr(out), addr(pos), 0, 0, static_cast<uint32_t>(B * T),
                static_cast<uint32_t>(T), static_cast<uint32_t>(S), static_cast<uint32_t>(Hq),
                static_cast<uint32_t>(Hk), static_cast<uint32_t>(D), dt, dt_c, pos32, static_cast<uint32_t>(nsplit),
                static_cast<float>(scale)};
    at::Tensor part;
    if (nsplit > 1) {
        part = at::empty({items * nsplit * G * (D + 2)}, q.options().dtype(at::kFloat));
        pc.part = addr(part);
        pc.counter = addr(attention_counters(items, q.device()));
    }
    dispatch_groups("attention", &pc, sizeof(pc), items, static_cast<uint32_t>(nsplit));
    return out;
}

// ---------------------------------------------------------------------------------------------
// moe_route
// ---------------------------------------------------------------------------------------------
struct RoutePush {
    uint64_t logits, w, ids;
    uint32_t T, E, k, normalize, dt;
};

using RouteRefSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, c10::SymInt, bool);

std::tuple<at::Tensor, at::Tensor> moe_route_vk(const at::Tensor& logits_in, c10::SymInt sym_k, bool normalize) {
    uint32_t dt = 0;
    const int64_t k = sym_k.guard_int(__FILE__, __LINE__);
    if (!act(logits_in, &dt) || logits_in.dim() != 2 || k < 1 || k > logits_in.size(1) ||
        logits_in.size(1) > 1024 || k > 256 || logits_in.numel() >= kMaxIndex) {
        static auto ref = ref_op<RouteRefSig>("hanzo_ref::moe_route");
        return ref.call(logits_in, sym_k, normalize);
    }
    const at::Tensor logits = logits_in.contiguous();
    const int64_t T = logits.size(0), E = logits.size(1);
    at::Tensor w = at::empty({T, k}, logits.options().dtype(at::kFloat));
    at::Tensor ids = at::empty({T, k}, logits.options().dtype(at::kLong));
    RoutePush pc{addr(logits), addr(w), addr(ids), static_cast<uint32_t>(T), static_cast<uint32_t>(E),
                 static_cast<uint32_t>(k), normalize ? 1u : 0u, dt};
    dispatch_groups("moe_route", &pc, sizeof(pc), T);
    return {w, ids};
}

}  // namespace

TORCH_LIBRARY_IMPL(hanzo, PrivateUse1, m) {
    m.impl("rms_norm", TORCH_FN(rms_norm_vk));
    m.impl("add_rms_norm", TORCH_FN(add_rms_norm_vk));
    m.impl("qk_norm_rope", TORCH_FN(qk_norm_rope_vk));
    m.impl("swiglu", TORCH_FN(swiglu_vk));
    m.impl("kv_cache_write", TORCH_FN(kv_cache_write_vk));
    m.impl("qk_norm_rope_kv_write", TORCH_FN(qk_norm_rope_kv_write_vk));
    m.impl("attention", TORCH_FN(attention_vk));
    m.impl("moe_route", TORCH_FN(moe_route_vk));
}
