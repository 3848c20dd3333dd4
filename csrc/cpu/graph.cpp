// CPU graphs: capture and replay (graph.h).
#include "graph.h"

#include <ATen/record_function.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <unordered_set>

namespace {

struct Node {
    std::string op;
    std::function<void()> run;
    std::vector<std::pair<int64_t, int64_t>> weights;  // (rows' address, bytes read) per streamed weight
};

struct Graph {
    std::vector<Node> nodes;
    void replay() const {
        for (const Node& n : nodes) n.run();
    }
    // One replay, timed node by node: wall nanoseconds of each node, in order (a node's time
    // includes its parallel region, so a mat-vec node's is its weight read plus its serial work).
    std::vector<int64_t> replay_timed() const {
        std::vector<int64_t> ns(nodes.size());
        for (size_t i = 0; i < nodes.size(); ++i) {
            const auto t0 = std::chrono::steady_clock::now();
            nodes[i].run();
            ns[i] = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
        }
        return ns;
    }
    std::vector<std::string> ops() const {
        std::vector<std::string> r;
        for (const Node& n : nodes) r.push_back(n.op);
        return r;
    }
    std::vector<std::vector<std::pair<int64_t, int64_t>>> weights() const {
        std::vector<std::vector<std::pair<int64_t, int64_t>>> r;
        for (const Node& n : nodes) r.push_back(n.weights);
        return r;
    }
};

// Ops that may run outside the hanzo ops during a capture. Views alias their input, so a replay
// that rewrites the input rewrites what they show; and `to` / `contiguous` / `reshape` that have
// to copy call a copying op inside, which this list rejects. Host reads (the position checks of
// SequenceState.next_positions) run inside their own call, whose nested ops are not checked;
// their results are host values, which a replay does not need.
const std::unordered_set<std::string>& view_ops() {
    static const std::unordered_set<std::string> s = {
        "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view", "aten::slice", "aten::select",
        "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::alias", "aten::as_strided", "aten::detach",
        "aten::t", "aten::transpose", "aten::permute", "aten::narrow", "aten::contiguous", "aten::to",
        "aten::view_as", "aten::reshape_as", "aten::expand_as", "aten::flatten", "aten::unflatten", "aten::lift_fresh"};
    return s;
}
const std::unordered_set<std::string>& host_read_ops() {
    static const std::unordered_set<std::string> s = {"aten::max", "aten::min", "aten::item",
                                                      "aten::_local_scalar_dense", "aten::is_nonzero"};
    return s;
}

struct Capture {
    std::shared_ptr<Graph> graph = std::make_shared<Graph>();
    std::unordered_set<const void*> written;  // storages the nodes write
    std::string error;                        // the first reason the graph cannot be replayed
    int depth = 0;                            // nesting of the observed calls
    int opaque_at = -1;                       // depth of the hanzo op or host read being run, else -1
    std::string hanzo_op;                     // that hanzo op's name ("" for a host read)
    size_t nodes_before = 0;                  // nodes recorded when it started
    bool ran_reference = false;               // it called its torch reference (a hanzo_ref op)
    at::CallbackHandle handle = 0;
};

// The capture running on this thread: captures on different threads (two models decoding in
// their own threads) are independent, as are their observers.
thread_local Capture* t_cap = nullptr;

Capture* current() { return t_cap; }

void reject(Capture* c, const std::string& why) {
    if (c->error.empty()) c->error = why;
}

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
    Capture* c = current();
    if (c == nullptr) return nullptr;
    const int d = c->depth++;
    const char* name = fn.name();
    if (c->opaque_at >= 0) {  // inside a hanzo op or a host read: not checked
        if (std::strncmp(name, "hanzo_ref::", 11) == 0) c->ran_reference = true;
        return nullptr;
    }
    if (std::strncmp(name, "hanzo::", 7) == 0) {
        c->opaque_at = d;
        c->hanzo_op = name;
        c->nodes_before = c->graph->nodes.size();
        c->ran_reference = false;
    } else if (host_read_ops().count(name)) {
        c->opaque_at = d;
        c->hanzo_op.clear();
    } else if (!view_ops().count(name)) {
        reject(c, std::string(name) + " ran during the capture outside the hanzo ops; a CPU graph replays only "
                                      "the hanzo ops and the views between them");
    }
    return nullptr;
}

void on_exit(const at::RecordFunction&, at::ObserverContext*) {
    Capture* c = current();
    if (c == nullptr) return;
    const int d = --c->depth;
    if (d != c->opaque_at) return;
    if (!c->hanzo_op.empty() && c->graph->nodes.size() == c->nodes_before)
        reject(c, c->hanzo_op + (c->ran_reference
                                     ? " ran its torch reference (a format, dtype or shape its C++ kernel does not "
                                       "take), which a CPU graph cannot replay"
                                     : " has no CPU graph node on this path (an op the graphs do not cover, or "
                                       "reference mode)"));
    c->opaque_at = -1;
    c->hanzo_op.clear();
}

void begin() {
    TORCH_CHECK(t_cap == nullptr, "hanzo cpu graph: a capture is already running on this thread");
    auto* c = new Capture();
    c->handle = at::addThreadLocalCallback(
        at::RecordFunctionCallback(on_enter, on_exit).scopes({at::RecordScope::FUNCTION}));
    t_cap = c;
}

std::unique_ptr<Capture> finish() {
    Capture* c = t_cap;
    TORCH_CHECK(c != nullptr, "hanzo cpu graph: no capture is running on this thread");
    at::removeCallback(c->handle);
    t_cap = nullptr;
    return std::unique_ptr<Capture>(c);
}

// Ends the capture. outputs: the tensors the captured call returned; each must live in storage
// that a node writes, or a replay would leave it as the capture left it.
std::shared_ptr<Graph> end(const std::vector<at::Tensor>& outputs) {
    std::unique_ptr<Capture> c = finish();
    TORCH_CHECK(c->error.empty(), "hanzo cpu graph: ", c->error);
    TORCH_CHECK(!c->graph->nodes.empty(), "hanzo cpu graph: the captured call ran no hanzo op");
    for (const at::Tensor& t : outputs)
        TORCH_CHECK(t.defined() && t.has_storage() && c->written.count(t.storage().data()),
                    "hanzo cpu graph: an output of the captured call is not written by a hanzo op");
    return c->graph;
}

}  // namespace

bool hz_graph_capturing() { return current() != nullptr; }

void hz_graph_record(const char* op, std::function<void()> run, std::vector<at::Tensor> outputs,
                     std::vector<std::pair<int64_t, int64_t>> weights) {
    Capture* c = current();
    if (c == nullptr) return;
    // a node belongs to the hanzo op being run (a kernel that reaches another op's kernel in C++,
    // as lora_mul_mat reaches mul_mat's, would otherwise leave the rest of its work out of the graph)
    if (c->hanzo_op != op) {
        reject(c, (c->hanzo_op.empty() ? std::string("a kernel called outside a hanzo op") : c->hanzo_op) +
                      " ran the kernel of " + op + " inside; a CPU graph cannot replay that");
        return;
    }
    for (const at::Tensor& t : outputs) c->written.insert(t.storage().data());
    c->graph->nodes.push_back(Node{op, std::move(run), std::move(weights)});
}

void hz_graph_reject(const char* op, const std::string& why) {
    Capture* c = current();
    if (c != nullptr) reject(c, std::string(op) + ": " + why);
}

void hz_graph_bind(pybind11::module_& m) {
    namespace py = pybind11;
    py::class_<Graph, std::shared_ptr<Graph>>(m, "CpuGraph", "A captured CPU graph (csrc/cpu/graph.h)")
        .def("replay", &Graph::replay, py::call_guard<py::gil_scoped_release>(),
             "run the captured kernels again on the current contents of their tensors")
        .def("replay_timed", &Graph::replay_timed, py::call_guard<py::gil_scoped_release>(),
             "replay once, timing each node: wall ns per node, in the order of ops")
        .def_property_readonly("ops", &Graph::ops, "the hanzo op of each node, in order")
        .def_property_readonly("weights", &Graph::weights,
                               "per node, in order: (address of the packed rows, bytes its kernel reads for them) of "
                               "each weight it streams (the panels' bytes where it reads panels); [] for other nodes")
        .def("__len__", [](const Graph& g) { return g.nodes.size(); });
    m.def("graph_begin", &begin, "start capturing the hanzo ops called on this thread into a CPU graph");
    m.def("graph_end", &end, py::arg("outputs"),
          "end the capture: the graph, or RuntimeError naming what it cannot replay");
    m.def("graph_abort", []() { finish(); }, "end the capture and drop what it recorded");
    m.def("graph_capturing", &hz_graph_capturing, "whether this thread is capturing a CPU graph");
}
