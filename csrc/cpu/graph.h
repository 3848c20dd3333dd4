// CPU graphs: a call (one decode step of a model) captured as the list of its hanzo ops' kernels
// with their tensors bound, and replayed from C++ with no Python, no dispatcher and no allocation
// between the kernels. The CPU counterpart of a CUDA graph, with the same contract: every tensor
// an op reads or writes keeps its address from capture to replay, only the contents of the
// inputs change (the token id and position buffers), and whatever is decided on the host during
// capture (a Python branch, a shape) is fixed in the graph.
//
// Capture (graph.cpp): the call runs eagerly once while each hanzo op's CPU kernel (ops.cpp)
// records a node: a closure that redoes the op's work on the op's input tensors into the output
// tensors that the captured call returned, keeping all of them alive. A thread-local
// RecordFunction observer checks that nothing else happened: every op called outside the hanzo
// ops must be a view (view, reshape, slice, ...) or a read used on the host (max, item, ...); any
// other op (a copy, an add, an in-place write) would be skipped by a replay, so it fails the
// capture, as does a hanzo op that ran its reference or a path without a node. The caller then
// runs eagerly (hanzo_torch.decode_graphs.DecodeStep).
#pragma once
#include <torch/extension.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

// True on the thread capturing a graph, while it captures.
bool hz_graph_capturing();
// Appends a node to the graph being captured: run() redoes op's work into `outputs`, the tensors
// whose storage the captured call's results live in. weights: (address of the packed rows, bytes
// the node's kernel reads for them) of each weight it streams, for the per-node accounting of
// CpuGraph.weights (a mat-vec over panels reads the panels' bytes).
void hz_graph_record(const char* op, std::function<void()> run, std::vector<at::Tensor> outputs,
                     std::vector<std::pair<int64_t, int64_t>> weights = {});
// The captured call of op cannot be replayed, for this reason: the capture fails with it at its end.
void hz_graph_reject(const char* op, const std::string& why);
// The pybind side: graph_begin(), graph_end(outputs) -> CpuGraph, graph_abort(), CpuGraph.replay().
void hz_graph_bind(pybind11::module_& m);

// fused.cpp's kernels writing into given output tensors (the graphs' nodes of those ops); the
// outputs have the shapes and dtypes of the op's results, contiguous.
at::Tensor hz_rms_norm_out(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& out);
void hz_add_rms_norm_out(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w, double eps,
                         const at::Tensor& y, const at::Tensor& s);
void hz_qk_norm_rope_kv_write_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const std::optional<at::Tensor>& q_w, const std::optional<at::Tensor>& k_w,
                                  const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& positions,
                                  double theta, double eps, const at::Tensor& q_out);
void hz_attention_out(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& positions,
                      double scale, const at::Tensor& out);
