// The "vulkan" torch device on the PrivateUse1 dispatch key: allocator, device guard, the aten
// ops a device needs (empty, views, resize, copies, fill, .item()), the native glue ops of the
// model (add/sub/mul with broadcasting, sum over dims, casts, arange), and a boxed CPU fallback
// for every other aten op that warns once per op. Also the Python module of the extension.
#include "runtime.h"

#include <torch/extension.h>

#include <ATen/EmptyTensor.h>
#include <ATen/ExpandUtils.h>
#include <ATen/NativeFunctions.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_copy_from_and_resize_native.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <unordered_set>

namespace hz::vk {
namespace {

constexpr c10::DeviceType kVk = c10::DeviceType::PrivateUse1;

bool on_vk(const at::Tensor& t) { return t.defined() && t.device().type() == kVk; }

// ------------------------------------------------------------------ device guard (one device, one stream)

struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kVk; }
  c10::Device exchangeDevice(c10::Device d) const override {
    check(d);
    return c10::Device(kVk, 0);
  }
  c10::Device getDevice() const override { return c10::Device(kVk, 0); }
  void setDevice(c10::Device d) const override { check(d); }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(kVk, 0));
  }
  c10::Stream exchangeStream(c10::Stream) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(kVk, 0));
  }
  c10::DeviceIndex deviceCount() const noexcept override { return initialized() ? 1 : 0; }
  // Events: one in-order queue, so an event is "everything recorded so far"; waiting on it is a
  // synchronize.
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return false; }
  void synchronizeStream(const c10::Stream&) const override { synchronize(); }
  void synchronizeEvent(void*) const override { synchronize(); }
  void synchronizeDevice(const c10::DeviceIndex) const override { synchronize(); }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}

 private:
  static void check(c10::Device d) {
    TORCH_CHECK(d.type() == kVk && d.index() <= 0, "the vulkan backend has one device (vulkan:0), got ", d);
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

// ------------------------------------------------------------------ CPU fallback (warns once per op)

std::mutex g_fallback_mu;
std::set<std::string> g_fallback_ops;

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& name = op.schema().operator_name();
  std::string full = name.name + (name.overload_name.empty() ? "" : "." + name.overload_name);
  if (capturing()) {
    std::string what = full + " (no vulkan kernel: the CPU fallback copies to the host)";
    check_not_capturing(what.c_str());
  }
  bool first = false;
  {
    std::lock_guard<std::mutex> g(g_fallback_mu);
    first = g_fallback_ops.insert(full).second;
  }
  if (first) {
    TORCH_WARN("hanzo_torch vulkan: ", full, " has no vulkan kernel; it runs on the CPU (inputs copied to the "
               "host and results back, a synchronization each call). This warning is shown once per op.");
  }
  at::native::cpu_fallback(op, stack);
}

// ------------------------------------------------------------------ dtype codes (common.glsl HZ_DT_*)

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    case at::kLong: return 3;
    case at::kInt: return 4;
    case at::kByte: return 5;
    case at::kChar: return 6;
    case at::kBool: return 7;
    case at::kShort: return 8;
    default: return -1;
  }
}

// ------------------------------------------------------------------ the elementwise kernel

enum ElemOp : uint32_t { kCopy = 0, kFill = 1, kAdd = 2, kSub = 3, kMul = 4 };
constexpr int kMaxDims = 5;

struct ElemPush {
  uint64_t out, a, b;
  uint32_t n, ndim, op, dts;
  float alpha;
  int32_t alpha_i;
  uint32_t size[kMaxDims];
  int32_t so[kMaxDims], sa[kMaxDims], sb[kMaxDims];
};
static_assert(sizeof(ElemPush) == 128, "push constants of elementwise.comp");

// Shape and per-operand strides (in elements) merged into as few dims as possible.
struct Layout {
  std::vector<int64_t> size;
  std::vector<std::vector<int64_t>> strides;  // one per operand
};

Layout coalesce(at::IntArrayRef size, const std::vector<at::IntArrayRef>& strides) {
  Layout L;
  size_t nops = strides.size();
  L.strides.assign(nops, {});
  for (size_t d = 0; d < size.size(); ++d) {
    if (size[d] == 1) continue;
    if (!L.size.empty()) {
      bool merge = true;
      for (size_t k = 0; k < nops; ++k)
        if (L.strides[k].back() != strides[k][d] * size[d]) merge = false;
      if (merge) {
        L.size.back() *= size[d];
        for (size_t k = 0; k < nops; ++k) L.strides[k].back() = strides[k][d];
        continue;
      }
    }
    L.size.push_back(size[d]);
    for (size_t k = 0; k < nops; ++k) L.strides[k].push_back(strides[k][d]);
  }
  return L;
}

// Record out = op(a, b) over out's shape (a and b already expanded to it). False when the kernel
// cannot take it (dtype, too many dims, 32-bit limits): the caller goes another way.
// The dtype code that moves an element's bits unchanged (same-dtype copies of any 1/2/4/8-byte type).
int bits_code(size_t element_size) {
  switch (element_size) {
    case 1: return 5;
    case 2: return 8;
    case 4: return 4;
    case 8: return 3;
    default: return -1;
  }
}

bool elementwise(ElemOp op, const at::Tensor& out, const at::Tensor* a, const at::Tensor* b, bool integer,
                 double alpha = 1.0, uint64_t fill_bits = 0) {
  int co = dtype_code(out.scalar_type());
  int ca = a ? dtype_code(a->scalar_type()) : 0;
  int cb = b ? dtype_code(b->scalar_type()) : 0;
  if ((op == kCopy && a && a->scalar_type() == out.scalar_type()) || op == kFill) {
    co = ca = bits_code(out.element_size());
  }
  if (co < 0 || ca < 0 || cb < 0) return false;
  int64_t n = out.numel();
  if (n == 0) return true;
  if (n > INT32_MAX) return false;
  std::vector<at::IntArrayRef> st{out.strides()};
  if (a) st.push_back(a->strides());
  if (b) st.push_back(b->strides());
  Layout L = coalesce(out.sizes(), st);
  if (L.size.size() > static_cast<size_t>(kMaxDims)) return false;
  for (auto& s : L.strides) {
    int64_t reach = 0;  // the largest element offset from element 0, which the shader keeps in 32 bits
    for (size_t d = 0; d < s.size(); ++d) reach += (L.size[d] - 1) * std::abs(s[d]);
    if (reach > INT32_MAX) return false;
  }
  ElemPush p{};
  p.out = address(out);
  p.a = a ? address(*a) : 0;
  p.b = b ? address(*b) : fill_bits;
  p.n = static_cast<uint32_t>(n);
  p.ndim = static_cast<uint32_t>(L.size.size());
  p.op = op;
  p.dts = static_cast<uint32_t>(co) | static_cast<uint32_t>(ca) << 8 | static_cast<uint32_t>(cb) << 16 |
          (integer ? 1u << 24 : 0u);
  p.alpha = static_cast<float>(alpha);
  p.alpha_i = static_cast<int32_t>(alpha);
  for (size_t d = 0; d < L.size.size(); ++d) {
    p.size[d] = static_cast<uint32_t>(L.size[d]);
    p.so[d] = static_cast<int32_t>(L.strides[0][d]);
    if (a) p.sa[d] = static_cast<int32_t>(L.strides[1][d]);
    if (b) p.sb[d] = static_cast<int32_t>(L.strides[a ? 2 : 1][d]);
  }
  uint32_t gx = 0, gy = 0;
  groups_1d(static_cast<uint64_t>(n), 256, gx, gy);
  // one dtype for every operand: the variant compiled for it (codes 0 f32, 1 f16, 2 bf16, 3 i64,
  // 4 i32, 8 i16 of common.glsl)
  static const char* kVariants[9] = {"f32", "f16", "bf16", "i64", "i32", nullptr, nullptr, nullptr, "i16"};
  static Pipeline* pipes[10] = {};
  int v = 9;  // "any"
  if (op != kFill && co == ca && (b == nullptr || cb == co) && kVariants[co] != nullptr) v = co;
  if (pipes[v] == nullptr)
    pipes[v] = &pipeline(std::string("elementwise.") + (v == 9 ? "any" : kVariants[v]));
  dispatch(*pipes[v], &p, sizeof(p), gx, gy);
  return true;
}

// ------------------------------------------------------------------ tensor creation and views

at::Tensor empty_memory_format(at::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout, std::optional<at::Device> device,
                               std::optional<bool> pin_memory, std::optional<at::MemoryFormat> memory_format) {
  TORCH_CHECK(c10::layout_or_default(layout) == at::kStrided, "vulkan tensors are strided (got layout ", *layout, ")");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "pin_memory applies to CPU tensors only");
  return at::detail::empty_generic(size, allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(at::IntArrayRef size, at::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> layout, std::optional<at::Device> device,
                         std::optional<bool> pin_memory) {
  TORCH_CHECK(c10::layout_or_default(layout) == at::kStrided, "vulkan tensors are strided (got layout ", *layout, ")");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "pin_memory applies to CPU tensors only");
  return at::detail::empty_strided_generic(size, stride, allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, at::IntArrayRef size, at::IntArrayRef stride,
                      std::optional<int64_t> storage_offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, storage_offset);
}

at::Tensor view(const at::Tensor& self, at::IntArrayRef size) { return at::native::view(self, size); }

at::Tensor reshape_alias(const at::Tensor& self, at::IntArrayRef size, at::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}

// Grow self's storage to hold `bytes` (device copy of the old contents).
void grow_storage(const at::Tensor& self, size_t bytes) {
  const c10::Storage& storage = self.storage();
  if (bytes <= storage.nbytes()) return;
  TORCH_CHECK(storage.resizable(), "Trying to resize a vulkan storage that is not resizable");
  c10::DataPtr fresh = allocator()->allocate(bytes);
  size_t old = storage.nbytes();
  if (old && storage.data_ptr().get())
    copy_device(reinterpret_cast<uint64_t>(fresh.get()), reinterpret_cast<uint64_t>(storage.data_ptr().get()), old);
  storage.unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(fresh));
  storage.unsafeGetStorageImpl()->set_nbytes(bytes);
}

const at::Tensor& resize_(const at::Tensor& self, at::IntArrayRef size, std::optional<at::MemoryFormat> fmt) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  if (fmt.has_value() && *fmt != at::MemoryFormat::Preserve) impl->empty_tensor_restride(*fmt);
  if (self.numel() > 0) {
    int64_t extent = 1;  // elements from the storage offset to the last element, inclusive
    for (int64_t d = 0; d < self.dim(); ++d) extent += (self.size(d) - 1) * self.stride(d);
    grow_storage(self, static_cast<size_t>((self.storage_offset() + extent) * self.element_size()));
  }
  return self;
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& src) { return at::native::set_tensor_(self, src); }
at::Tensor& set_source_storage(at::Tensor& self, at::Storage src) { return at::native::set_(self, src); }

at::Tensor& set_storage_offset(at::Tensor& self, at::Storage src, int64_t offset, at::IntArrayRef size,
                               at::IntArrayRef stride) {
  at::native::checkSetStorage(self, src, offset, size, stride);
  self.unsafeGetTensorImpl()->set_storage_offset(offset);
  at::OptionalIntArrayRef st = stride.data() != nullptr ? at::OptionalIntArrayRef(stride) : std::nullopt;
  at::native::resize_impl_cpu_(self.unsafeGetTensorImpl(), size, st, /*resize_storage=*/false);
  return self;
}

// ------------------------------------------------------------------ copies

at::TensorOptions cpu_opts(at::ScalarType t) { return at::TensorOptions().dtype(t).device(at::kCPU); }

// A contiguous vulkan copy of src (src itself when already contiguous).
at::Tensor vk_contiguous(const at::Tensor& src);
void copy_cpu_to_vk(const at::Tensor& dst, const at::Tensor& src);

void copy_vk_to_vk(const at::Tensor& dst, const at::Tensor& src_in) {
  at::Tensor src = src_in.expand(dst.sizes());
  if (src.scalar_type() == dst.scalar_type() && src.is_contiguous() && dst.is_contiguous()) {
    uint64_t s = address(src), d = address(dst);
    size_t bytes = dst.numel() * dst.element_size();
    if (s == d) return;
    if (s + bytes <= d || d + bytes <= s) {
      copy_device(d, s, bytes);
      return;
    }
  }
  if (dst.storage().is_alias_of(src.storage())) src = src.clone();  // no partial overlap in the kernel
  bool integer = !at::isFloatingType(src.scalar_type()) && !at::isFloatingType(dst.scalar_type());
  if (elementwise(kCopy, dst, &src, nullptr, integer)) return;
  // a cast the kernel does not do (float64, complex): contiguous bits through the host
  TORCH_CHECK(src.scalar_type() != dst.scalar_type(), "vulkan: cannot copy ", src.scalar_type(), " tensors of ",
              src.dim(), " dims with these strides on the device");
  at::Tensor host = at::empty(src.sizes(), cpu_opts(src.scalar_type()));
  at::Tensor s = vk_contiguous(src);
  copy_to_host(host.data_ptr(), address(s), s.numel() * s.element_size());
  copy_cpu_to_vk(dst, host);
}

void copy_cpu_to_vk(const at::Tensor& dst, const at::Tensor& src) {
  at::Tensor host = src.to(dst.scalar_type()).expand(dst.sizes()).contiguous();
  if (dst.is_contiguous()) {
    copy_from_host(address(dst), host.data_ptr(), host.numel() * host.element_size());
    return;
  }
  at::Tensor tmp = at::empty(dst.sizes(), dst.options().memory_format(at::MemoryFormat::Contiguous));
  copy_from_host(address(tmp), host.data_ptr(), host.numel() * host.element_size());
  copy_vk_to_vk(dst, tmp);
}

void copy_vk_to_cpu(const at::Tensor& dst, const at::Tensor& src) {
  at::Tensor s = vk_contiguous(src);
  if (dst.is_contiguous() && dst.scalar_type() == s.scalar_type() && dst.sizes() == s.sizes()) {
    copy_to_host(dst.data_ptr(), address(s), s.numel() * s.element_size());
    return;
  }
  at::Tensor host = at::empty(s.sizes(), cpu_opts(s.scalar_type()));
  copy_to_host(host.data_ptr(), address(s), s.numel() * s.element_size());
  dst.copy_(host);
}

at::Tensor vk_contiguous(const at::Tensor& src) {
  if (src.is_contiguous()) return src;
  at::Tensor out = at::empty(src.sizes(), src.options().memory_format(at::MemoryFormat::Contiguous));
  copy_vk_to_vk(out, src);
  return out;
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  (void)non_blocking;  // host -> device copies are ordered with the queue; device -> host ones always wait
  if (dst.numel() == 0) return dst;
  if (on_vk(self) && on_vk(dst)) copy_vk_to_vk(dst, self);
  else if (on_vk(dst)) copy_cpu_to_vk(dst, self);
  else if (on_vk(self)) copy_vk_to_cpu(dst, self);
  else TORCH_CHECK(false, "vulkan _copy_from called with ", self.device(), " -> ", dst.device());
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (on_vk(dst)) resize_(dst, self.sizes(), std::nullopt);
  else dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  TORCH_CHECK(self.numel() == 1, "a Tensor with ", self.numel(), " elements cannot be converted to Scalar");
  at::Tensor host = at::empty({}, cpu_opts(self.scalar_type()));
  copy_to_host(host.data_ptr(), address(self), self.element_size());
  return host.item();
}

// ------------------------------------------------------------------ fill, arange

at::Tensor& fill_scalar(at::Tensor& self, const at::Scalar& value) {
  if (self.numel() == 0) return self;
  // the element's bits exactly as torch converts the scalar on the CPU
  at::Tensor host = at::empty({}, cpu_opts(self.scalar_type())).fill_(value);
  uint64_t bits = 0;
  std::memcpy(&bits, host.data_ptr(), std::min<size_t>(host.element_size(), 8));
  size_t es = self.element_size();
  if (self.is_contiguous() && es <= 4 && (address(self) % 4) == 0 && (self.numel() * es) % 4 == 0) {
    uint32_t pattern = static_cast<uint32_t>(bits);
    if (es == 2) pattern = (pattern & 0xFFFFu) * 0x00010001u;
    if (es == 1) pattern = (pattern & 0xFFu) * 0x01010101u;
    fill32(address(self), pattern, self.numel() * es);
    return self;
  }
  if (!elementwise(kFill, self, nullptr, nullptr, false, 1.0, bits)) {
    at::Tensor h = at::empty(self.sizes(), cpu_opts(self.scalar_type())).fill_(value);
    self.copy_(h);
  }
  return self;
}

at::Tensor& fill_tensor(at::Tensor& self, const at::Tensor& value) {
  TORCH_CHECK(value.dim() == 0, "fill_ only supports 0-dimension value tensor but got tensor with ", value.dim(),
              " dimensions.");
  return fill_scalar(self, value.item());
}

at::Tensor& zero_(at::Tensor& self) { return fill_scalar(self, 0); }

at::Tensor& arange_out(const at::Scalar& start, const at::Scalar& end, const at::Scalar& step, at::Tensor& out) {
  at::Tensor host = at::empty({0}, cpu_opts(out.scalar_type()));
  at::arange_out(host, start, end, step);
  if (out.sizes() != host.sizes()) resize_(out, host.sizes(), std::nullopt);
  copy_cpu_to_vk(out, host);
  return out;
}

// ------------------------------------------------------------------ add / sub / mul

// A vulkan tensor holding t: t itself, or a CPU scalar (a Python number, a 0-d tensor) moved over.
at::Tensor to_vk(const at::Tensor& t, at::ScalarType dtype) {
  if (on_vk(t)) return t;
  at::Tensor out = at::empty({}, at::TensorOptions().dtype(dtype).device(c10::Device(kVk, 0)));
  return fill_scalar(out, t.item());
}

bool binary_supported(at::ScalarType t) { return dtype_code(t) >= 0 && t != at::kBool; }

// out = a op b (alpha for add/sub); out undefined: a new tensor of the broadcast shape and the
// promoted dtype. Returns an undefined tensor when the native kernel does not take the call.
at::Tensor binary(ElemOp op, const at::Tensor& a_in, const at::Tensor& b_in, const at::Scalar& alpha,
                  at::Tensor out) {
  at::ScalarType rt = at::result_type(a_in, b_in);
  // a CPU scalar of any dtype (a Python float is a float64 0-d tensor) is converted by to_vk
  if (!binary_supported(rt) || (on_vk(a_in) && !binary_supported(a_in.scalar_type())) ||
      (on_vk(b_in) && !binary_supported(b_in.scalar_type())))
    return at::Tensor();
  if (!on_vk(a_in) && a_in.dim() != 0) return at::Tensor();
  if (!on_vk(b_in) && b_in.dim() != 0) return at::Tensor();
  bool integer = !at::isFloatingType(rt);
  at::Tensor a = to_vk(a_in, integer ? at::kLong : at::kFloat);
  at::Tensor b = to_vk(b_in, integer ? at::kLong : at::kFloat);
  auto shape = at::infer_size(a.sizes(), b.sizes());
  if (!out.defined()) {
    out = at::empty(shape, a.options().dtype(rt).memory_format(at::MemoryFormat::Contiguous));
  } else {
    TORCH_CHECK(out.sizes() == at::IntArrayRef(shape), "output with shape ", out.sizes(),
                " doesn't match the broadcast shape ", at::IntArrayRef(shape));
    TORCH_CHECK(at::canCast(rt, out.scalar_type()), "result type ", rt, " can't be cast to the desired output type ",
                out.scalar_type());
    if (!binary_supported(out.scalar_type())) return at::Tensor();
  }
  at::Tensor ae = a.expand(shape), be = b.expand(shape);
  double al = alpha.toDouble();
  if (integer && (al != static_cast<double>(static_cast<int32_t>(al)))) return at::Tensor();
  if (out.storage().is_alias_of(ae.storage()) && !(out.is_same(a) && out.is_contiguous() && a.is_contiguous()))
    ae = ae.clone();
  if (out.storage().is_alias_of(be.storage()) && !out.is_same(b)) be = be.clone();
  if (!elementwise(op, out, &ae, &be, integer, al)) return at::Tensor();
  return out;
}

at::Tensor fallback_binary(ElemOp op, const at::Tensor& a, const at::Tensor& b, const at::Scalar& alpha) {
  // through the host: same result types as torch's CPU kernels
  at::Tensor ha = a.to(at::kCPU), hb = b.to(at::kCPU);
  at::Tensor r = op == kAdd ? at::add(ha, hb, alpha) : op == kSub ? at::sub(ha, hb, alpha) : at::mul(ha, hb);
  return r.to(c10::Device(kVk, 0));
}

at::Tensor add_tensor(const at::Tensor& a, const at::Tensor& b, const at::Scalar& alpha) {
  at::Tensor r = binary(kAdd, a, b, alpha, at::Tensor());
  return r.defined() ? r : fallback_binary(kAdd, a, b, alpha);
}
at::Tensor sub_tensor(const at::Tensor& a, const at::Tensor& b, const at::Scalar& alpha) {
  at::Tensor r = binary(kSub, a, b, alpha, at::Tensor());
  return r.defined() ? r : fallback_binary(kSub, a, b, alpha);
}
at::Tensor mul_tensor(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor r = binary(kMul, a, b, 1, at::Tensor());
  return r.defined() ? r : fallback_binary(kMul, a, b, 1);
}

at::Tensor& inplace(ElemOp op, at::Tensor& self, const at::Tensor& other, const at::Scalar& alpha) {
  at::Tensor r = binary(op, self, other, alpha, self);
  if (!r.defined()) self.copy_(fallback_binary(op, self, other, alpha));
  return self;
}
at::Tensor& add_inplace(at::Tensor& self, const at::Tensor& other, const at::Scalar& alpha) {
  return inplace(kAdd, self, other, alpha);
}
at::Tensor& sub_inplace(at::Tensor& self, const at::Tensor& other, const at::Scalar& alpha) {
  return inplace(kSub, self, other, alpha);
}
at::Tensor& mul_inplace(at::Tensor& self, const at::Tensor& other) { return inplace(kMul, self, other, 1); }

at::Tensor& binary_out(ElemOp op, const at::Tensor& a, const at::Tensor& b, const at::Scalar& alpha, at::Tensor& out) {
  auto shape = at::infer_size(a.sizes(), b.sizes());
  if (out.sizes() != at::IntArrayRef(shape)) resize_(out, shape, std::nullopt);
  at::Tensor r = binary(op, a, b, alpha, out);
  if (!r.defined()) out.copy_(fallback_binary(op, a, b, alpha));
  return out;
}
at::Tensor& add_out(const at::Tensor& a, const at::Tensor& b, const at::Scalar& alpha, at::Tensor& out) {
  return binary_out(kAdd, a, b, alpha, out);
}
at::Tensor& sub_out(const at::Tensor& a, const at::Tensor& b, const at::Scalar& alpha, at::Tensor& out) {
  return binary_out(kSub, a, b, alpha, out);
}
at::Tensor& mul_out(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  return binary_out(kMul, a, b, 1, out);
}

// ------------------------------------------------------------------ sum over dims

struct SumPush {
  uint64_t x, out;
  uint32_t rows, len, dts, pad;
};

at::Tensor sum_dim(const at::Tensor& self, at::OptionalIntArrayRef dim_opt, bool keepdim,
                   std::optional<at::ScalarType> dtype) {
  at::ScalarType in_t = self.scalar_type();
  at::ScalarType out_t = dtype.has_value() ? *dtype
                         : (at::isIntegralType(in_t, /*includeBool=*/true) ? at::kLong : in_t);
  int64_t nd = self.dim();
  std::vector<bool> reduce(std::max<int64_t>(nd, 1), false);
  bool all = !dim_opt.has_value() || dim_opt->empty();
  if (!all)
    for (int64_t d : *dim_opt) reduce[c10::maybe_wrap_dim(d, nd)] = true;
  if (all) std::fill(reduce.begin(), reduce.end(), true);
  bool float_ok = (in_t == at::kFloat || in_t == at::kHalf || in_t == at::kBFloat16) &&
                  (out_t == at::kFloat || out_t == at::kHalf || out_t == at::kBFloat16);
  bool int_ok = at::isIntegralType(in_t, true) && dtype_code(in_t) >= 0 && (out_t == at::kLong || out_t == at::kInt);
  if (!(float_ok || int_ok) || nd == 0) {
    at::Tensor r = at::sum(self.to(at::kCPU), dim_opt, keepdim, dtype);
    return r.to(c10::Device(kVk, 0));
  }
  // kept dims first, reduced dims last, then rows of `len` contiguous elements
  std::vector<int64_t> perm, out_shape, kept_shape;
  int64_t rows = 1, len = 1;
  for (int64_t d = 0; d < nd; ++d)
    if (!reduce[d]) {
      perm.push_back(d);
      rows *= self.size(d);
      kept_shape.push_back(self.size(d));
    }
  for (int64_t d = 0; d < nd; ++d)
    if (reduce[d]) {
      perm.push_back(d);
      len *= self.size(d);
    }
  for (int64_t d = 0; d < nd; ++d) {
    if (!reduce[d]) out_shape.push_back(self.size(d));
    else if (keepdim) out_shape.push_back(1);
  }
  at::Tensor out = at::empty(out_shape, self.options().dtype(out_t));
  if (rows == 0) return out;
  if (len == 0) return fill_scalar(out, 0);
  TORCH_CHECK(rows <= UINT32_MAX && len <= UINT32_MAX, "vulkan sum: too many elements");
  at::Tensor x = vk_contiguous(self.permute(perm));
  SumPush p{};
  p.x = address(x);
  p.out = address(out);
  p.rows = static_cast<uint32_t>(rows);
  p.len = static_cast<uint32_t>(len);
  p.dts = static_cast<uint32_t>(dtype_code(in_t)) | static_cast<uint32_t>(dtype_code(out_t)) << 8 |
          (int_ok ? 1u << 24 : 0u);
  uint32_t gx = 0, gy = 0;
  groups_1d(static_cast<uint64_t>(rows), 64, gx, gy);
  static Pipeline* pipe = nullptr;
  if (pipe == nullptr) pipe = &pipeline("reduce_sum");
  dispatch(*pipe, &p, sizeof(p), gx, gy);
  return out;
}

at::Tensor sum_all(const at::Tensor& self, std::optional<at::ScalarType> dtype) {
  return sum_dim(self, std::nullopt, false, dtype);
}

// ------------------------------------------------------------------ registration

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("resize_", resize_);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Storage_storage_offset", set_storage_offset);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("fill_.Scalar", fill_scalar);
  m.impl("fill_.Tensor", fill_tensor);
  m.impl("zero_", zero_);
  m.impl("arange.start_out", arange_out);
  m.impl("add.Tensor", add_tensor);
  m.impl("add_.Tensor", add_inplace);
  m.impl("add.out", add_out);
  m.impl("sub.Tensor", sub_tensor);
  m.impl("sub_.Tensor", sub_inplace);
  m.impl("sub.out", sub_out);
  m.impl("mul.Tensor", mul_tensor);
  m.impl("mul_.Tensor", mul_inplace);
  m.impl("mul.out", mul_out);
  m.impl("sum.dim_IntList", sum_dim);
  m.impl("sum", sum_all);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>());
}

// ------------------------------------------------------------------ Python module

py::dict features_dict() {
  const Features& f = features();
  py::dict d;
  d["device_name"] = f.device_name;
  d["driver_name"] = f.driver_name;
  d["device_index"] = f.device_index;
  d["device_type"] = f.device_type;
  d["api_version"] = std::to_string(f.api_version >> 22) + "." + std::to_string((f.api_version >> 12) & 0x3FF) + "." +
                     std::to_string(f.api_version & 0xFFF);
  d["vendor_id"] = f.vendor_id;
  d["device_id"] = f.device_id;
  d["subgroup_size"] = f.subgroup_size;
  d["min_subgroup_size"] = f.min_subgroup_size;
  d["max_subgroup_size"] = f.max_subgroup_size;
  d["subgroup_arithmetic"] = f.subgroup_arithmetic;
  d["shared_memory_bytes"] = f.shared_memory_bytes;
  d["max_workgroup_invocations"] = f.max_workgroup_invocations;
  d["float16"] = f.float16;
  d["int8"] = f.int8;
  d["int16"] = f.int16;
  d["int8_dot"] = f.int8_dot;
  d["int8_dot_accelerated"] = f.int8_dot_accelerated;
  d["bfloat16"] = f.bfloat16;
  d["host_visible"] = f.host_visible;
  d["memory_bytes"] = f.memory_bytes;
  d["max_allocation_bytes"] = f.max_allocation_bytes;
  return d;
}

py::dict profile_dict() {
  Profile p = take_profile();
  py::dict d;
  d["dispatches"] = p.dispatches;
  d["barriers"] = p.barriers;
  d["copies"] = p.copies;
  d["submits"] = p.submits;
  d["record_us"] = p.record_us;
  d["submit_us"] = p.submit_us;
  d["fence_wait_us"] = p.wait_us;
  return d;
}

py::dict memory_dict() {
  MemoryStats m = memory_stats();
  py::dict d;
  d["allocated_bytes"] = m.allocated;
  d["reserved_bytes"] = m.reserved;
  d["peak_allocated_bytes"] = m.peak_allocated;
  d["allocations"] = m.allocations;
  d["device_allocations"] = m.device_allocations;
  d["graph_pool_bytes"] = m.graph_pool;
  return d;
}

std::vector<std::string> fallback_ops() {
  std::lock_guard<std::mutex> g(g_fallback_mu);
  return {g_fallback_ops.begin(), g_fallback_ops.end()};
}

// The hanzo ops with a kernel on the PrivateUse1 key (registered by any file of the extension).
std::vector<std::string> native_ops() {
  std::vector<std::string> out;
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name.rfind("hanzo::", 0) != 0) continue;
    auto h = c10::Dispatcher::singleton().findOp(name);
    if (h.has_value() && h->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1))
      out.push_back(name.name.substr(7) + (name.overload_name.empty() ? "" : "." + name.overload_name));
  }
  return out;
}

}  // namespace
}  // namespace hz::vk

namespace {

// A hz::vk::Graph owned by Python: destroyed (pool released) when the last reference goes.
struct PyGraph {
  hz::vk::Graph* g;
  PyGraph() : g(hz::vk::create_graph()) {}
  ~PyGraph() { hz::vk::destroy_graph(g); }
  PyGraph(const PyGraph&) = delete;
  PyGraph& operator=(const PyGraph&) = delete;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hanzo-torch Vulkan runtime and the vulkan torch device";
  m.def("init", [](const std::string& spv_dir) {
    hz::vk::init(spv_dir);
    c10::SetAllocator(c10::DeviceType::PrivateUse1, hz::vk::allocator());
  }, "start the runtime (raises RuntimeError naming why it cannot)");
  m.def("initialized", &hz::vk::initialized);
  m.def("features", &hz::vk::features_dict);
  m.def("synchronize", [] {
    py::gil_scoped_release nogil;
    hz::vk::synchronize();
  });
  m.def("flush", &hz::vk::flush);
  m.def("profiling", &hz::vk::profiling);
  m.def("set_profiling", &hz::vk::set_profiling);
  m.def("profile", &hz::vk::profile_dict, "counters since the last call, reset");
  m.def("memory_stats", &hz::vk::memory_dict);
  m.def("empty_cache", &hz::vk::empty_cache);
  m.def("fallback_ops", &hz::vk::fallback_ops, "aten ops that ran through the CPU fallback so far");
  m.def("native_ops", &hz::vk::native_ops, "hanzo ops with a kernel on the vulkan device");
  m.def("address", [](const at::Tensor& t) { return hz::vk::address(t); });
  m.def("capturing", &hz::vk::capturing, "True while a graph capture is under way");
  py::class_<PyGraph>(m, "Graph", "a recorded command buffer and its private memory pool (runtime.h)")
      .def(py::init<>())
      .def("capture_begin", [](PyGraph& g) { hz::vk::capture_begin(g.g); })
      .def("capture_end", [](PyGraph& g) { hz::vk::capture_end(g.g); })
      .def("capture_abort", [](PyGraph& g) { hz::vk::capture_abort(g.g); })
      .def("replay", [](PyGraph& g) {
        py::gil_scoped_release nogil;
        hz::vk::replay(g.g);
      })
      .def("reset", [](PyGraph& g) {
        py::gil_scoped_release nogil;
        hz::vk::reset_graph(g.g);
      })
      .def("info", [](PyGraph& g) {
        hz::vk::GraphInfo i = hz::vk::graph_info(g.g);
        py::dict d;
        d["recorded"] = i.recorded;
        d["dispatches"] = i.dispatches;
        d["barriers"] = i.barriers;
        d["copies"] = i.copies;
        d["pool_bytes"] = i.pool_bytes;
        return d;
      });
  m.def("dispatch", [](const std::string& name, const py::bytes& push, uint32_t gx, uint32_t gy, uint32_t gz) {
    std::string p = push;
    hz::vk::dispatch(hz::vk::pipeline(name), p.data(), static_cast<uint32_t>(p.size()), gx, gy, gz);
  }, py::arg("name"), py::arg("push"), py::arg("gx"), py::arg("gy") = 1, py::arg("gz") = 1,
     "record one dispatch of <spv_dir>/<name>.spv (push: the push-constant bytes, e.g. from struct.pack)");
}
