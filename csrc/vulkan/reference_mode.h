#pragma once
// Reference mode of a set of hanzo ops, mirrored from hanzo_torch.ops (on: the op's calls run
// torch.ops.hanzo_ref.<op>): one atomic flag per op, read on every call.
#include <atomic>
#include <string>
#include <vector>

namespace hz::vk {

template <int N>
class ReferenceFlags {
 public:
  explicit ReferenceFlags(const char* const (&names)[N]) : names_(names) {}

  bool on(int op) const { return flags_[op].load(std::memory_order_relaxed); }

  // false for a name that is not one of these ops
  bool set(const std::string& name, bool enabled) {
    for (int i = 0; i < N; ++i)
      if (name == names_[i]) {
        flags_[i].store(enabled);
        return true;
      }
    return false;
  }

  std::vector<std::string> enabled() const {
    std::vector<std::string> out;
    for (int i = 0; i < N; ++i)
      if (flags_[i].load()) out.push_back(names_[i]);
    return out;
  }

 private:
  const char* const* names_;
  std::atomic<bool> flags_[N]{};
};

}  // namespace hz::vk
