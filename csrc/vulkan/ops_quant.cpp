// The Vulkan kernels of the quantized hanzo ops (dequantize, get_rows, quantize_q8_1, mul_mat,
// mul_mat_id, swiglu_mul_mat), registered on the PrivateUse1 ("vulkan") dispatch key.
//
// Each kernel runs its shaders when the call fits them (a format of the Vulkan rule table,
// float32/float16/bfloat16 activations, int32/int64 ids, every tensor on the vulkan device) and
// hands every other call to the op's reference, torch.ops.hanzo_ref.<op>, which also raises the
// op's usual ValueError/IndexError for bad arguments. The fit tests are what the shaders need to
// be memory-safe, not a copy of the Python checks. A quantized format without a rule goes to the
// reference with one Python warning per format. The first call has the Python side
// (hanzo_torch/backends/vulkan/quant.py) hand the rule table and the i-quant grids to
// hanzo_vulkan::quant_configure; reference mode (hanzo_torch.ops.use_reference,
// HANZO_<OP>_FALLBACK) never reaches these kernels (hanzo_torch/ops/_dispatch.py registers the
// reference in front of them on the PrivateUse1 key).
//
// Shaders (csrc/vulkan/shaders, one SPIR-V per format: "<shader>.<FORMAT>"): dequantize (also
// get_rows, rows by id), mul_mat_vec (up to kMatVecRows activation rows), mul_mat (tiled GEMM),
// mul_mat_id (decode: one workgroup per output value of a (token, slot) pair; from
// kIdGroupedPairs pairs on, the pairs sorted by expert on the device by mul_mat_id_sort, then one
// workgroup per output column and chunk of sorted pairs, each weight run read once per expert of
// the chunk), swiglu_mul_mat (the SwiGLU epilogue after the two projections) and
// swiglu_mul_mat_vec (the float gate and up mat-vecs of one format and the epilogue in one
// dispatch, for up to kMatVecRows rows). Ids are read on the device, never on the host: an id out
// of range gives NaN in its output row (the ops stay asynchronous).
//
// int8 path of mul_mat (and of swiglu_mul_mat's projections): the activation rows are quantized
// on the device to ggml q8_1 blocks (quantize_q8_1.comp, bit-exact with the op's reference), then
// mul_mat_vec_q8 / mul_mat_q8 ("<shader>.<FORMAT>", formats of kInt8Formats) dot them with the
// weights' integer codes (int8 dot products, SPV_KHR_integer_dot_product) and scale per group.
// Taken by default where the device reports integerDotProduct4x8BitPackedSignedAccelerated;
// HANZO_VK_INT8=1 forces it wherever shaderIntegerDotProduct is enabled, =0 turns it off
// (hanzo_vulkan::quant_set_int8 changes the mode in process). Other formats keep the float path.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <atomic>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "../common/format_lookup.h"
#include "../common/hz_constants.h"
#include "../cpu/hz_ops.h"
#include "int8_formats.h"
#include "runtime.h"

namespace hz::vk::quant {
namespace {

using namespace hz::ops;  // enum Op, N_OPS, kOpNames: generated from the op table (hz_ops.h)

constexpr int64_t kMatVecRows = HZ_VK_MATVEC_MAX_ROWS;  // HZ_MV_MAX_M of mul_mat_vec.comp
constexpr int64_t kTile = 64;             // BM = BN of mul_mat.comp
constexpr uint32_t kMaxGroups = 65535;    // the smallest maxComputeWorkGroupCount Vulkan allows
constexpr int64_t kQ8Block = HZ_Q8_1_BLOCK, kQ8Bytes = HZ_Q8_1_BYTES;  // values and bytes per q8_1 block

// the formats with int8 rules, for which mul_mat_q8.comp and mul_mat_vec_q8.comp are compiled
const char* const kInt8Formats[] = {HZ_VK_INT8_FORMATS};

// int8 mode: 0 off, 1 forced on (where the device enables integer dot products), 2 where they are
// accelerated; HANZO_VK_INT8 (0 / 1, unset: 2) read once
int int8_mode_from_env() {
  const char* v = std::getenv("HANZO_VK_INT8");
  if (v == nullptr || *v == '\0') return 2;
  const std::string s(v);
  if (s == "0" || s == "false" || s == "off" || s == "no") return 0;
  if (s == "1" || s == "true" || s == "on" || s == "yes") return 1;
  TORCH_WARN_ONCE("hanzo vulkan: HANZO_VK_INT8=", s, " is not 0 or 1; the int8 path is taken where the device "
                  "accelerates it");
  return 2;
}
std::atomic<int> g_int8_mode{-1};
int int8_mode() {
  int m = g_int8_mode.load(std::memory_order_relaxed);
  if (m < 0) {
    int expected = -1;
    g_int8_mode.compare_exchange_strong(expected, int8_mode_from_env());
    m = g_int8_mode.load();
  }
  return m;
}

// Whether mul_mat of qtype (K values per row) takes the int8 path.
bool int8_for(c10::string_view qtype, int64_t K) {
  const int mode = int8_mode();
  if (mode == 0 || K % kQ8Block != 0 || !features().int8_dot) return false;
  if (mode == 2 && !features().int8_dot_accelerated) return false;
  for (const char* f : kInt8Formats)
    if (qtype == c10::string_view(f)) return true;
  return false;
}

std::atomic<bool> g_configured{false};
struct Fmt {
  int64_t qk, ts;
  at::Tensor table;  // int8 on the device: the grid the shaders read at hz_table (undefined if none)
  uint64_t table_address() const { return table.defined() ? address(table) : 0; }
};
// the rule table, set once by configure(); never destroyed: its device tables must not be freed
// after the runtime at exit
std::unordered_map<std::string, Fmt>& g_formats = *new std::unordered_map<std::string, Fmt>();
std::unordered_set<std::string> g_lacking;       // registered quantized formats without a rule

std::atomic<bool> g_configure_tried{false};

// The first call configures the kernels from the Python side (once; a failure is one warning and
// the ops keep running the reference).
void ensure_configured() {
  if (g_configured.load(std::memory_order_acquire) || g_configure_tried.exchange(true)) return;
  py::gil_scoped_acquire gil;
  try {
    py::module_::import("hanzo_torch.backends.vulkan.quant").attr("configure")();
  } catch (py::error_already_set& e) {
    const std::string msg = std::string("hanzo vulkan: the quantized-op kernels could not be configured (") +
                            e.what() + "); their ops run the torch reference";
    e.restore();
    PyErr_Clear();
    if (PyErr_WarnEx(PyExc_RuntimeWarning, msg.c_str(), 1) != 0) PyErr_Clear();
  }
}

// Until the rule table is configured every call goes to the reference (the op argument names the caller).
bool use_ref(Op) {
  ensure_configured();
  return !g_configured.load(std::memory_order_acquire);
}

template <class Sig>
c10::TypedOperatorHandle<Sig> ref_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// The rule of qtype, or nullptr (after one warning per format when it is a quantized format
// without a rule).
const Fmt* format_of(c10::string_view qtype) {
  return hz::find_format(g_formats, g_lacking, qtype, "hanzo vulkan", "shader rule");
}

bool on_device(const at::Tensor& t) { return t.device().type() == c10::DeviceType::PrivateUse1; }

// dtype code of the shaders (HZ_DT_* of formats.glsl), -1 for others
int dtype_code(at::ScalarType d) {
  return d == at::kFloat ? 0 : d == at::kHalf ? 1 : d == at::kBFloat16 ? 2 : -1;
}
bool is_act(const at::Tensor& t) { return on_device(t) && dtype_code(t.scalar_type()) >= 0; }
bool is_ids(const at::Tensor& t) {
  return on_device(t) && (t.scalar_type() == at::kLong || t.scalar_type() == at::kInt);
}

// The rule for a packed weight w ([..., rows, row_bytes], dims dims) of row length K.
const Fmt* packed_ok(const at::Tensor& w, int64_t dims, c10::string_view qtype, int64_t K) {
  if (!(on_device(w) && w.scalar_type() == at::kByte && w.dim() == dims)) return nullptr;
  const Fmt* f = format_of(qtype);
  if (f == nullptr || K % f->qk != 0 || w.size(-1) != K / f->qk * f->ts) return nullptr;
  return f;
}

std::string spv(const char* shader, c10::string_view qtype) { return std::string(shader) + "." + std::string(qtype); }

// (gx, gy) workgroups covering n groups with gx <= kMaxGroups (shaders index x + NumWorkGroups.x * y)
void split_groups(int64_t n, uint32_t& gx, uint32_t& gy) {
  gx = (uint32_t)std::min<int64_t>(n, kMaxGroups);
  gy = gx == 0 ? 0 : (uint32_t)((n + gx - 1) / gx);
}

// Push constants of mul_mat_vec.comp and mul_mat.comp (std430: the same order and sizes).
struct MatPush {
  uint64_t w, x, y, table;
  uint32_t N, K, M, row_bytes, x_stride, y_stride, x_dtype, y_dtype;
};

// Push constants of quantize_q8_1.comp.
struct Q8Push {
  uint64_t x, y, n_blocks;
  uint32_t blocks_per_row, x_stride, x_dtype;
};

// q8_1 blocks uint8 [R, K / 32 * 36] of the rows of x2 [R, K] (contiguous, K % 32 == 0).
at::Tensor run_quantize_q8_1(const at::Tensor& x2) {
  const int64_t R = x2.size(0), K = x2.size(1);
  TORCH_CHECK(K <= UINT32_MAX, "hanzo vulkan quantize_q8_1: rows too long");
  at::Tensor out = at::empty({R, K / kQ8Block * kQ8Bytes}, x2.options().dtype(at::kByte));
  const int64_t n = R * (K / kQ8Block);
  if (n == 0) return out;
  Q8Push p{address(x2), address(out), (uint64_t)n, (uint32_t)(K / kQ8Block), (uint32_t)K,
           (uint32_t)dtype_code(x2.scalar_type())};
  uint32_t gx, gy;
  groups_1d((uint64_t)n, 64, gx, gy);
  dispatch(pipeline("quantize_q8_1"), &p, sizeof(p), gx, gy);
  return out;
}

// y [M, N] (y_dtype, row stride N) = x [M, K] (contiguous) @ W^T for the packed w [N, rb]. xq: the
// q8_1 blocks of x when the caller has them (the int8 path; quantized here when undefined).
void run_mul_mat(const at::Tensor& x2, const at::Tensor& w, const Fmt& f, c10::string_view qtype,
                 const at::Tensor& y, at::Tensor xq = at::Tensor()) {
  const int64_t M = x2.size(0), K = x2.size(1), N = w.size(0);
  TORCH_CHECK(N <= UINT32_MAX && K <= UINT32_MAX && w.size(1) <= UINT32_MAX, "hanzo vulkan mul_mat: weight too large");
  MatPush p{address(w), address(x2), address(y), f.table_address(), (uint32_t)N, (uint32_t)K, 0, (uint32_t)w.size(1), (uint32_t)K,
            (uint32_t)N, (uint32_t)dtype_code(x2.scalar_type()), (uint32_t)dtype_code(y.scalar_type())};
  const bool int8 = int8_for(qtype, K);
  int64_t x_row_bytes = K * x2.element_size();
  if (int8) {
    if (!xq.defined()) xq = run_quantize_q8_1(x2);
    x_row_bytes = K / kQ8Block * kQ8Bytes;
    TORCH_CHECK(x_row_bytes <= UINT32_MAX, "hanzo vulkan mul_mat: rows too long");
    p.x = address(xq);
    p.x_stride = (uint32_t)x_row_bytes;  // bytes between q8_1 rows
  }
  if (M <= kMatVecRows) {
    p.M = (uint32_t)M;
    uint32_t gx, gy;
    split_groups(N, gx, gy);
    dispatch(pipeline(spv(int8 ? "mul_mat_vec_q8" : "mul_mat_vec", qtype)), &p, sizeof(p), gx, gy);
    return;
  }
  // row blocks of at most kMaxGroups tiles per dispatch
  const int64_t rows_per = (int64_t)kMaxGroups * kTile;
  Pipeline& pipe = pipeline(spv(int8 ? "mul_mat_q8" : "mul_mat", qtype));
  const uint64_t x0 = p.x;
  for (int64_t m0 = 0; m0 < M; m0 += rows_per) {
    const int64_t m = std::min(rows_per, M - m0);
    p.M = (uint32_t)m;
    p.x = x0 + (uint64_t)(m0 * x_row_bytes);
    p.y = address(y) + (uint64_t)(m0 * N * y.element_size());
    dispatch(pipe, &p, sizeof(p), (uint32_t)((N + kTile - 1) / kTile), (uint32_t)((m + kTile - 1) / kTile));
  }
}

// rows of x [..., K]: the product of its leading dims (also when K == 0)
int64_t leading(const at::Tensor& x) {
  int64_t m = 1;
  for (int64_t i = 0; i + 1 < x.dim(); ++i) m *= x.size(i);
  return m;
}

at::Tensor rows_to(const at::Tensor& y, const at::Tensor& x, int64_t N) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(N);
  return y.view(shape);
}

at::Tensor mul_mat_vk(const at::Tensor& x, const at::Tensor& w, c10::string_view qtype) {
  const Fmt* f = nullptr;
  if (use_ref(MUL_MAT) || !is_act(x) || x.dim() < 1 || !(f = packed_ok(w, 2, qtype, x.size(-1)))) {
    static auto ref = ref_op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view)>("hanzo_ref::mul_mat");
    return ref.call(x, w, qtype);
  }
  const int64_t K = x.size(-1), N = w.size(0), M = leading(x);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0 && N > 0) {
    if (K == 0) {
      y.zero_();
    } else {
      run_mul_mat(x.reshape({M, K}).contiguous(), w.contiguous(), *f, qtype, y);
    }
  }
  return rows_to(y, x, N);
}

// Push constants of mul_mat_id_sort.comp.
struct SortPush {
  uint64_t ids, order, expert;
  uint32_t n_pairs, E, ids_int64;
};
constexpr int64_t kIdGroupedPairs = 16;  // (token, slot) pairs from which mul_mat_id groups them by expert
constexpr int64_t kIdChunk = 8;          // HZ_CHUNK of mul_mat_id.comp: sorted pairs per workgroup
constexpr int64_t kIdMaxExperts = 4096;  // MAX_E of mul_mat_id_sort.comp

// Push constants of mul_mat_id.comp.
struct IdPush {
  uint64_t w, x, y, ids, table, order, expert;
  uint32_t N, K, E, row_bytes, n_pairs, n_slots, p0, x_per_slot, x_dtype, y_dtype, ids_int64;
};

at::Tensor mul_mat_id_vk(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ids, c10::string_view qtype) {
  const Fmt* f = nullptr;
  bool ok = !use_ref(MUL_MAT_ID) && is_act(x) && (x.dim() == 2 || x.dim() == 3) && is_ids(ids) && ids.dim() == 2 &&
            (f = packed_ok(w, 3, qtype, x.size(-1))) != nullptr;
  if (ok) ok = x.size(0) == ids.size(0) && (x.dim() == 2 || x.size(1) == ids.size(1));
  if (!ok) {
    static auto ref = ref_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view)>(
        "hanzo_ref::mul_mat_id");
    return ref.call(x, w, ids, qtype);
  }
  const int64_t T = ids.size(0), k = ids.size(1), E = w.size(0), N = w.size(1), K = x.size(-1);
  at::Tensor out = at::empty({T, k, N}, x.options());
  if (T * k == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  const at::Tensor xc = x.contiguous(), wc = w.contiguous(), idc = ids.contiguous();
  IdPush p{address(wc), address(xc), address(out), address(idc), f->table_address(), 0, 0, (uint32_t)N, (uint32_t)K,
           (uint32_t)E, (uint32_t)w.size(2), (uint32_t)(T * k), (uint32_t)k, 0, (uint32_t)(x.dim() == 3 ? 1 : 0),
           (uint32_t)dtype_code(x.scalar_type()), (uint32_t)dtype_code(x.scalar_type()),
           (uint32_t)(ids.scalar_type() == at::kLong ? 1 : 0)};
  uint32_t gx, gy;
  split_groups(N, gx, gy);
  Pipeline& pipe = pipeline(spv("mul_mat_id", qtype));
  if (T * k >= kIdGroupedPairs && E <= kIdMaxExperts && T * k <= INT32_MAX) {
    // grouped by expert: a counting sort of the ids on the device, then chunks of sorted pairs
    at::Tensor sorted = at::empty({2, T * k}, ids.options().dtype(at::kInt));
    SortPush sp{address(idc), address(sorted), address(sorted) + (uint64_t)(T * k * 4), (uint32_t)(T * k), (uint32_t)E,
                p.ids_int64};
    dispatch(pipeline("mul_mat_id_sort"), &sp, sizeof(sp), 1);
    p.order = sp.order;
    p.expert = sp.expert;
    const int64_t per = (int64_t)kMaxGroups * kIdChunk;
    for (int64_t p0 = 0; p0 < T * k; p0 += per) {
      p.p0 = (uint32_t)p0;
      dispatch(pipe, &p, sizeof(p), gx, gy, (uint32_t)((std::min(per, T * k - p0) + kIdChunk - 1) / kIdChunk));
    }
    return out;
  }
  for (int64_t p0 = 0; p0 < T * k; p0 += kMaxGroups) {
    p.p0 = (uint32_t)p0;
    dispatch(pipe, &p, sizeof(p), gx, gy, (uint32_t)std::min<int64_t>(kMaxGroups, T * k - p0));
  }
  return out;
}

// Push constants of swiglu_mul_mat.comp.
struct SwigluPush {
  uint64_t g, u, dst;
  uint32_t n, round_dtype, out_dtype;
};

// Push constants of swiglu_mul_mat_vec.comp.
struct SwigluVecPush {
  uint64_t wg, wu, x, y, table;
  uint32_t N, K, M, row_bytes, x_stride, y_stride, x_dtype, y_dtype, round_dtype;
};

// Decode-sized swiglu_mul_mat with gate and up of one format on the float path (not int8):
// one dispatch of swiglu_mul_mat_vec (both mat-vecs and the epilogue) instead of three (true: in
// effect).
// hanzo_vulkan::swiglu_mul_mat_fused switches it off in process, for an A/B against the three.
std::atomic<bool> g_swiglu_fused{true};

at::Tensor swiglu_mul_mat_vk(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu, c10::string_view qg,
                             c10::string_view qu) {
  const Fmt *fg = nullptr, *fu = nullptr;
  if (use_ref(SWIGLU_MUL_MAT) || !is_act(x) || x.dim() < 1 || !(fg = packed_ok(wg, 2, qg, x.size(-1))) ||
      !(fu = packed_ok(wu, 2, qu, x.size(-1))) || wg.size(0) != wu.size(0)) {
    static auto ref = ref_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view,
                                        c10::string_view)>("hanzo_ref::swiglu_mul_mat");
    return ref.call(x, wg, wu, qg, qu);
  }
  const int64_t K = x.size(-1), F = wg.size(0), M = leading(x);
  at::Tensor y = at::empty({M, F}, x.options());
  if (M == 0 || F == 0) return rows_to(y, x, F);
  if (K == 0) return rows_to(y.zero_(), x, F);  // silu(0) * 0
  const at::Tensor x2 = x.reshape({M, K}).contiguous();
  const uint32_t dt = (uint32_t)dtype_code(x.scalar_type());
  if (M <= kMatVecRows && qg == qu && !int8_for(qg, K) && g_swiglu_fused.load(std::memory_order_relaxed)) {
    TORCH_CHECK(F <= UINT32_MAX && K <= UINT32_MAX && wg.size(1) <= UINT32_MAX,
                "hanzo vulkan swiglu_mul_mat: weight too large");
    const at::Tensor wgc = wg.contiguous(), wuc = wu.contiguous();
    SwigluVecPush p{address(wgc), address(wuc), address(x2), address(y), fg->table_address(), (uint32_t)F, (uint32_t)K,
                    (uint32_t)M, (uint32_t)wg.size(1), (uint32_t)K, (uint32_t)F, dt, dt, dt};
    uint32_t gx, gy;
    split_groups(F, gx, gy);
    dispatch(pipeline(spv("swiglu_mul_mat_vec", qg)), &p, sizeof(p), gx, gy);
    return rows_to(y, x, F);
  }
  at::Tensor g = at::empty({M, F}, x.options().dtype(at::kFloat));
  at::Tensor u = at::empty({M, F}, x.options().dtype(at::kFloat));
  // the q8_1 activations of an int8 projection, quantized once for both and before them
  const at::Tensor xq = int8_for(qg, K) || int8_for(qu, K) ? run_quantize_q8_1(x2) : at::Tensor();
  {
    Concurrent both;  // the two projections are independent
    run_mul_mat(x2, wg.contiguous(), *fg, qg, g, xq);
    run_mul_mat(x2, wu.contiguous(), *fu, qu, u, xq);
  }
  const int64_t n = M * F;
  TORCH_CHECK(n <= UINT32_MAX, "hanzo vulkan swiglu_mul_mat: output too large");
  SwigluPush p{address(g), address(u), address(y), (uint32_t)n, dt, dt};
  const int64_t groups = (n + 255) / 256;
  dispatch(pipeline("swiglu_mul_mat"), &p, sizeof(p), (uint32_t)std::min<int64_t>(groups, kMaxGroups),
           (uint32_t)((groups + kMaxGroups - 1) / kMaxGroups));
  return rows_to(y, x, F);
}

// Push constants of dequantize.comp.
struct DeqPush {
  uint64_t src, dst, ids, table;
  uint32_t row_bytes, K, n_rows, r0, n_src, out_dtype, ids_int64;
};

// rows [n_rows, K] of out's dtype from packed src [n_src, rb] (ids: the source row of each output row)
void run_dequantize(const at::Tensor& src, int64_t n_src, int64_t rb, int64_t K, const at::Tensor* ids,
                    int64_t n_rows, const Fmt& f, c10::string_view qtype, const at::Tensor& out) {
  TORCH_CHECK(K <= UINT32_MAX && rb <= UINT32_MAX && n_src <= UINT32_MAX && n_rows <= UINT32_MAX,
              "hanzo vulkan dequantize: tensor too large");
  DeqPush p{address(src), address(out), ids ? address(*ids) : 0, f.table_address(), (uint32_t)rb, (uint32_t)K, (uint32_t)n_rows, 0,
            (uint32_t)n_src, (uint32_t)dtype_code(out.scalar_type()),
            (uint32_t)(ids && ids->scalar_type() == at::kLong ? 1 : 0)};
  const uint32_t gy = (uint32_t)std::min<int64_t>(n_rows, kMaxGroups);
  dispatch(pipeline(spv("dequantize", qtype)), &p, sizeof(p), (uint32_t)((K + 255) / 256), gy,
           (uint32_t)((n_rows + kMaxGroups - 1) / kMaxGroups));
}

at::Tensor get_rows_vk(const at::Tensor& w, const at::Tensor& ids, c10::string_view qtype, at::ScalarType dtype) {
  const Fmt* f = nullptr;
  if (!use_ref(GET_ROWS) && on_device(w) && w.scalar_type() == at::kByte && w.dim() == 2 && is_ids(ids) &&
      dtype_code(dtype) >= 0)
    f = format_of(qtype);
  if (f == nullptr || w.size(1) % f->ts != 0) {
    static auto ref = ref_op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, at::ScalarType)>(
        "hanzo_ref::get_rows");
    return ref.call(w, ids, qtype, dtype);
  }
  const int64_t rb = w.size(1), K = rb / f->ts * f->qk, n = ids.numel();
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(K);
  at::Tensor out = at::empty(shape, w.options().dtype(dtype));
  if (n == 0 || K == 0) return out;
  const at::Tensor idc = ids.contiguous();
  run_dequantize(w.contiguous(), w.size(0), rb, K, &idc, n, *f, qtype, out);
  return out;
}

at::Tensor dequantize_vk(const at::Tensor& data, c10::string_view qtype, c10::SymIntArrayRef sym_shape,
                         at::ScalarType dtype) {
  const Fmt* f = nullptr;
  std::vector<int64_t> shape;
  int64_t rows = 1, rb = 0;
  if (!use_ref(DEQUANTIZE) && on_device(data) && data.scalar_type() == at::kByte && !sym_shape.empty() &&
      dtype_code(dtype) >= 0 && (f = format_of(qtype)) != nullptr) {
    for (const c10::SymInt& v : sym_shape) shape.push_back(v.guard_int(__FILE__, __LINE__));
    const int64_t K = shape.back();
    for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
    bool ok = K > 0 && K % f->qk == 0 && rows > 0;
    if (ok) {
      rb = K / f->qk * f->ts;
      ok = data.numel() == rows * rb;
    }
    if (!ok) f = nullptr;
  }
  if (f == nullptr) {
    static auto ref = ref_op<at::Tensor(const at::Tensor&, c10::string_view, c10::SymIntArrayRef, at::ScalarType)>(
        "hanzo_ref::dequantize");
    return ref.call(data, qtype, sym_shape, dtype);
  }
  at::Tensor out = at::empty(shape, data.options().dtype(dtype));
  run_dequantize(data.contiguous(), rows, rb, shape.back(), nullptr, rows, *f, qtype, out);
  return out;
}

at::Tensor quantize_q8_1_vk(const at::Tensor& x) {
  if (use_ref(QUANTIZE_Q8_1) || !is_act(x) || x.dim() < 1 || x.size(-1) % kQ8Block != 0) {
    static auto ref = ref_op<at::Tensor(const at::Tensor&)>("hanzo_ref::quantize_q8_1");
    return ref.call(x);
  }
  const int64_t K = x.size(-1), R = leading(x);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(K / kQ8Block * kQ8Bytes);
  return run_quantize_q8_1(x.reshape({R, K}).contiguous()).view(shape);
}

// ---------------------------------------------------------------------------------------- configuration

// names/qk/ts: the formats of the Vulkan rule table (ggml name, values and bytes per block);
// tables: per format its large int8 table (an i-quant grid, copied to the device here) or an
// empty tensor; lacking: the registry's other quantized formats (they warn once, then run the
// reference).
void configure(std::vector<std::string> names, std::vector<int64_t> qk, std::vector<int64_t> ts,
               std::vector<at::Tensor> tables, std::vector<std::string> lacking) {
  TORCH_CHECK(names.size() == qk.size() && names.size() == ts.size() && names.size() == tables.size(),
              "hanzo_vk_quant::configure: names, qk, ts and tables differ in length");
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (g_configured.load()) return;  // the table is read without a lock once configured
  for (size_t i = 0; i < names.size(); ++i) {
    TORCH_CHECK(qk[i] > 0 && ts[i] > 0, "hanzo_vk_quant::configure: bad block size of ", names[i]);
    Fmt f{qk[i], ts[i], at::Tensor()};
    if (tables[i].numel() > 0) {
      TORCH_CHECK(tables[i].scalar_type() == at::kChar, "hanzo_vk_quant::configure: the table of ", names[i],
                  " must be int8");
      f.table = tables[i].contiguous().to(at::Device(c10::DeviceType::PrivateUse1, 0));
    }
    g_formats[names[i]] = f;
  }
  for (const auto& n : lacking) g_lacking.insert(n);
  g_configured.store(true, std::memory_order_release);
}

// Set the int8 mode (0 off, 1 forced on, 2 where accelerated, -1 back to HANZO_VK_INT8); returns
// the previous mode.
int64_t set_int8(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 2, "hanzo_vulkan::quant_set_int8: mode must be -1, 0, 1 or 2, got ", mode);
  const int prev = int8_mode();
  g_int8_mode.store(mode < 0 ? int8_mode_from_env() : (int)mode);
  return prev;
}

// The formats whose mul_mat takes the int8 path now (empty when the mode or the device rules it out).
std::vector<std::string> int8_formats() {
  std::vector<std::string> out;
  for (const char* f : kInt8Formats)
    if (int8_for(f, kQ8Block)) out.push_back(f);
  return out;
}

std::vector<std::string> configured_formats() {
  ensure_configured();
  std::vector<std::string> out;
  if (!g_configured.load(std::memory_order_acquire)) return out;
  for (const auto& kv : g_formats) out.push_back(kv.first);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace
}  // namespace hz::vk::quant

// The Python side of the backend configures the kernels through these ops (no pybind coupling
// with the runtime's module): the rule table (quant_configure, once) and what the kernels hold now.
TORCH_LIBRARY_FRAGMENT(hanzo_vulkan, m) {
  m.def("quant_configure(str[] names, int[] qk, int[] ts, Tensor[] tables, str[] lacking) -> ()",
        &hz::vk::quant::configure);
  m.def("quant_formats() -> str[]", [] { return hz::vk::quant::configured_formats(); });
  m.def("quant_set_int8(int mode) -> int", &hz::vk::quant::set_int8);
  m.def("quant_int8_formats() -> str[]", [] { return hz::vk::quant::int8_formats(); });
  // swiglu_mul_mat's one-dispatch mat-vec path on or off; returns the previous setting
  m.def("swiglu_mul_mat_fused(bool enabled) -> bool",
        [](bool enabled) { return hz::vk::quant::g_swiglu_fused.exchange(enabled); });
}

TORCH_LIBRARY_IMPL(hanzo, PrivateUse1, m) {
  m.impl("mul_mat", TORCH_FN(hz::vk::quant::mul_mat_vk));
  m.impl("mul_mat_id", TORCH_FN(hz::vk::quant::mul_mat_id_vk));
  m.impl("swiglu_mul_mat", TORCH_FN(hz::vk::quant::swiglu_mul_mat_vk));
  m.impl("get_rows", TORCH_FN(hz::vk::quant::get_rows_vk));
  m.impl("dequantize", TORCH_FN(hz::vk::quant::dequantize_vk));
  m.impl("quantize_q8_1", TORCH_FN(hz::vk::quant::quantize_q8_1_vk));
}
