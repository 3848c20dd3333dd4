// The format lookup of a backend's op kernels (csrc/cpu/ops.cpp, csrc/vulkan/ops_quant.cpp): a
// ggml format name to what the backend's kernels know of it, and for a quantized format of the
// registry that they lack, one Python UserWarning per format before its calls go to the torch
// reference. Both tables are filled once by the backend's configure call, before any lookup.
#pragma once
#include <torch/extension.h>

#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace hz {

// A Python UserWarning with text msg, once per distinct text in this extension; thread-safe. A
// Python warning (not a log line), so that it can be filtered and tested like any other.
inline void warn_once(const std::string& msg) {
    static std::mutex mu;
    static std::unordered_set<std::string> warned;
    std::lock_guard<std::mutex> lock(mu);
    if (!warned.insert(msg).second) return;
    py::gil_scoped_acquire gil;
    if (PyErr_WarnEx(PyExc_UserWarning, msg.c_str(), 1) != 0) PyErr_Clear();
}

// known[qtype], or nullptr. A name in lacking warns once, "<backend>: no <kernel> for format
// <name>; its ops run the torch reference"; other unknown names (dense formats, whose reference
// is the kernel) are silent.
template <class V>
const V* find_format(const std::unordered_map<std::string, V>& known, const std::unordered_set<std::string>& lacking,
                     c10::string_view qtype, const char* backend, const char* kernel) {
    const std::string name(qtype);
    auto it = known.find(name);
    if (it != known.end()) return &it->second;
    if (lacking.count(name))
        warn_once(std::string(backend) + ": no " + kernel + " for format " + name + "; its ops run the torch reference");
    return nullptr;
}

}  // namespace hz
