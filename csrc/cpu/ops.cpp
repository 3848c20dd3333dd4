// Torch binding of the CPU kernels: argument checks, activation quantization, the split of weight
// rows into tasks (run by threading.h's controller, threading.cpp), the kernel tunables and the
// per-ISA / per-format dispatch tables.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "../common/format_lookup.h"
#include "../common/hz_constants.h"
#include "hz_api.h"
#include "threading.h"
#include "hz_ops.h"
#include "graph.h"

extern "C" {
const int8_t* hz_tables[HZ_N_TABLES] = {};
// Mat-vec weight prefetch. Into L1 (prefetcht0) 2 KiB ahead (set_prefetch_l2(False)): 2-4 KiB
// measured best of the L1 distances on Zen 3 (DRAM stream, 1 thread). Into L2 only (prefetcht2)
// 8 KiB ahead, the default on every SIMD level (the helper must stay inline: kernels.h,
// hz_prefetch_stream; benchmarks/RESULTS.md has the builds that lost it). Measured (Zen 4,
// avx512 level, token replays alternated per round, against no prefetch): L2 8 KiB 1.034x in the
// fast-memory minutes (72 rounds; the Q6_K output matrix -18% time, the Q6_K ffn_down +2%) and
// 0.986x in the slow ones (48; output +8%, ffn_down +5%); L2 16 KiB 1.033x / 0.990x; L1 2 KiB
// 0.990x / 1.000x; L2 at 2 KiB 0.80x and 4 KiB 0.94x (97 fast rounds: prefetches of lines the
// hardware prefetcher already has in flight). The avx2 level (Zen 4, in process, 54 fast and 66
// slow rounds against L1 2 KiB, per-weight choice on): token 1.021x fast, 1.004x slow; the Q6_K output
// matrix -8% time fast, +1% slow, the Q6_K ffn_down -3% in both, and with the Q6_K planes
// (kernels_panels.h) 1.057x / 1.017x. Hence mul_mat's per-weight choice (PrefetchChoice).
int64_t hz_prefetch_bytes = 2048, hz_prefetch_l2_bytes = 8192;
int hz_prefetch_l2 = 1;
int hz_gemm512 = 1;
int hz_matvec512 = 1;
int hz_matvec_gfni = 1;
int hz_adaptive_prefetch = 1;
// CPU graph nodes of the mat-vecs replay their prepared operands (MvPlan, SwigluPlan; 1) or
// resolve them again at every replay as an eager call does (0, for A/B runs).
int hz_graph_plans = 1;
int hz_prefetch_act = 1;
// The Q4_K panel mat-vec issues no software prefetch by default: each thread's panels are one
// stream in address order, which the hardware prefetchers follow, and the prefetch instructions
// cost issue slots. Zen 4, token mat-vecs replayed, alternated per round against the L1/L2
// prefetch of the rows: avx2 level +10.1% per token where a plain read reached 53-60 GB/s (ahead
// in 156 of 156 rounds), +0.9% where it reached 29-36 (29 of 40); avx512 level (L2, 8 KiB
// ahead) 1.031x fast (65 rounds) and 1.012x at 38-45 GB/s (85), only the K = 8960 ffn_down
// losing without it (1.4-4%), and chosen per weight in mul_mat still 1.003x (160 rounds). The
// rows keep theirs: without it the avx2 level read the Q6_K output matrix at 42.8 against 48.6
// GB/s in the same fast rounds.
int hz_prefetch_panels = 0;
int hz_cpu_repack = 1;
int64_t hz_gemm_kc = 2048, hz_gemm_mc = 64;
}
// Mat-vec task size of the dynamic row split (RowSplit): 256 KiB of weights, at least
// hz_mv_min_chunks tasks per thread. 32 KiB tasks cost 20-25%: each task restarts the weight
// stream (its first prefetch distance is never prefetched, and the prefetches past its end fetch
// the other thread's rows); measured in one process, 2 threads, Zen 3: Q4_K [8960, 1536]
// 15.6 -> 19.3 GB/s, Q6_K [1536, 8960] 18.8 -> 22.9, model decode 13.1 -> 16.1 tok/s.
static int64_t hz_mv_chunk_bytes = 262144, hz_mv_min_chunks = 4;
std::atomic<int64_t> hz_active_isa{0};

namespace {

torch::Tensor g_tables[HZ_N_TABLES];  // keeps the installed tables alive

// ISA levels: 0 scalar, 1 avx2 (+fma+f16c), 2 avx512 (vl, bw, vnni), 3 avx512-sim (the level-2
// kernels built for AVX2 with SIMDe's AVX-512 intrinsics; present only when built with SIMDe).
const int64_t kMaxIsa = 3;

bool isa_built(int64_t level) { return level >= 0 && level <= kMaxIsa && (level != 3 || hz_isa_avx512_sim() != nullptr); }

bool isa_supported(int64_t level) {
    __builtin_cpu_init();
    switch (level) {
        case 0: return true;
        case 1: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        case 2:
            return isa_supported(1) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                   __builtin_cpu_supports("avx512vnni");
        case 3: return isa_supported(1) && isa_built(3);
        default: return false;
    }
}

const HzIsa* isa_table(int64_t level) {
    TORCH_CHECK(level >= 0 && level <= kMaxIsa, "hanzo cpu: unknown ISA level ", level,
                " (0 scalar, 1 avx2, 2 avx512, 3 avx512-sim)");
    TORCH_CHECK(isa_built(level), "hanzo cpu: ISA level ", level,
                " (avx512-sim) is not built: the SIMDe headers (simde/x86/avx512.h) were absent at build time");
    TORCH_CHECK(isa_supported(level), "hanzo cpu: this CPU does not support ISA level ", level);
    switch (level) {
        case 3: return hz_isa_avx512_sim();
        case 2: return hz_isa_avx512();
        case 1: return hz_isa_avx2();
        default: return hz_isa_scalar();
    }
}

const HzFormatKernels& format_kernels(const HzIsa* isa, int64_t type_id) {
    for (int i = 0; i < isa->n_formats; ++i)
        if (isa->formats[i].type_id == type_id) return isa->formats[i];
    TORCH_CHECK(false, "hanzo cpu: no kernel for ggml type id ", type_id);
}

// The table a format reads (HzFormatKernels::table) must be installed before its kernels run.
void check_grid(int64_t type_id) {
    const HzIsa* isa = hz_isa_scalar();
    for (int i = 0; i < isa->n_formats; ++i)
        if (isa->formats[i].type_id == type_id) {
            const int slot = isa->formats[i].table;
            TORCH_CHECK(slot < 0 || hz_tables[slot] != nullptr, "hanzo cpu: table slot ", slot, " of ggml type ",
                        type_id, " not set (call set_table)");
            return;
        }
}

struct QuantAct {
    torch::Tensor q, d, s, sf;
    HzAct view;
    int64_t M = -1;  // the shape the buffers have (view.K and view.qa the rest)
};

// Quantizes x [M, K] float32 into r's buffers (allocated for that shape by quantize_act_into).
void quantize_act_raw(const HzIsa* isa, const float* x, int64_t M, QuantAct& r) {
    const int64_t K = r.view.K, qa = r.view.qa;
    int8_t* q = const_cast<int8_t*>(r.view.q);
    float* d = const_cast<float*>(r.view.d);
    int16_t* s = const_cast<int16_t*>(r.view.s);
    float* sf = const_cast<float*>(r.view.sf);
    auto fn = isa->quantize;
    auto body = [&](int64_t m0, int64_t m1) {
        fn(x + m0 * K, m1 - m0, K, qa, q + m0 * K, d + m0 * (K / qa), s + m0 * (K / 16), sf + m0 * (K / 16));
    };
    if (M * K >= 65536) at::parallel_for(0, M, 1, body); else body(0, M);
}

// r's buffers for an [M, K] activation in blocks of qa: kept when they have that shape, allocated
// otherwise.
void act_buffers(QuantAct& r, int64_t M, int64_t K, int64_t qa) {
    if (r.M != M || r.view.K != K || r.view.qa != qa) {
        r.q = torch::empty({M, K}, torch::kInt8);
        r.d = torch::empty({M, K / qa}, torch::kFloat32);
        r.s = torch::empty({M, K / 16}, torch::kInt16);
        r.sf = torch::empty({M, K / 16}, torch::kFloat32);
        r.M = M;
        r.view = HzAct{r.q.data_ptr<int8_t>(), r.d.data_ptr<float>(), r.s.data_ptr<int16_t>(), r.sf.data_ptr<float>(), K, qa};
    }
}

// Quantizes x2 [M, K] float32 into r, whose buffers are reused when they have this shape (a CPU
// graph's node keeps one QuantAct per activation across replays) and allocated otherwise.
QuantAct& quantize_act_into(const HzIsa* isa, const torch::Tensor& x2, int64_t qa, QuantAct& r) {
    const int64_t M = x2.size(0), K = x2.size(1);
    act_buffers(r, M, K, qa);
    quantize_act_raw(isa, x2.data_ptr<float>(), M, r);
    return r;
}

QuantAct quantize_act(const HzIsa* isa, const torch::Tensor& x2, int64_t qa) {
    QuantAct r;
    quantize_act_into(isa, x2, qa, r);
    return r;
}


// Row-interleaved panels of packed weights (kernels_panels.h), built at load (pack_panels) and
// registered by the address of the weight's rows. An entry serves an op's weight only while it is the
// same tensor data: same address and shape, its storage alive (a weak reference, so a freed weight's
// address reused by another tensor never matches) and its version counter unchanged since the panels
// were built (an in-place write to the rows, e.g. a GGUFTensor copy_, retires the panels: the rows run).
// hz_use_panels = 0 (set_panels / HANZO_CPU_PANELS=0) runs the rows, for A/B runs.
std::atomic<int> hz_use_panels{1};
// hz_use_q6k_planes = 0 (set_q6k_planes / HANZO_CPU_Q6K_PLANES=0): Q6_K weights run their rows even
// where planes are registered (the Q4_K panels stay), for A/B runs.
std::atomic<int> hz_use_q6k_planes{1};
// Bumped by every change to the registry, hz_use_panels or hz_use_q6k_planes (PlanKey: prepared mat-vecs re-resolve).
std::atomic<uint64_t> g_panels_gen{1};

struct PanelEntry {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    int64_t N, rb, version, type_id;
    torch::Tensor panels;
};
std::mutex g_panels_mu;
std::unordered_map<const void*, PanelEntry> g_panels;

// Bytes of the panels of an [N, rb] weight of type type_id, or -1 when the format has no panel layout
// or the shape does not fit it (Q4_K: N a whole number of 8-row groups; Q6_K planes: any N).
int64_t panel_bytes(int64_t type_id, int64_t N, int64_t rb) {
    if (N <= 0 || rb <= 0) return -1;
    if (type_id == block_q4_K::type_id) {
        if (N % 8 != 0 || rb % (int64_t)sizeof(block_q4_K) != 0) return -1;
        return N / 8 * (rb / (int64_t)sizeof(block_q4_K)) * HZ_Q4K_PANEL_BYTES;
    }
    if (type_id == block_q6_K::type_id) return rb % (int64_t)sizeof(block_q6_K) == 0 ? N * rb : -1;
    return -1;
}

// Q4_K rows [N, rb] -> panels (layout in kernels_panels.h), groups [g0, g1) of 8 rows.
void pack_q4k_groups(const uint8_t* W, int64_t rb, int64_t g0, int64_t g1, uint8_t* P) {
    const int64_t nb = rb / (int64_t)sizeof(block_q4_K);
    for (int64_t g = g0; g < g1; ++g)
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t* pb = P + (g * nb + b) * HZ_Q4K_PANEL_BYTES;
            for (int r = 0; r < 8; ++r) {
                const uint8_t* blk = W + (g * 8 + r) * rb + b * (int64_t)sizeof(block_q4_K);
                const uint8_t* qs = blk + offsetof(block_q4_K, qs);
                for (int j = 0; j < 4; ++j)
                    for (int k = 0; k < 8; ++k)
                        memcpy(pb + HZ_Q4K_PANEL_QS + 256 * j + 32 * k + 4 * r, qs + 32 * j + 4 * k, 4);
                uint8_t sc[8], mn[8];
                kquant_scales_6bit(blk + offsetof(block_q4_K, scales), sc, mn);
                for (int s = 0; s < 8; ++s) {
                    pb[HZ_Q4K_PANEL_SC + 8 * s + r] = sc[s];
                    pb[HZ_Q4K_PANEL_MN + 16 * (s / 2) + 2 * r + (s & 1)] = mn[s];
                }
                memcpy(pb + HZ_Q4K_PANEL_D + 2 * r, blk + offsetof(block_q4_K, d), 2);
                memcpy(pb + HZ_Q4K_PANEL_DM + 2 * r, blk + offsetof(block_q4_K, dmin), 2);
            }
        }
}

// Q6_K rows [N, rb] -> planes (layout in kernels_panels.h), rows [r0, r1).
void pack_q6k_planes(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, uint8_t* P) {
    static_assert(offsetof(block_q6_K, scales) == 2 * HZ_Q6K_PLANES_HALF, "the planes end where the scales start");
    const int64_t nb = rb / (int64_t)sizeof(block_q6_K);
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = W + r * rb + b * (int64_t)sizeof(block_q6_K);
            uint8_t* pb = P + r * rb + b * (int64_t)sizeof(block_q6_K);
            const uint8_t* ql = blk + offsetof(block_q6_K, ql);
            const uint8_t* qh = blk + offsetof(block_q6_K, qh);
            for (int h = 0; h < 2; ++h)
                for (int l = 0; l < 32; ++l) {
                    const uint8_t a = ql[64 * h + l], c = ql[64 * h + 32 + l], e = qh[32 * h + l];
                    const uint8_t q[4] = {(uint8_t)((a & 15) | (e & 3) << 4), (uint8_t)((c & 15) | ((e >> 2) & 3) << 4),
                                          (uint8_t)((a >> 4) | ((e >> 4) & 3) << 4), (uint8_t)((c >> 4) | ((e >> 6) & 3) << 4)};
                    for (int j = 0; j < 3; ++j)
                        pb[HZ_Q6K_PLANES_HALF * h + 32 * j + l] = (uint8_t)(q[j] | ((q[3] >> (2 * j)) & 3) << 6);
                }
            memcpy(pb + 2 * HZ_Q6K_PLANES_HALF, blk + offsetof(block_q6_K, scales), sizeof(block_q6_K) - offsetof(block_q6_K, scales));
        }
}

// Fills out (uint8, panel_bytes(type_id, N, rb) bytes) with the panels of w (uint8 [N, rb]), in parallel.
void pack_panels(const torch::Tensor& w, int64_t type_id, torch::Tensor out) {
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
                "pack_panels: w must be a contiguous 2-D uint8 CPU tensor");
    const int64_t N = w.size(0), rb = w.size(1), nbytes = panel_bytes(type_id, N, rb);
    TORCH_CHECK(nbytes >= 0, "pack_panels: no panel layout for ggml type ", type_id, " with ", N, " rows of ", rb, " bytes");
    TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == torch::kUInt8 && out.is_contiguous() && out.numel() == nbytes,
                "pack_panels: out must be a contiguous uint8 CPU tensor of ", nbytes, " bytes");
    const uint8_t* W = w.data_ptr<uint8_t>();
    uint8_t* P = out.data_ptr<uint8_t>();
    if (type_id == block_q6_K::type_id)
        at::parallel_for(0, N, 512, [&](int64_t r0, int64_t r1) { pack_q6k_planes(W, rb, r0, r1, P); });
    else
        at::parallel_for(0, N / 8, 64, [&](int64_t g0, int64_t g1) { pack_q4k_groups(W, rb, g0, g1, P); });
}

// Registers out as the panels of w (pack_panels' arguments, already filled); entries whose storage
// died are dropped here.
void set_panels_of(const torch::Tensor& w, int64_t type_id, const torch::Tensor& panels) {
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous() &&
                !w.is_inference(), "set_panels_of: w must be a contiguous 2-D uint8 CPU tensor made outside inference mode");
    TORCH_CHECK(panels.numel() == panel_bytes(type_id, w.size(0), w.size(1)) && panels.is_contiguous() &&
                panels.scalar_type() == torch::kUInt8, "set_panels_of: panels of the wrong size or type");
    std::lock_guard<std::mutex> lock(g_panels_mu);
    for (auto it = g_panels.begin(); it != g_panels.end();) it = it->second.storage.expired() ? g_panels.erase(it) : ++it;
    g_panels.erase(w.data_ptr());
    g_panels_gen.fetch_add(1);
    g_panels.emplace(w.data_ptr(), PanelEntry{w.storage().getWeakStorageImpl(), w.size(0), w.size(1), w._version(), type_id, panels});
}

void drop_panels_at(int64_t address) {
    std::lock_guard<std::mutex> lock(g_panels_mu);
    g_panels.erase((const void*)(intptr_t)address);
    g_panels_gen.fetch_add(1);
}

void drop_panels_of(const torch::Tensor& w) { drop_panels_at((int64_t)(intptr_t)w.data_ptr()); }

// The panels registered for w (contiguous) in format type_id, or null.
const uint8_t* panels_for(const torch::Tensor& w, int64_t type_id) {
    if (!hz_use_panels.load(std::memory_order_relaxed) || w.is_inference()) return nullptr;
    if (type_id == block_q6_K::type_id && !hz_use_q6k_planes.load(std::memory_order_relaxed)) return nullptr;
    std::lock_guard<std::mutex> lock(g_panels_mu);
    if (g_panels.empty()) return nullptr;
    auto it = g_panels.find(w.data_ptr());
    if (it == g_panels.end()) return nullptr;
    const PanelEntry& e = it->second;
    if (e.type_id != type_id || e.N != w.size(0) || e.rb != w.size(1) || e.storage.expired() || e.version != w._version())
        return nullptr;
    return e.panels.data_ptr<uint8_t>();
}

// The panels a mat-vec (mv: M <= mv_max) of weight w in format type_id reads, or null (no panel
// kernel for the format, not a mat-vec, none registered).
const uint8_t* mv_panels(const HzFormatKernels& fk, const torch::Tensor& w, int64_t type_id, bool mv) {
    return mv && fk.matvec_panels ? panels_for(w, type_id) : nullptr;
}

// Tasks 0..n-1 on nth threads, each thread taking its own contiguous range first, then the others'
// from their back (hz_run_tasks): on a loaded machine a descheduled thread delays only its current
// task; the adaptive controller may run them serially (threading.h).
template <class F>
void run_tasks(int64_t n, int64_t nth, const F& task) {
    hz_run_tasks(n, nth, task);
}

// Weight rows of one task: ~256 KiB of weights (mat-vec, hz_mv_chunk_bytes) or 16 GEMM tiles.
int64_t task_rows(int64_t rb, bool mv, int64_t gemm_nr) {
    return mv ? std::max<int64_t>(1, hz_mv_chunk_bytes / std::max<int64_t>(rb, 1)) : 16 * gemm_nr;
}

// Rows of a weight are split over threads in tasks of task_rows (in whole tiles), at least 4 per
// thread (hz_mv_min_chunks for the mat-vec), run by run_tasks.
struct RowSplit {
    int64_t tile, ntiles, nth, chunk;
    bool serial;  // small op: one thread, no wake-ups
    RowSplit(int64_t N, int64_t rb, bool mv, int64_t gemm_nr) {
        tile = mv ? 1 : gemm_nr;
        ntiles = (N + tile - 1) / tile;
        nth = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), ntiles));
        chunk = task_rows(rb, mv, gemm_nr) / tile;
        chunk = std::max<int64_t>(1, std::min<int64_t>(chunk, ntiles / ((mv ? hz_mv_min_chunks : 4) * nth)));
        if (mv && chunk > 8) chunk -= chunk % 8;  // whole 8-row groups of panels (kernels_panels.h)
        serial = nth == 1 || ntiles * rb * tile < 65536;
    }
    // body(n0, n1) over row ranges of at most chunk * tile rows, N rows in all.
    template <class F>
    void run(int64_t N, const F& body) const {
        const int64_t ntasks = (ntiles + chunk - 1) / chunk;
        auto task = [&](int64_t i) { body(i * chunk * tile, std::min(N, (i + 1) * chunk * tile)); };
        if (serial) {
            for (int64_t i = 0; i < ntasks; ++i) task(i);
            return;
        }
        run_tasks(ntasks, nth, task);
    }
};

// Whether mul_mat's row mat-vec of a weight runs with the software prefetch of its stream (arm 0:
// what the prefetch switches give) or without (arm 1), chosen per weight by its measured time per
// byte. The better arm depends on the weight and on how fast the memory is at the moment: on a
// Zen 4 box whose memory switches between a slow and a fast regime within seconds, the L2
// prefetch 8 KiB ahead took 18% less time than none over the Q6_K output matrix (rows of 1536
// values) in the fast minutes and 8% more in the slow ones, and 2-5% more over the Q6_K ffn_down
// (8960 values) in both (avx512 level, token replays alternated: 72 fast and 48 slow rounds). Each weight keeps a
// moving average of ns per byte for each arm (weight 1/4 for the newest call); its first calls
// alternate the arms, then every eighth call tries the other arm and the rest take the faster one.
// Speed only: the kernels give the same bits either way. Off (hz_adaptive_prefetch = 0): arm 0.
struct PrefetchChoice {
    double ns_per_byte[2] = {0.0, 0.0};
    int64_t calls = 0;
    int arm() {
        const int64_t k = calls++;
        if (k < 4) return (int)(k & 1);
        const int best = ns_per_byte[1] < ns_per_byte[0] ? 1 : 0;
        return k % 8 == 0 ? 1 - best : best;
    }
    void record(int arm, double nspb) {
        double& v = ns_per_byte[arm];
        v = calls <= 2 ? nspb : 0.75 * v + 0.25 * nspb;
    }
};
// Eager calls' choices, by the address of the weight's rows (a graph node keeps its own, MvPlan).
std::mutex g_prefetch_mu;
std::unordered_map<const void*, PrefetchChoice> g_prefetch_choice;

// The tiled GEMM (M > mv_max) of one weight over RowSplit's tasks.
void run_gemm(const HzFormatKernels& fk, const uint8_t* W, int64_t rb, int64_t N, const HzAct& a, int64_t M,
              float* y, int64_t ldy) {
    const RowSplit split(N, rb, false, fk.gemm_nr);
    if (split.serial) {
        fk.gemm(W, rb, 0, N, &a, M, y, ldy);
        return;
    }
    split.run(N, [&](int64_t n0, int64_t n1) { fk.gemm(W, rb, n0, n1, &a, M, y, ldy); });
}

torch::Tensor check_x(const torch::Tensor& x, int64_t K_expected, const char* op) {
    TORCH_CHECK(x.device().is_cpu(), op, ": x must be a CPU tensor");
    TORCH_CHECK(x.is_floating_point(), op, ": x must be floating point, got ", x.scalar_type());
    TORCH_CHECK(x.size(-1) == K_expected, op, ": x has ", x.size(-1), " features, the weight has ", K_expected);
    if (x.scalar_type() == torch::kFloat32 && x.is_contiguous()) return x;
    return x.to(torch::kFloat32).contiguous();
}

int64_t infer_k(const HzFormatKernels& fk, int64_t rb, const char* op) {
    TORCH_CHECK(rb % fk.bytes == 0, op, ": weight rows of ", rb, " bytes are not a whole number of ", fk.bytes,
                "-byte blocks");
    return rb / fk.bytes * fk.qk;
}

// What a prepared mat-vec (MvPlan, SwigluPlan) was built from, and whether that has changed since:
// the ISA level, the row limit, the thread count, the task-size tunables, the panel switches and
// registry, and the version counters of the weights whose format has panels (an in-place write to
// the rows retires their panels). keep holds the tensors whose addresses the plan holds.
struct PlanKey {
    bool built = false;
    int64_t isa_level = -1, mv_max = -1, threads = -1, chunk_bytes = -1, min_chunks = -1;
    int use_panels = -1, adaptive_on = -1;
    uint64_t panels_gen = 0;
    std::vector<std::pair<c10::VariableVersion, uint32_t>> versions;
    std::vector<torch::Tensor> keep;

    void set(int64_t isa_l, int64_t mvm) {
        built = true;
        isa_level = isa_l;
        mv_max = mvm;
        threads = at::get_num_threads();
        chunk_bytes = hz_mv_chunk_bytes;
        min_chunks = hz_mv_min_chunks;
        use_panels = hz_use_panels.load(std::memory_order_relaxed);
        adaptive_on = hz_adaptive_prefetch;
        panels_gen = g_panels_gen.load(std::memory_order_acquire);
        versions.clear();
        keep.clear();
    }
    // weight w in format fk
    void add_weight(const HzFormatKernels& fk, const torch::Tensor& w) {
        if (fk.matvec_panels && !w.is_inference())
            versions.emplace_back(w.unsafeGetTensorImpl()->version_counter(), w._version());
        keep.push_back(w);
    }
    bool stale(int64_t isa_l, int64_t mvm) const {
        if (!built || isa_l != isa_level || mvm != mv_max || at::get_num_threads() != threads ||
            hz_mv_chunk_bytes != chunk_bytes || hz_mv_min_chunks != min_chunks ||
            hz_use_panels.load(std::memory_order_relaxed) != use_panels || hz_adaptive_prefetch != adaptive_on ||
            g_panels_gen.load(std::memory_order_acquire) != panels_gen)
            return true;
        for (const auto& v : versions)
            if (v.first.current_version() != v.second) return true;
        return false;
    }
};

// A mat-vec (M <= mv_max) of G weights over one activation x [M, K] float32, every operand resolved
// to plain values: each weight's rows or panels and kernels, the quantized activation's buffers (one
// per block size), the outputs and biases, and the tasks (about hz_mv_chunk_bytes of weights each, at
// least hz_mv_min_chunks per thread, whole 8-row groups, over all G weights in order). mul_mat and
// mul_mat_group build one per eager call. A CPU graph's node keeps its plan across replays and
// rebuilds it only when what it was built from has changed (stale()): between the mat-vecs of a
// decode step the tensors' metadata and the panel registry are out of cache, and resolving them
// took 2-6 us per node on Zen 4 (mat-vec nodes of 25-60 us), the lookups of panels 0.8 us a weight.
struct MvPlan {
    struct Part {
        const HzFormatKernels* fk;
        const uint8_t* rows;
        const uint8_t* panels;  // null: the kernel reads the rows
        int64_t N, rb;
        const HzAct* act;
        float* y;            // [M, N]
        const float* bias;   // [N] or null
    };
    struct Task {
        int64_t part, n0, n1;
    };
    const HzIsa* isa = nullptr;
    const float* x = nullptr;
    int64_t M = 0, K = 0, nth = 1;
    bool serial = true;
    std::vector<QuantAct> acts;
    std::vector<Part> parts;
    std::vector<Task> tasks;
    // one weight on rows, run in parallel, adaptive prefetch on: PrefetchChoice picks the arm (the
    // node's own choice in a graph, the eager calls' shared one by address otherwise)
    bool adaptive = false, graph = false;
    PrefetchChoice choice;
    PlanKey key;
};

// The projections g, u [M, w] (row stride ld) of w output columns -> y [M, w] (row stride ldy):
// silu(g) * u, g and u first rounded in place as the unfused ops round activations of that dtype
// (round_to: 0 none, 1 bfloat16, 2 float16).
void swiglu_epilogue(float* g, float* u, int64_t ld, int64_t M, int64_t round_to, float* y, int64_t ldy, int64_t w) {
    for (int64_t m = 0; m < M; ++m) {
        float* a = g + m * ld;
        float* b = u + m * ld;
        if (round_to == 1)
            for (int64_t j = 0; j < w; ++j) { a[j] = (float)c10::BFloat16(a[j]); b[j] = (float)c10::BFloat16(b[j]); }
        else if (round_to == 2)
            for (int64_t j = 0; j < w; ++j) { a[j] = (float)c10::Half(a[j]); b[j] = (float)c10::Half(b[j]); }
        hz_silu_mul(a, b, y + m * ldy, w);
    }
}

// swiglu_mul_mat's mat-vec with both weights on panels, its operands resolved as MvPlan's (a graph
// node keeps it across replays). The tasks are gate's row ranges (rows each, nt of them), then up's,
// in one region, so each thread's own range is one contiguous stream (with 2 threads: one weight
// each); whichever of a range's two tasks finishes second runs its epilogue (halves counts them).
// Interleaving the two weights within a task (gate's range, then up's) measured 12-16% slower from
// DRAM on Zen 4.
struct SwigluPlan {
    PlanKey key;
    const HzIsa* isa = nullptr;
    const HzFormatKernels *fg = nullptr, *fu = nullptr;
    const uint8_t *pg = nullptr, *pu = nullptr;  // the panels
    const float* x = nullptr;
    float* y = nullptr;  // [M, F]
    int64_t M = 0, K = 0, F = 0, round_to = 0, rows = 0, nt = 0, nth = 1;
    bool share = true;   // one block size: qg serves both weights
    QuantAct qg, qu;
    torch::Tensor gu;    // the projections, float32 [2, M, F]
    std::unique_ptr<std::atomic<int>[]> halves;
};

void swiglu_plan_run(SwigluPlan& p) {
    quantize_act_raw(p.isa, p.x, p.M, p.qg);
    if (!p.share) quantize_act_raw(p.isa, p.x, p.M, p.qu);
    const HzAct* ag = &p.qg.view;
    const HzAct* au = p.share ? ag : &p.qu.view;
    float* gp = p.gu.data_ptr<float>();
    const int64_t M = p.M, F = p.F, nt = p.nt, rows = p.rows;
    for (int64_t i = 0; i < nt; ++i) p.halves[i].store(0, std::memory_order_relaxed);
    run_tasks(2 * nt, p.nth, [&](int64_t t) {
        const bool up = t >= nt;
        const int64_t r = up ? t - nt : t, n0 = r * rows, n1 = std::min(F, n0 + rows);
        (up ? p.fu : p.fg)->matvec_panels(up ? p.pu : p.pg, p.K, n0, n1, up ? au : ag, M, gp + (up ? M * F : 0) + n0, F);
        if (p.halves[r].fetch_add(1, std::memory_order_acq_rel) == 1)  // the other half is written
            swiglu_epilogue(gp + n0, gp + M * F + n0, F, M, p.round_to, p.y + n0, F, n1 - n0);
    });
}

// Buffers a CPU graph's node keeps across replays (graph.h): the quantized activations, one per
// block size (GEMM), and the prepared mat-vecs. Null in eager calls: the op allocates them.
struct OpScratch {
    std::vector<QuantAct> qa;
    MvPlan plan;         // mul_mat's and mul_mat_group's mat-vec
    SwigluPlan swiglu;   // swiglu_mul_mat's over panels
    QuantAct& slot(size_t i) {
        if (qa.size() <= i) qa.resize(i + 1);
        return qa[i];
    }
};

// Builds p for x2 [M, K] (float32, contiguous, M <= mv_max) and weights ws (contiguous uint8
// [N_i, rb_i], formats tids / fk, checked by the caller) into ys (float32 [M, N_i], contiguous),
// with biases bs (float32 [N_i], contiguous) where given.
void mv_plan_build(MvPlan& p, int64_t isa_level, int64_t mv_max, const torch::Tensor& x2,
                   const std::vector<torch::Tensor>& ws, const std::vector<int64_t>& tids,
                   const std::vector<const HzFormatKernels*>& fk, const std::vector<std::optional<torch::Tensor>>& bs,
                   const std::vector<torch::Tensor>& ys) {
    const int64_t G = (int64_t)ws.size();
    p.key.set(isa_level, mv_max);
    p.isa = isa_table(isa_level);
    p.x = x2.data_ptr<float>();
    p.M = x2.size(0);
    p.K = x2.size(1);
    p.key.keep.insert(p.key.keep.end(), ys.begin(), ys.end());
    p.key.keep.push_back(x2);
    for (const auto& b : bs)
        if (b.has_value()) p.key.keep.push_back(*b);
    p.parts.assign(G, MvPlan::Part{});
    std::vector<int64_t> act_of(G);
    int64_t nacts = 0;
    for (int64_t i = 0; i < G; ++i) {
        int64_t j = 0;
        while (j < nacts && p.acts[j].view.qa != fk[i]->qk) ++j;
        if (j == nacts) {
            if ((int64_t)p.acts.size() <= nacts) p.acts.emplace_back();
            act_buffers(p.acts[nacts++], p.M, p.K, fk[i]->qk);  // mv_plan_run quantizes
        }
        act_of[i] = j;
    }
    p.acts.resize(nacts);
    int64_t total = 0;
    for (int64_t i = 0; i < G; ++i) total += ws[i].size(0) * ws[i].size(1);
    p.nth = std::max<int64_t>(1, p.key.threads);
    p.serial = p.nth == 1 || total < 65536;
    const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(hz_mv_chunk_bytes, total / (hz_mv_min_chunks * p.nth)));
    p.tasks.clear();
    for (int64_t i = 0; i < G; ++i) {
        const int64_t N = ws[i].size(0), rb = ws[i].size(1);
        p.key.add_weight(*fk[i], ws[i]);
        p.parts[i] = {fk[i], ws[i].data_ptr<uint8_t>(), mv_panels(*fk[i], ws[i], tids[i], true), N, rb,
                      &p.acts[act_of[i]].view, ys[i].data_ptr<float>(),
                      bs[i].has_value() ? bs[i]->data_ptr<float>() : nullptr};
        int64_t rows = std::max<int64_t>(1, chunk / std::max<int64_t>(1, rb));
        if (rows > 8) rows -= rows % 8;  // whole 8-row groups of panels (kernels_panels.h)
        for (int64_t n0 = 0; n0 < N; n0 += rows) p.tasks.push_back({i, n0, std::min(N, n0 + rows)});
    }
    // the Q4_K panels take no stream prefetch (hz_prefetch_panels); the Q6_K planes take the rows'
    p.adaptive = hz_adaptive_prefetch && G == 1 && !p.serial && (!p.parts[0].panels || tids[0] != block_q4_K::type_id);
    p.nth = std::min<int64_t>(p.nth, (int64_t)p.tasks.size());
}

// Runs p: quantizes x (x's current contents) and runs the tasks.
void mv_plan_run(MvPlan& p) {
    for (QuantAct& a : p.acts) quantize_act_raw(p.isa, p.x, p.M, a);
    const int64_t M = p.M, K = p.K;
    auto task = [&](int64_t t) {
        const MvPlan::Task& k = p.tasks[t];
        const MvPlan::Part& w = p.parts[k.part];
        if (w.panels) w.fk->matvec_panels(w.panels, K, k.n0, k.n1, w.act, M, w.y + k.n0, w.N);
        else w.fk->matvec(w.rows, w.rb, k.n0, k.n1, w.act, M, w.y, w.N);
        if (w.bias)
            for (int64_t m = 0; m < M; ++m)
                for (int64_t n = k.n0; n < k.n1; ++n) w.y[m * w.N + n] += w.bias[n];
    };
    const int64_t ntasks = (int64_t)p.tasks.size();
    if (p.serial) {
        for (int64_t t = 0; t < ntasks; ++t) task(t);
        return;
    }
    if (!p.adaptive) {
        run_tasks(ntasks, p.nth, task);
        return;
    }
    const void* W = p.parts[0].rows;
    int arm;
    if (p.graph) {
        arm = p.choice.arm();
    } else {
        std::lock_guard<std::mutex> lock(g_prefetch_mu);
        if (g_prefetch_choice.size() > 65536) g_prefetch_choice.clear();  // weights freed and reallocated
        arm = g_prefetch_choice[W].arm();
    }
    HzAct& a = p.acts[0].view;  // the one weight's activation
    a.no_prefetch = arm;
    const int64_t t0 = hz_now_ns();
    run_tasks(ntasks, p.nth, task);
    const double nspb = (double)(hz_now_ns() - t0) / (double)(p.parts[0].N * p.parts[0].rb);
    a.no_prefetch = 0;
    if (p.graph) {
        p.choice.record(arm, nspb);
    } else {
        std::lock_guard<std::mutex> lock(g_prefetch_mu);
        auto it = g_prefetch_choice.find(W);
        if (it != g_prefetch_choice.end()) it->second.record(arm, nspb);
    }
}

// x [M, K] float, w uint8 [N, rb] -> [M, N] float32. out: the result's buffer (float32 [M, N],
// contiguous) instead of a new tensor; scratch: reused activation buffers (both for graph nodes).
torch::Tensor mul_mat(torch::Tensor x, torch::Tensor w, int64_t type_id, int64_t isa_level, int64_t mv_max,
                      const torch::Tensor* out = nullptr, OpScratch* scratch = nullptr) {
    const HzIsa* isa = isa_table(isa_level);
    const HzFormatKernels& fk = format_kernels(isa, type_id);
    check_grid(type_id);
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2,
                "mul_mat: w must be a 2-D uint8 CPU tensor, got ", w.scalar_type(), " with ", w.dim(), " dims");
    TORCH_CHECK(x.dim() == 2, "mul_mat: x must be 2-D here");
    w = w.contiguous();
    const int64_t N = w.size(0), rb = w.size(1), K = infer_k(fk, rb, "mul_mat");
    torch::Tensor xf = check_x(x, K, "mul_mat");
    const int64_t M = xf.size(0);
    torch::Tensor y = out ? *out : torch::empty({M, N}, torch::kFloat32);
    if (M == 0 || N == 0) return y;
    if (K == 0) return y.zero_();
    if (M > mv_max) {
        QuantAct own;
        const QuantAct& qa = quantize_act_into(isa, xf, fk.qk, scratch ? scratch->slot(0) : own);
        run_gemm(fk, w.data_ptr<uint8_t>(), rb, N, qa.view, M, y.data_ptr<float>(), N);
        return y;
    }
    MvPlan own_plan;
    MvPlan& plan = scratch ? scratch->plan : own_plan;
    plan.graph = scratch != nullptr;
    mv_plan_build(plan, isa_level, mv_max, xf, {w}, {type_id}, {&fk}, {std::nullopt}, {y});
    mv_plan_run(plan);
    return y;
}

// Gate and up projections with the SwiGLU epilogue in one parallel region:
// x [M, K] float, wg / wu uint8 [F, rb_g] / [F, rb_u] -> silu(x Wg^T) * (x Wu^T) [M, F] float32.
// x is quantized once per block size (once in all when both formats share it). Each task takes a
// range of F and computes its gate rows, its up rows and the epilogue while they are in L1, so
// the op has one fork-join instead of three (two mul_mat and a swiglu).
// round_to: 0 keeps the float32 projections; 1 / 2 rounds them to bfloat16 / float16 before the
// epilogue, as the unfused ops do for activations of that dtype (bit-identical results).
// out, scratch: as mul_mat's.
torch::Tensor swiglu_mul_mat(torch::Tensor x, torch::Tensor wg, torch::Tensor wu, int64_t tg, int64_t tu,
                             int64_t isa_level, int64_t mv_max, int64_t round_to, const torch::Tensor* out = nullptr,
                             OpScratch* scratch = nullptr) {
    const HzIsa* isa = isa_table(isa_level);
    const HzFormatKernels& fg = format_kernels(isa, tg);
    const HzFormatKernels& fu = format_kernels(isa, tu);
    check_grid(tg);
    check_grid(tu);
    for (const torch::Tensor* w : {&wg, &wu})
        TORCH_CHECK(w->device().is_cpu() && w->scalar_type() == torch::kUInt8 && w->dim() == 2,
                    "swiglu_mul_mat: weights must be 2-D uint8 CPU tensors");
    TORCH_CHECK(x.dim() == 2, "swiglu_mul_mat: x must be 2-D here");
    wg = wg.contiguous();
    wu = wu.contiguous();
    const int64_t F = wg.size(0), rbg = wg.size(1), rbu = wu.size(1);
    TORCH_CHECK(wu.size(0) == F, "swiglu_mul_mat: w_gate has ", F, " rows, w_up ", wu.size(0));
    const int64_t K = infer_k(fg, rbg, "swiglu_mul_mat");
    TORCH_CHECK(infer_k(fu, rbu, "swiglu_mul_mat") == K, "swiglu_mul_mat: w_gate and w_up rows hold different K");
    torch::Tensor xf = check_x(x, K, "swiglu_mul_mat");
    const int64_t M = xf.size(0);
    torch::Tensor y = out ? *out : torch::empty({M, F}, torch::kFloat32);
    if (M == 0 || F == 0) return y;
    if (K == 0) return y.zero_();
    const bool mv = M <= mv_max;
    const RowSplit split(F, rbg + rbu, mv, std::max<int64_t>(fg.gemm_nr, fu.gemm_nr));
    const uint8_t* pgp = mv_panels(fg, wg, tg, mv);
    const uint8_t* pup = mv_panels(fu, wu, tu, mv);
    if (pgp && pup && !split.serial) {
        SwigluPlan own_plan;
        SwigluPlan& p = scratch ? scratch->swiglu : own_plan;
        p.key.set(isa_level, mv_max);
        p.key.add_weight(fg, wg);
        p.key.add_weight(fu, wu);
        p.key.keep.push_back(xf);
        p.key.keep.push_back(y);
        p.isa = isa;
        p.fg = &fg;
        p.fu = &fu;
        p.pg = pgp;
        p.pu = pup;
        p.x = xf.data_ptr<float>();
        p.y = y.data_ptr<float>();
        p.M = M;
        p.K = K;
        p.F = F;
        p.round_to = round_to;
        p.rows = split.chunk * split.tile;
        p.nt = (F + p.rows - 1) / p.rows;
        p.nth = split.nth;
        p.share = fu.qk == fg.qk;
        act_buffers(p.qg, M, K, fg.qk);  // swiglu_plan_run quantizes
        if (!p.share) act_buffers(p.qu, M, K, fu.qk);
        if (!p.gu.defined() || p.gu.size(1) != M || p.gu.size(2) != F) p.gu = torch::empty({2, M, F}, torch::kFloat32);
        p.halves.reset(new std::atomic<int>[p.nt]);
        swiglu_plan_run(p);
        return y;
    }
    QuantAct qg_own, qu_own;
    const bool share = fu.qk == fg.qk;
    if (scratch) scratch->slot(1);  // both slots exist before references to them are taken
    const QuantAct& qg = quantize_act_into(isa, xf, fg.qk, scratch ? scratch->slot(0) : qg_own);
    const HzAct& au = share ? qg.view : quantize_act_into(isa, xf, fu.qk, scratch ? scratch->slot(1) : qu_own).view;
    hz_matmul_fn fng = mv ? fg.matvec : fg.gemm, fnu = mv ? fu.matvec : fu.gemm;
    const int64_t cols = std::min(F, split.chunk * split.tile);  // rows of one task at most
    const uint8_t* pg = wg.data_ptr<uint8_t>();
    const uint8_t* pu = wu.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    split.run(F, [&](int64_t n0, int64_t n1) {
        thread_local std::vector<float> gbuf, ubuf;  // this task's projections, [M, n1 - n0]
        gbuf.resize(M * cols);
        ubuf.resize(M * cols);
        const int64_t w = n1 - n0;
        if (pgp) fg.matvec_panels(pgp, K, n0, n1, &qg.view, M, gbuf.data(), w);
        else fng(pg + n0 * rbg, rbg, 0, w, &qg.view, M, gbuf.data(), w);
        if (pup) fu.matvec_panels(pup, K, n0, n1, &au, M, ubuf.data(), w);
        else fnu(pu + n0 * rbu, rbu, 0, w, &au, M, ubuf.data(), w);
        swiglu_epilogue(gbuf.data(), ubuf.data(), w, M, round_to, yp + n0, F, w);
    });
    return y;
}

// Several weights over one activation (the q, k and v projections of a layer): x [M, K] float,
// ws[i] uint8 [N_i, rb_i] in format tids[i], optional float32 biases bs[i] [N_i] ->
// [M, N_i] float32 each, y_i = x W_i^T (+ b_i). x is quantized once per block size. A mat-vec
// (M <= mv_max) runs every weight's row ranges as the tasks of one parallel region, tasks of about
// the same bytes over all weights (RowSplit's sizes applied to the sum), so the small projections
// share one fork-join instead of one each. Each row is computed by the same kernel as mul_mat's,
// so the results are mul_mat's bits (the bias added in float32 after, as y + b).
// outs, scratch: the results' buffers (float32 [M, N_i], contiguous) and reused activation
// buffers, as mul_mat's out and scratch.
std::vector<torch::Tensor> mul_mat_group(torch::Tensor x, std::vector<torch::Tensor> ws, std::vector<int64_t> tids,
                                         std::vector<std::optional<torch::Tensor>> bs, int64_t isa_level,
                                         int64_t mv_max, const std::vector<torch::Tensor>* outs = nullptr,
                                         OpScratch* scratch = nullptr) {
    const int64_t G = (int64_t)ws.size();
    TORCH_CHECK(G >= 1 && (int64_t)tids.size() == G && (int64_t)bs.size() == G,
                "mul_mat_group: need as many formats and biases as weights");
    TORCH_CHECK(x.dim() == 2, "mul_mat_group: x must be 2-D here");
    const HzIsa* isa = isa_table(isa_level);
    std::vector<const HzFormatKernels*> fk(G);
    int64_t K = -1;
    for (int64_t i = 0; i < G; ++i) {
        fk[i] = &format_kernels(isa, tids[i]);
        check_grid(tids[i]);
        TORCH_CHECK(ws[i].device().is_cpu() && ws[i].scalar_type() == torch::kUInt8 && ws[i].dim() == 2,
                    "mul_mat_group: weight ", i, " must be a 2-D uint8 CPU tensor");
        ws[i] = ws[i].contiguous();
        const int64_t k = infer_k(*fk[i], ws[i].size(1), "mul_mat_group");
        TORCH_CHECK(K < 0 || k == K, "mul_mat_group: weight ", i, " has rows of K=", k, ", weight 0 of K=", K);
        K = k;
        if (bs[i].has_value()) {
            TORCH_CHECK(bs[i]->scalar_type() == torch::kFloat32 && bs[i]->dim() == 1 && bs[i]->size(0) == ws[i].size(0),
                        "mul_mat_group: bias ", i, " must be float32 [", ws[i].size(0), "]");
            bs[i] = bs[i]->contiguous();
        }
    }
    torch::Tensor xf = check_x(x, K, "mul_mat_group");
    const int64_t M = xf.size(0);
    std::vector<torch::Tensor> ys(G);
    for (int64_t i = 0; i < G; ++i) ys[i] = outs ? (*outs)[i] : torch::empty({M, ws[i].size(0)}, torch::kFloat32);
    if (M == 0) return ys;
    if (K == 0) {
        for (int64_t i = 0; i < G; ++i) bs[i].has_value() ? ys[i].copy_(bs[i]->expand({M, ws[i].size(0)})) : ys[i].zero_();
        return ys;
    }
    OpScratch own;
    OpScratch& sc = scratch ? *scratch : own;
    if (M <= mv_max) {
        sc.plan.graph = scratch != nullptr;
        mv_plan_build(sc.plan, isa_level, mv_max, xf, ws, tids, fk, bs, ys);
        mv_plan_run(sc.plan);
        return ys;
    }
    std::vector<int64_t> qa_of(G);  // the slot of each weight's block size, quantized once
    int64_t nqa = 0;
    for (int64_t i = 0; i < G; ++i) {
        int64_t j = 0;
        while (j < nqa && sc.qa[j].view.qa != fk[i]->qk) ++j;
        if (j == nqa) quantize_act_into(isa, xf, fk[i]->qk, sc.slot(nqa++));
        qa_of[i] = j;
    }
    for (int64_t i = 0; i < G; ++i) {
        const QuantAct& qa = sc.qa[qa_of[i]];
        float* y = ys[i].data_ptr<float>();
        const int64_t N = ws[i].size(0);
        run_gemm(*fk[i], ws[i].data_ptr<uint8_t>(), ws[i].size(1), N, qa.view, M, y, N);
        if (bs[i].has_value()) {
            const float* b = bs[i]->data_ptr<float>();
            for (int64_t m = 0; m < M; ++m)
                for (int64_t n = 0; n < N; ++n) y[m * N + n] += b[n];
        }
    }
    return ys;
}

// x [T, kx, K] (kx == 1 broadcasts over the k slots), w uint8 [E, N, rb], ids int64 [T, k] -> [T, k, N]
torch::Tensor mul_mat_id(torch::Tensor x, torch::Tensor w, torch::Tensor ids, int64_t type_id, int64_t isa_level,
                         int64_t mv_max) {
    const HzIsa* isa = isa_table(isa_level);
    const HzFormatKernels& fk = format_kernels(isa, type_id);
    check_grid(type_id);
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 3,
                "mul_mat_id: w must be a 3-D uint8 CPU tensor [E, N, row_bytes]");
    TORCH_CHECK(ids.dim() == 2, "mul_mat_id: ids must be [T, k]");
    TORCH_CHECK(x.dim() == 3, "mul_mat_id: x must be [T, 1 or k, K] here");
    w = w.contiguous();
    const int64_t E = w.size(0), N = w.size(1), rb = w.size(2), K = infer_k(fk, rb, "mul_mat_id");
    const int64_t T = ids.size(0), k = ids.size(1), kx = x.size(1);
    TORCH_CHECK(x.size(0) == T && (kx == 1 || kx == k), "mul_mat_id: x ", x.sizes(), " does not match ids ", ids.sizes());
    torch::Tensor xf = check_x(x, K, "mul_mat_id").reshape({T * kx, K});
    torch::Tensor id64 = ids.to(torch::kInt64).contiguous();
    const int64_t* idp = id64.data_ptr<int64_t>();
    for (int64_t i = 0; i < T * k; ++i)
        TORCH_CHECK_INDEX(idp[i] >= 0 && idp[i] < E, "mul_mat_id: expert id ", idp[i], " out of range [0, ", E, ")");
    torch::Tensor out = torch::empty({T, k, N}, torch::kFloat32);
    if (T * k == 0 || N == 0) return out;
    if (K == 0) return out.zero_();
    QuantAct qa = quantize_act(isa, xf, fk.qk);
    const int64_t nbq = K / fk.qk;
    // Group (token, slot) pairs by expert; each expert's weight is streamed once for its rows.
    std::vector<std::vector<int64_t>> rows(E);
    for (int64_t i = 0; i < T * k; ++i) rows[idp[i]].push_back(i);
    float* o = out.data_ptr<float>();
    const uint8_t* wp = w.data_ptr<uint8_t>();
    // Each used expert gets its rows' activations gathered and an output buffer; then ONE parallel
    // region runs tasks (expert, weight-row range) as hz_run_tasks deals them. An op call per expert
    // (8 per token for a top-8 MoE, small matrices) paid a fork-join each and cut each expert into
    // at least 4 tasks per thread. Tasks: ~256 KiB of weights (mat-vec) or 16 GEMM tiles.
    struct Job { int64_t e, c; bool mv; torch::Tensor gq, gd, gs, gsf, gy; HzAct a; };
    std::vector<Job> jobs;
    struct Task { int64_t job, n0, n1; };
    std::vector<Task> tasks;
    int64_t total_bytes = 0;
    for (int64_t e = 0; e < E; ++e) {
        const auto& r = rows[e];
        if (r.empty()) continue;
        Job j;
        j.e = e;
        j.c = (int64_t)r.size();
        j.mv = j.c <= mv_max;
        j.gq = torch::empty({j.c, K}, torch::kInt8);
        j.gd = torch::empty({j.c, nbq}, torch::kFloat32);
        j.gs = torch::empty({j.c, K / 16}, torch::kInt16);
        j.gsf = torch::empty({j.c, K / 16}, torch::kFloat32);
        j.gy = torch::empty({j.c, N}, torch::kFloat32);
        for (int64_t i = 0; i < j.c; ++i) {
            const int64_t src = kx == 1 ? r[i] / k : r[i];
            memcpy(j.gq.data_ptr<int8_t>() + i * K, qa.view.q + src * K, K);
            memcpy(j.gd.data_ptr<float>() + i * nbq, qa.view.d + src * nbq, nbq * sizeof(float));
            memcpy(j.gs.data_ptr<int16_t>() + i * (K / 16), qa.view.s + src * (K / 16), (K / 16) * sizeof(int16_t));
            memcpy(j.gsf.data_ptr<float>() + i * (K / 16), qa.view.sf + src * (K / 16), (K / 16) * sizeof(float));
        }
        j.a = HzAct{j.gq.data_ptr<int8_t>(), j.gd.data_ptr<float>(), j.gs.data_ptr<int16_t>(), j.gsf.data_ptr<float>(), K, fk.qk};
        // task size as RowSplit's, without its "at least 4 tasks per thread" rule: with all the
        // experts' tasks in one region, an expert's rows need not be cut small
        const int64_t rows_per_task = task_rows(rb, j.mv, fk.gemm_nr);
        for (int64_t n0 = 0; n0 < N; n0 += rows_per_task)
            tasks.push_back(Task{(int64_t)jobs.size(), n0, std::min(N, n0 + rows_per_task)});
        total_bytes += N * rb;
        jobs.push_back(std::move(j));
    }
    auto run_task = [&](const Task& t) {
        const Job& j = jobs[t.job];
        (j.mv ? fk.matvec : fk.gemm)(wp + j.e * N * rb, rb, t.n0, t.n1, &j.a, j.c, j.gy.data_ptr<float>(), N);
    };
    const int64_t nth = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (int64_t)tasks.size()));
    if (nth == 1 || total_bytes < 65536) {
        for (const Task& t : tasks) run_task(t);
    } else {
        run_tasks((int64_t)tasks.size(), nth, [&](int64_t i) { run_task(tasks[i]); });
    }
    for (const Job& j : jobs) {
        const auto& r = rows[j.e];
        for (int64_t i = 0; i < j.c; ++i) memcpy(o + r[i] * N, j.gy.data_ptr<float>() + i * N, N * sizeof(float));
    }
    return out;
}

// w uint8 [V, rb], ids int [n] -> float32 [n, K]; out: the result's buffer (float32 [n, K], contiguous).
torch::Tensor get_rows(torch::Tensor w, torch::Tensor ids, int64_t type_id, int64_t isa_level,
                       const torch::Tensor* out_buf = nullptr) {
    const HzIsa* isa = isa_table(isa_level);
    const HzFormatKernels& fk = format_kernels(isa, type_id);
    check_grid(type_id);
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2,
                "get_rows: w must be a 2-D uint8 CPU tensor [V, row_bytes]");
    w = w.contiguous();
    const int64_t V = w.size(0), rb = w.size(1), K = infer_k(fk, rb, "get_rows");
    torch::Tensor id64 = ids.scalar_type() == torch::kInt64 && ids.is_contiguous() ? ids : ids.to(torch::kInt64).contiguous();
    const int64_t n = id64.numel();
    const int64_t* idp = id64.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)
        TORCH_CHECK_INDEX(idp[i] >= 0 && idp[i] < V, "get_rows: row id ", idp[i], " out of range [0, ", V, ")");
    torch::Tensor out = out_buf ? *out_buf : torch::empty({n, K}, torch::kFloat32);
    float* o = out.data_ptr<float>();
    const uint8_t* wp = w.data_ptr<uint8_t>();
    auto fn = fk.dequant_row;
    at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) fn(wp + idp[i] * rb, K, o + i * K);
    });
    return out;
}

// Packed rows -> float32 [N, K] (whole-weight dequantization, for diagnostics and the float path).
torch::Tensor dequantize_rows(torch::Tensor w, int64_t type_id, int64_t isa_level) {
    const HzIsa* isa = isa_table(isa_level);
    const HzFormatKernels& fk = format_kernels(isa, type_id);
    check_grid(type_id);
    TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.dim() == 2, "dequantize_rows: w must be 2-D uint8");
    w = w.contiguous();
    const int64_t N = w.size(0), rb = w.size(1), K = infer_k(fk, rb, "dequantize_rows");
    torch::Tensor out = torch::empty({N, K}, torch::kFloat32);
    float* o = out.data_ptr<float>();
    const uint8_t* wp = w.data_ptr<uint8_t>();
    auto fn = fk.dequant_row;
    at::parallel_for(0, N, 16, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) fn(wp + i * rb, K, o + i * K);
    });
    return out;
}

// The activation quantization alone (for tests): x [M, K] -> (q int8 [M,K], d f32 [M,K/qa], s int16 [M,K/16],
// sf f32 [M,K/16] = d * s)
std::vector<torch::Tensor> quantize_activation(torch::Tensor x, int64_t qa, int64_t isa_level) {
    const HzIsa* isa = isa_table(isa_level);
    TORCH_CHECK(qa > 0 && qa % 32 == 0, "quantize_activation: qa must be a multiple of 32");
    TORCH_CHECK(x.dim() == 2 && x.size(1) % qa == 0, "quantize_activation: x must be [M, K] with K % qa == 0");
    torch::Tensor xf = x.to(torch::kFloat32).contiguous();
    QuantAct r = quantize_act(isa, xf, qa);
    return {r.q, r.d, r.s, r.sf};
}

// Install table `slot` (an HzTableSlot of ggml_blocks.h): int8 values, hz_table_numel[slot] of them.
void set_table(int64_t slot, torch::Tensor table) {
    TORCH_CHECK(slot >= 0 && slot < HZ_N_TABLES, "set_table: slot ", slot, " out of range [0, ", HZ_N_TABLES, ")");
    TORCH_CHECK(table.scalar_type() == torch::kInt8 && table.numel() == hz_table_numel[slot], "set_table: slot ", slot,
                " needs ", hz_table_numel[slot], " int8 values, got ", table.numel(), " of ", table.scalar_type());
    g_tables[slot] = table.contiguous().clone();
    hz_tables[slot] = g_tables[slot].data_ptr<int8_t>();
}

std::vector<int64_t> supported_isas() {
    std::vector<int64_t> r;
    for (int64_t l = 0; l <= kMaxIsa; ++l)
        if (isa_supported(l)) r.push_back(l);
    return r;
}

std::vector<std::vector<int64_t>> formats() {  // (type_id, block size, block bytes)
    std::vector<std::vector<int64_t>> r;
    const HzIsa* isa = hz_isa_scalar();
    for (int i = 0; i < isa->n_formats; ++i) r.push_back({isa->formats[i].type_id, isa->formats[i].qk, isa->formats[i].bytes});
    return r;
}

// ------------------------------------------------------------------------------------------------
// The CPU kernels of the hanzo ops, registered on torch's CPU dispatch key (TORCH_LIBRARY_IMPL at the
// end of this file), so torch.ops.hanzo.<op> on CPU tensors reaches C++ with no Python in between.
//
// Each kernel runs its C++ path when the call fits it (a format in this table, float activations,
// the shapes it was written for) and hands every other call to the op's reference,
// torch.ops.hanzo_ref.<op> (vectorized torch, defined in hanzo_torch/ops), which also raises the
// op's usual ValueError/IndexError for bad arguments. The fit tests below are what the C++ paths
// need to be memory-safe, not a copy of the Python checks. Reference mode (HANZO_<OP>_FALLBACK=1,
// hanzo_torch.ops.use_reference) never reaches these kernels: it registers the reference in front
// of them on the CPU key (hanzo_torch/ops/_dispatch.py). The instruction set is mirrored into an
// atomic by the Python side of the backend (hanzo_torch/backends/cpu): nothing here reads the environment.
namespace dispatch {

using namespace hz::ops;  // enum Op, N_OPS, kOpNames: generated from the op table (hz_ops.h)
std::atomic<int64_t> g_isa{0}, g_mv_max{HZ_CPU_MATVEC_MAX_ROWS};
std::atomic<bool> g_configured{false};  // false until configure(): every call goes to the reference
// ggml name -> type id of the formats with a C++ kernel, set once by configure() before g_configured.
std::unordered_map<std::string, int64_t> g_qtypes;
std::unordered_set<std::string> g_lacking;  // registered quantized formats without a C++ kernel

// Before configure() every call goes to the reference (the op argument names the caller).
bool use_ref(Op) { return !g_configured.load(std::memory_order_acquire); }

template <class Sig>
c10::TypedOperatorHandle<Sig> ref_op(const char* name) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// A quantized format without a C++ kernel goes to the reference, with one warning per format.
bool qtype_id(c10::string_view qtype, int64_t* tid) {
    const int64_t* id = hz::find_format(g_qtypes, g_lacking, qtype, "hanzo cpu", "C++ kernel");
    if (id != nullptr) *tid = *id;
    return id != nullptr;
}

bool is_act(const at::Tensor& t) {  // float32 / bfloat16 / float16 on the CPU
    const auto d = t.scalar_type();
    return t.device().is_cpu() && (d == at::kFloat || d == at::kBFloat16 || d == at::kHalf);
}
bool is_int(const at::Tensor& t) { return t.device().is_cpu() && at::isIntegralType(t.scalar_type(), /*includeBool=*/false); }

// The type id of qtype when the C++ path may run it for a packed weight w ([..., rows, row_bytes],
// dim dims) of row length K.
bool packed_ok(const at::Tensor& w, int64_t dim, c10::string_view qtype, int64_t K, int64_t* tid) {
    if (!(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == dim) || !qtype_id(qtype, tid)) return false;
    const HzFormatKernels& fk = format_kernels(hz_isa_scalar(), *tid);
    return K % fk.qk == 0 && w.size(-1) == K / fk.qk * fk.bytes;
}

// [..., K] -> [M, K] (2-D inputs as they are).
at::Tensor as_2d(const at::Tensor& x) { return x.dim() == 2 ? x : x.reshape({-1, x.size(-1)}); }

at::Tensor to_act(const at::Tensor& y, const at::Tensor& x, int64_t N) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
    shape.push_back(N);
    at::Tensor r = y.view(shape);
    return x.scalar_type() == at::kFloat ? r : r.to(x.scalar_type());
}

// CPU graph nodes (graph.h) of the kernels below. Each node keeps the op's input and output
// tensors and redoes the op's work into the outputs, reading the current ISA level and row limit;
// the activations must be float32 (the other dtypes' conversions allocate new tensors).
bool graph_takes(const at::Tensor& x, const char* op) {
    if (x.scalar_type() == at::kFloat) return true;
    hz_graph_reject(op, std::string("a CPU graph takes float32 activations, got ") + c10::toString(x.scalar_type()));
    return false;
}

// x as [M, K] at replay: the view taken at capture when it aliases x, else reshaped again.
std::function<at::Tensor()> graph_rows(const at::Tensor& x) {
    const at::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
    if (x2.is_alias_of(x)) return [x2]() { return x2; };
    return [x]() { return x.reshape({-1, x.size(-1)}); };
}

// Whether graph_rows(x) gives the same float32 contiguous rows at every replay, so that a node's
// MvPlan (which holds their address) stays valid.
bool graph_rows_fixed(const at::Tensor& x) {
    const at::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
    return x2.is_alias_of(x) && x2.is_contiguous() && x2.scalar_type() == at::kFloat;
}

// All positions in [0, S) (read on the host: these are CPU tensors).
bool positions_in(const at::Tensor& pos, int64_t S) {
    if (pos.numel() == 1) {
        const int64_t p = pos.scalar_type() == at::kLong ? *pos.data_ptr<int64_t>() : pos.item<int64_t>();
        return p >= 0 && p < S;
    }
    const at::Tensor p = pos.to(at::kLong).contiguous();
    const int64_t* d = p.data_ptr<int64_t>();
    for (int64_t i = 0; i < p.numel(); ++i)
        if (d[i] < 0 || d[i] >= S) return false;
    return true;
}

// A graph node's account of weight w (format tid) at M activation rows: the rows' address and the
// bytes the mat-vec reads for them, its panels' where the mat-vec takes them.
std::pair<int64_t, int64_t> graph_weight(const at::Tensor& w, int64_t tid, int64_t M) {
    const HzFormatKernels& fk = format_kernels(isa_table(g_isa.load(std::memory_order_relaxed)), tid);
    const bool panels = mv_panels(fk, w, tid, M <= g_mv_max.load(std::memory_order_relaxed)) != nullptr;
    return {(int64_t)(intptr_t)w.data_ptr(), panels ? panel_bytes(tid, w.size(0), w.size(1)) : (int64_t)w.nbytes()};
}

at::Tensor mul_mat_cpu(const at::Tensor& x, const at::Tensor& w, c10::string_view qtype) {
    int64_t tid;
    if (use_ref(MUL_MAT) || !is_act(x) || x.dim() < 1 || !packed_ok(w, 2, qtype, x.size(-1), &tid)) {
        static auto ref = ref_op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view)>("hanzo_ref::mul_mat");
        return ref.call(x, w, qtype);
    }
    at::Tensor y = mul_mat(as_2d(x), w, tid, g_isa.load(std::memory_order_relaxed), g_mv_max.load(std::memory_order_relaxed));
    if (hz_graph_capturing() && graph_takes(x, "hanzo::mul_mat")) {
        auto sc = std::make_shared<OpScratch>();
        hz_graph_record("hanzo::mul_mat", [rows = graph_rows(x), fixed = graph_rows_fixed(x), w, tid, y, sc]() {
            const int64_t isa = g_isa.load(std::memory_order_relaxed), mv_max = g_mv_max.load(std::memory_order_relaxed);
            if (hz_graph_plans && fixed && !sc->plan.key.stale(isa, mv_max)) return mv_plan_run(sc->plan);
            mul_mat(rows(), w, tid, isa, mv_max, &y, sc.get());
        }, {y}, {graph_weight(w, tid, y.size(0))});
    }
    return to_act(y, x, w.size(0));
}

at::Tensor mul_mat_id_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ids, c10::string_view qtype) {
    int64_t tid;
    bool ok = !use_ref(MUL_MAT_ID) && is_act(x) && (x.dim() == 2 || x.dim() == 3) && is_int(ids) && ids.dim() == 2 &&
              packed_ok(w, 3, qtype, x.size(-1), &tid);
    if (ok) ok = x.size(0) == ids.size(0) && (x.dim() == 2 || x.size(1) == ids.size(1));
    if (!ok) {
        static auto ref = ref_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view)>(
            "hanzo_ref::mul_mat_id");
        return ref.call(x, w, ids, qtype);
    }
    const at::Tensor x3 = x.dim() == 2 ? x.unsqueeze(1) : x;
    at::Tensor y = mul_mat_id(x3, w, ids, tid, g_isa.load(std::memory_order_relaxed), g_mv_max.load(std::memory_order_relaxed));
    return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

at::Tensor swiglu_mul_mat_cpu(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu, c10::string_view qg,
                              c10::string_view qu) {
    int64_t tg, tu;
    if (use_ref(SWIGLU_MUL_MAT) || !is_act(x) || x.dim() < 1 || !packed_ok(wg, 2, qg, x.size(-1), &tg) ||
        !packed_ok(wu, 2, qu, x.size(-1), &tu) || wg.size(0) != wu.size(0)) {
        static auto ref = ref_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view,
                                            c10::string_view)>("hanzo_ref::swiglu_mul_mat");
        return ref.call(x, wg, wu, qg, qu);
    }
    const auto d = x.scalar_type();
    at::Tensor y = swiglu_mul_mat(as_2d(x), wg, wu, tg, tu, g_isa.load(std::memory_order_relaxed),
                                  g_mv_max.load(std::memory_order_relaxed), d == at::kBFloat16 ? 1 : d == at::kHalf ? 2 : 0);
    if (hz_graph_capturing() && graph_takes(x, "hanzo::swiglu_mul_mat")) {
        auto sc = std::make_shared<OpScratch>();
        hz_graph_record("hanzo::swiglu_mul_mat", [rows = graph_rows(x), fixed = graph_rows_fixed(x), wg, wu, tg, tu, y, sc]() {
            const int64_t isa = g_isa.load(std::memory_order_relaxed), mv_max = g_mv_max.load(std::memory_order_relaxed);
            if (hz_graph_plans && fixed && !sc->swiglu.key.stale(isa, mv_max)) return swiglu_plan_run(sc->swiglu);
            swiglu_mul_mat(rows(), wg, wu, tg, tu, isa, mv_max, 0, &y, sc.get());
        }, {y}, {graph_weight(wg, tg, y.size(0)), graph_weight(wu, tu, y.size(0))});
    }
    return to_act(y, x, wg.size(0));
}

// The C++ path takes float32/bfloat16/float16 x without biases, and float32 x with float32 biases;
// the other bias cases (where torch's promotion of y + b decides the result dtype) go to the reference.
std::vector<at::Tensor> mul_mat_group_cpu(const at::Tensor& x, at::TensorList w, c10::ArrayRef<std::string> qtype,
                                          const c10::List<std::optional<at::Tensor>>& bias) {
    const int64_t G = (int64_t)w.size();
    bool ok = !use_ref(MUL_MAT_GROUP) && is_act(x) && x.dim() >= 1 && G >= 1 && (int64_t)qtype.size() == G &&
              (int64_t)bias.size() == G;
    std::vector<int64_t> tids(G);
    std::vector<std::optional<torch::Tensor>> bs(G);
    for (int64_t i = 0; ok && i < G; ++i) {
        ok = packed_ok(w[i], 2, qtype[i], x.size(-1), &tids[i]);
        const std::optional<at::Tensor> b = bias.get(i);
        if (ok && b.has_value()) {
            ok = x.scalar_type() == at::kFloat && b->device().is_cpu() && b->scalar_type() == at::kFloat &&
                 b->dim() == 1 && b->size(0) == w[i].size(0);
            bs[i] = *b;
        }
    }
    if (!ok) {
        static auto ref = ref_op<std::vector<at::Tensor>(const at::Tensor&, at::TensorList, c10::ArrayRef<std::string>,
                                                         const c10::List<std::optional<at::Tensor>>&)>(
            "hanzo_ref::mul_mat_group");
        return ref.call(x, w, qtype, bias);
    }
    std::vector<torch::Tensor> ws(w.begin(), w.end());
    std::vector<at::Tensor> ys = mul_mat_group(as_2d(x), ws, tids, bs, g_isa.load(std::memory_order_relaxed),
                                               g_mv_max.load(std::memory_order_relaxed));
    if (hz_graph_capturing() && graph_takes(x, "hanzo::mul_mat_group")) {
        auto sc = std::make_shared<OpScratch>();
        hz_graph_record("hanzo::mul_mat_group", [rows = graph_rows(x), fixed = graph_rows_fixed(x), ws, tids, bs, ys, sc]() {
            const int64_t isa = g_isa.load(std::memory_order_relaxed), mv_max = g_mv_max.load(std::memory_order_relaxed);
            if (hz_graph_plans && fixed && !sc->plan.key.stale(isa, mv_max)) return mv_plan_run(sc->plan);
            mul_mat_group(rows(), ws, tids, bs, isa, mv_max, &ys, sc.get());
        }, ys, [&] {
            std::vector<std::pair<int64_t, int64_t>> wts;
            for (int64_t i = 0; i < G; ++i) wts.push_back(graph_weight(ws[i], tids[i], ys[i].size(0)));
            return wts;
        }());
    }
    for (int64_t i = 0; i < G; ++i) ys[i] = to_act(ys[i], x, w[i].size(0));
    return ys;
}

at::Tensor get_rows_cpu(const at::Tensor& w, const at::Tensor& ids, c10::string_view qtype, at::ScalarType dtype) {
    int64_t tid;
    bool ok = !use_ref(GET_ROWS) && w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && is_int(ids) &&
              qtype_id(qtype, &tid);
    if (ok) ok = w.size(1) % format_kernels(hz_isa_scalar(), tid).bytes == 0;
    if (!ok) {
        static auto ref = ref_op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, at::ScalarType)>(
            "hanzo_ref::get_rows");
        return ref.call(w, ids, qtype, dtype);
    }
    at::Tensor rows = get_rows(w, ids.reshape({-1}), tid, g_isa.load(std::memory_order_relaxed));
    if (hz_graph_capturing()) {
        if (dtype != at::kFloat)
            hz_graph_reject("hanzo::get_rows", std::string("a CPU graph takes float32 rows, got ") + c10::toString(dtype));
        else
            hz_graph_record("hanzo::get_rows", [w, ids, tid, rows]() {
                get_rows(w, ids.reshape({-1}), tid, g_isa.load(std::memory_order_relaxed), &rows);
            }, {rows});
    }
    std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
    shape.push_back(rows.size(-1));
    rows = rows.view(shape);
    return dtype == at::kFloat ? rows : rows.to(dtype);
}

at::Tensor dequantize_cpu(const at::Tensor& data, c10::string_view qtype, c10::SymIntArrayRef sym_shape,
                          at::ScalarType dtype) {
    int64_t tid = 0;
    bool ok = !use_ref(DEQUANTIZE) && data.device().is_cpu() && data.scalar_type() == at::kByte && !sym_shape.empty() &&
              qtype_id(qtype, &tid);
    std::vector<int64_t> shape;
    int64_t rows = 1, rb = 0;
    if (ok) {
        for (const c10::SymInt& v : sym_shape) shape.push_back(v.guard_int(__FILE__, __LINE__));
        const HzFormatKernels& fk = format_kernels(hz_isa_scalar(), tid);
        const int64_t K = shape.back();
        for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
        ok = K > 0 && K % fk.qk == 0 && rows > 0;
        if (ok) {
            rb = K / fk.qk * fk.bytes;
            ok = data.numel() == rows * rb;
        }
    }
    if (!ok) {
        static auto ref = ref_op<at::Tensor(const at::Tensor&, c10::string_view, c10::SymIntArrayRef, at::ScalarType)>(
            "hanzo_ref::dequantize");
        return ref.call(data, qtype, sym_shape, dtype);
    }
    at::Tensor out = dequantize_rows(data.reshape({rows, rb}), tid, g_isa.load(std::memory_order_relaxed)).view(shape);
    return dtype == at::kFloat ? out : out.to(dtype);
}

// Handles of the fused-op kernels of fused.cpp (namespace hanzo_cpu), looked up once.
using NormSig = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddNormSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using QkSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                                 const std::optional<at::Tensor>&, const at::Tensor&, double, double);
using SwigluSig = at::Tensor(const at::Tensor&, const at::Tensor&);
using KvSig = void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using KvCpuSig = void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using AttnSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using AttnRefSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                              c10::string_view);
using RouteSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t, bool);
using RouteRefSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, c10::SymInt, bool);

bool norm_ok(const at::Tensor& x, const at::Tensor& w) {
    return is_act(x) && is_act(w) && w.dim() == 1 && x.dim() >= 1 && w.size(0) == x.size(-1);
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& w, double eps) {
    if (use_ref(RMS_NORM) || !norm_ok(x, w)) {
        static auto ref = ref_op<NormSig>("hanzo_ref::rms_norm");
        return ref.call(x, w, eps);
    }
    static auto op = ref_op<NormSig>("hanzo_cpu::rms_norm");
    at::Tensor y = op.call(x, w, eps);
    if (hz_graph_capturing())
        hz_graph_record("hanzo::rms_norm", [x, w, eps, y]() { hz_rms_norm_out(x, w, eps, y); }, {y});
    return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w,
                                                    double eps) {
    if (use_ref(ADD_RMS_NORM) || !norm_ok(x, w) || !r.device().is_cpu() || x.sizes() != r.sizes() ||
        x.scalar_type() != r.scalar_type()) {
        static auto ref = ref_op<AddNormSig>("hanzo_ref::add_rms_norm");
        return ref.call(x, r, w, eps);
    }
    static auto op = ref_op<AddNormSig>("hanzo_cpu::add_rms_norm");
    auto ys = op.call(x, r, w, eps);
    if (hz_graph_capturing()) {
        const at::Tensor y = std::get<0>(ys), s = std::get<1>(ys);
        hz_graph_record("hanzo::add_rms_norm", [x, r, w, eps, y, s]() { hz_add_rms_norm_out(x, r, w, eps, y, s); },
                        {y, s});
    }
    return ys;
}

std::tuple<at::Tensor, at::Tensor> qk_norm_rope_cpu(const at::Tensor& q, const at::Tensor& k,
                                                    const std::optional<at::Tensor>& qw,
                                                    const std::optional<at::Tensor>& kw, const at::Tensor& pos,
                                                    double theta, double eps) {
    bool ok = !use_ref(QK_NORM_ROPE) && q.dim() == 4 && k.dim() == 4 && is_act(q) && k.device().is_cpu() &&
              k.scalar_type() == q.scalar_type();
    if (ok) {
        const int64_t B = q.size(0), T = q.size(1), D = q.size(3);
        ok = k.size(0) == B && k.size(1) == T && k.size(3) == D && D % 2 == 0 && pos.dim() == 2 && pos.size(0) == B &&
             pos.size(1) == T && is_int(pos) && qw.has_value() == kw.has_value();
        if (ok && qw.has_value())
            ok = qw->dim() == 1 && qw->size(0) == D && kw->dim() == 1 && kw->size(0) == D && qw->device().is_cpu() &&
                 kw->device().is_cpu();
    }
    if (!ok) {
        static auto ref = ref_op<QkSig>("hanzo_ref::qk_norm_rope");
        return ref.call(q, k, qw, kw, pos, theta, eps);
    }
    static auto op = ref_op<QkSig>("hanzo_cpu::qk_norm_rope");
    return op.call(q, k, qw, kw, pos, theta, eps);
}

at::Tensor swiglu_cpu(const at::Tensor& g, const at::Tensor& u) {
    if (use_ref(SWIGLU) || !is_act(g) || !u.device().is_cpu() || g.sizes() != u.sizes() ||
        g.scalar_type() != u.scalar_type()) {
        static auto ref = ref_op<SwigluSig>("hanzo_ref::swiglu");
        return ref.call(g, u);
    }
    static auto op = ref_op<SwigluSig>("hanzo_cpu::swiglu");
    return op.call(g, u);
}

// A KV cache of rows of D values: float32/bfloat16/float16 [.., D], or q8_0 blocks uint8 [.., D/32*34].
bool kv_cache_ok(const at::Tensor& c, int64_t D) {
    const auto d = c.scalar_type();
    if (d == at::kByte) return D % HZ_Q8_0_BLOCK == 0 && c.size(3) == hz_q8_0_row_bytes(D);
    return (d == at::kFloat || d == at::kBFloat16 || d == at::kHalf) && c.size(3) == D;
}

void kv_cache_write_cpu(at::Tensor& kc, at::Tensor& vc, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos) {
    bool ok = !use_ref(KV_CACHE_WRITE) && kc.dim() == 4 && kc.sizes() == vc.sizes() && k.dim() == 4 &&
              k.sizes() == v.sizes() && kc.device().is_cpu() && vc.device().is_cpu() && k.device().is_cpu() &&
              v.device().is_cpu() && kc.is_contiguous() && vc.is_contiguous();
    if (ok)
        ok = k.size(0) == kc.size(0) && k.size(2) == kc.size(2) && kv_cache_ok(kc, k.size(3)) && is_act(k) &&
             v.scalar_type() == k.scalar_type() && vc.scalar_type() == kc.scalar_type() && pos.dim() == 2 &&
             pos.size(0) == k.size(0) && pos.size(1) == k.size(1) && is_int(pos) && positions_in(pos, kc.size(1));
    if (!ok) {
        static auto ref = ref_op<KvSig>("hanzo_ref::kv_cache_write");
        ref.call(kc, vc, k, v, pos);
        return;
    }
    static auto op = ref_op<KvCpuSig>("hanzo_cpu::kv_cache_write");
    op.call(kc, vc, k, v, pos);
}

using QkKvSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, at::Tensor&, at::Tensor&, const at::Tensor&, double, double);
using QkKvCpuSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                              const std::optional<at::Tensor>&, at::Tensor, at::Tensor, const at::Tensor&, double,
                              double);

// Runs the C++ path when both halves' fit tests pass (and neither half is in reference mode, so
// that HANZO_QK_NORM_ROPE_FALLBACK / HANZO_KV_CACHE_WRITE_FALLBACK keep meaning what they say).
at::Tensor qk_norm_rope_kv_write_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const std::optional<at::Tensor>& qw, const std::optional<at::Tensor>& kw,
                                     at::Tensor& kc, at::Tensor& vc, const at::Tensor& pos, double theta, double eps) {
    bool ok = !use_ref(QK_NORM_ROPE_KV_WRITE) && !use_ref(QK_NORM_ROPE) && !use_ref(KV_CACHE_WRITE) && q.dim() == 4 &&
              k.dim() == 4 && is_act(q) && k.device().is_cpu() && k.scalar_type() == q.scalar_type() &&
              v.device().is_cpu() && v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type() && kc.dim() == 4 &&
              kc.sizes() == vc.sizes() && kc.device().is_cpu() && vc.device().is_cpu() && kc.is_contiguous() &&
              vc.is_contiguous() && vc.scalar_type() == kc.scalar_type();
    if (ok) {
        const int64_t B = q.size(0), T = q.size(1), D = q.size(3);
        ok = k.size(0) == B && k.size(1) == T && k.size(3) == D && D % 2 == 0 && pos.dim() == 2 && pos.size(0) == B &&
             pos.size(1) == T && is_int(pos) && qw.has_value() == kw.has_value() && kc.size(0) == B &&
             kc.size(2) == k.size(2) && kv_cache_ok(kc, D) && positions_in(pos, kc.size(1));
        if (ok && qw.has_value())
            ok = qw->dim() == 1 && qw->size(0) == D && kw->dim() == 1 && kw->size(0) == D && qw->device().is_cpu() &&
                 kw->device().is_cpu();
    }
    if (!ok) {
        static auto ref = ref_op<QkKvSig>("hanzo_ref::qk_norm_rope_kv_write");
        return ref.call(q, k, v, qw, kw, kc, vc, pos, theta, eps);
    }
    static auto op = ref_op<QkKvCpuSig>("hanzo_cpu::qk_norm_rope_kv_write");
    at::Tensor qo = op.call(q, k, v, qw, kw, kc, vc, pos, theta, eps);
    if (hz_graph_capturing())
        hz_graph_record("hanzo::qk_norm_rope_kv_write", [q, k, v, qw, kw, kc, vc, pos, theta, eps, qo]() {
            hz_qk_norm_rope_kv_write_out(q, k, v, qw, kw, kc, vc, pos, theta, eps, qo);
        }, {qo, kc, vc});
    return qo;
}

at::Tensor attention_cpu(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& pos,
                         double scale, c10::string_view impl) {
    bool ok = !use_ref(ATTENTION) && (impl == "auto" || impl == "eager" || impl == "flash") && q.dim() == 4 && is_act(q) &&
              kc.dim() == 4 && kc.sizes() == vc.sizes() && kc.device().is_cpu() && vc.device().is_cpu();
    if (ok) {
        const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), Hk = kc.size(2);
        ok = kc.size(0) == B && kv_cache_ok(kc, D) && Hk > 0 && Hq % Hk == 0 && vc.scalar_type() == kc.scalar_type() &&
             pos.dim() == 2 && pos.size(0) == B && pos.size(1) == T &&
             is_int(pos) && positions_in(pos, kc.size(1));
    }
    if (!ok) {
        static auto ref = ref_op<AttnRefSig>("hanzo_ref::attention");
        return ref.call(q, kc, vc, pos, scale, impl);
    }
    static auto op = ref_op<AttnSig>("hanzo_cpu::attention");
    at::Tensor o = op.call(q, kc, vc, pos, scale);
    if (hz_graph_capturing() && graph_takes(q, "hanzo::attention"))
        hz_graph_record("hanzo::attention", [q, kc, vc, pos, scale, o]() { hz_attention_out(q, kc, vc, pos, scale, o); },
                        {o});
    return o;
}

std::tuple<at::Tensor, at::Tensor> moe_route_cpu(const at::Tensor& logits, c10::SymInt sym_k, bool normalize) {
    const int64_t k = sym_k.guard_int(__FILE__, __LINE__);
    if (use_ref(MOE_ROUTE) || !is_act(logits) || logits.dim() != 2 || k < 1 || k > logits.size(1)) {
        static auto ref = ref_op<RouteRefSig>("hanzo_ref::moe_route");
        return ref.call(logits, sym_k, normalize);
    }
    // torch's float32 softmax keeps the weights bit-identical to the reference's; the C++ kernel
    // replaces the sort, slicing and renormalization
    static auto op = ref_op<RouteSig>("hanzo_cpu::moe_route");
    return op.call(at::softmax(logits.to(at::kFloat), -1), k, normalize);
}

// x @ W^T + scale (x @ A^T) @ B^T: the CPU mul_mat kernel, then torch GEMMs for the adapter, in the
// steps and dtypes of the reference (hanzo_torch/ops/lora.py), so the bits are the reference's.
at::Tensor lora_mul_mat_cpu(const at::Tensor& x, const at::Tensor& w, c10::string_view qtype, const at::Tensor& a,
                            const at::Tensor& b, double scale) {
    bool ok = !use_ref(LORA_MUL_MAT) && is_act(x) && x.dim() >= 1 && is_act(a) && is_act(b) && a.dim() == 2 &&
              b.dim() == 2 && w.dim() == 2 && a.size(1) == x.size(-1) && b.size(1) == a.size(0) && b.size(0) == w.size(0);
    if (!ok) {
        static auto ref = ref_op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, const at::Tensor&,
                                            const at::Tensor&, double)>("hanzo_ref::lora_mul_mat");
        return ref.call(x, w, qtype, a, b, scale);
    }
    at::Tensor y = mul_mat_cpu(x, w, qtype);
    at::Tensor x2 = x.reshape({-1, x.size(-1)}).to(at::kFloat);
    at::Tensor delta = at::matmul(at::matmul(x2, a.to(at::kFloat).t()), b.to(at::kFloat).t()) * scale;
    return (y.reshape({-1, y.size(-1)}).to(at::kFloat) + delta).reshape(y.sizes()).to(x.scalar_type());
}

// The version-counter bump of kv_cache_write's mutated caches (ADInplaceOrView key), in C++: the
// custom op's own is Python (~50 us a call on the model's KV caches, which are normal tensors so
// that no_grad calls may write them). Same steps: bump k_cache's and v_cache's versions (inference
// tensors have none), then redispatch below ADInplaceOrView. Serves every device.
void kv_cache_write_adinplace(c10::DispatchKeySet ks, at::Tensor& kc, at::Tensor& vc, const at::Tensor& k,
                              const at::Tensor& v, const at::Tensor& pos) {
    for (const at::Tensor* t : {&kc, &vc})
        if (!t->is_inference()) torch::autograd::impl::bump_version(*t);
    static auto op = ref_op<KvSig>("hanzo::kv_cache_write");
    op.redispatch(ks & c10::after_ADInplaceOrView_keyset, kc, vc, k, v, pos);
}

// The same for qk_norm_rope_kv_write's caches.
at::Tensor qk_norm_rope_kv_write_adinplace(c10::DispatchKeySet ks, const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, const std::optional<at::Tensor>& qw,
                                           const std::optional<at::Tensor>& kw, at::Tensor& kc, at::Tensor& vc,
                                           const at::Tensor& pos, double theta, double eps) {
    for (const at::Tensor* t : {&kc, &vc})
        if (!t->is_inference()) torch::autograd::impl::bump_version(*t);
    static auto op = ref_op<QkKvSig>("hanzo::qk_norm_rope_kv_write");
    return op.redispatch(ks & c10::after_ADInplaceOrView_keyset, q, k, v, qw, kw, kc, vc, pos, theta, eps);
}

// qtypes: {ggml name: type id} of the formats with a C++ kernel; lacking: the registry's other
// quantized formats (they warn once, then run the reference; dense formats run it silently: the
// reference's torch GEMM is the CPU kernel for them).
void configure(py::dict qtypes, std::vector<std::string> lacking, int64_t isa, int64_t mv_max) {
    if (!g_configured.load()) {
        for (auto item : qtypes) g_qtypes[item.first.cast<std::string>()] = item.second.cast<int64_t>();
        for (const auto& d : lacking) g_lacking.insert(d);
    }
    isa_table(isa);  // checks the level
    g_isa.store(isa);
    hz_active_isa.store(isa);
    g_mv_max.store(mv_max);
    g_configured.store(true, std::memory_order_release);
}

void set_isa(int64_t isa) {
    isa_table(isa);
    g_isa.store(isa);
    hz_active_isa.store(isa);
}

// The hanzo ops with a kernel on the CPU dispatch key (the TORCH_LIBRARY_IMPL block below).
std::vector<std::string> native_ops() {
    std::vector<std::string> out;
    for (int i = 0; i < N_OPS; ++i) {
        auto h = c10::Dispatcher::singleton().findOp({std::string("hanzo::") + kOpNames[i], ""});
        if (h.has_value() && h->hasKernelForDispatchKey(c10::DispatchKey::CPU)) out.push_back(kOpNames[i]);
    }
    return out;
}

}  // namespace dispatch

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "hanzo-torch CPU kernels (int8 dot products over ggml block formats)";
    m.def("mul_mat", [](torch::Tensor x, torch::Tensor w, int64_t tid, int64_t isa, int64_t mv_max) {
        return mul_mat(x, w, tid, isa, mv_max);
    }, "x [M,K] @ W[N,K]^T -> [M,N] f32");
    m.def("mul_mat_group", [](torch::Tensor x, std::vector<torch::Tensor> ws, std::vector<int64_t> tids,
                              std::vector<std::optional<torch::Tensor>> bs, int64_t isa, int64_t mv_max) {
        return mul_mat_group(x, ws, tids, bs, isa, mv_max);
    }, "x @ W_i^T (+ b_i) for several weights, one region -> [M,N_i] f32 each");
    m.def("swiglu_mul_mat", [](torch::Tensor x, torch::Tensor wg, torch::Tensor wu, int64_t tg, int64_t tu, int64_t isa,
                               int64_t mv_max, int64_t round_to) {
        return swiglu_mul_mat(x, wg, wu, tg, tu, isa, mv_max, round_to);
    }, "silu(x Wg^T) * (x Wu^T) -> [M,F] f32");
    m.def("mul_mat_id", &mul_mat_id, "indexed (MoE) mul_mat -> [T,k,N] f32");
    m.def("get_rows", [](torch::Tensor w, torch::Tensor ids, int64_t tid, int64_t isa) {
        return get_rows(w, ids, tid, isa);
    }, "rows of a packed weight -> [n,K] f32");
    m.def("dequantize_rows", &dequantize_rows, "packed [N,rb] -> [N,K] f32");
    m.def("quantize_activation", &quantize_activation, "x [M,K] -> int8 blocks (q, d, sums per 16, d * sums)");
    m.def("set_table", &set_table, "install a constant table (i-quant grid) into its HzTableSlot");
    m.def("supported_isas", &supported_isas, "ISA levels this CPU runs: 0 scalar, 1 avx2, 2 avx512, 3 avx512-sim");
    m.def("isa_built", &isa_built, "whether ISA level l is compiled in (3, avx512-sim: only with the SIMDe headers)");
    m.def("set_gemm_blocking", [](int64_t mc, int64_t kc) {
              TORCH_CHECK(mc >= 1 && kc >= 256 && kc % 256 == 0, "set_gemm_blocking: need mc >= 1 and kc a positive multiple of 256, got ", mc, ", ", kc);
              hz_gemm_mc = mc; hz_gemm_kc = kc;
          }, "GEMM cache blocking: M block (rows), K panel (values) (benchmark knob)", py::arg("mc"), py::arg("kc"));
    m.def("gemm_blocking", []() { return std::make_pair(hz_gemm_mc, hz_gemm_kc); }, "GEMM (M block, K panel)");
    m.def("set_gemm512", [](bool on) { hz_gemm512 = on ? 1 : 0; }, "AVX-512 level: 512-bit GEMM kernels (true) or its 256-bit ones");
    m.def("set_repack", [](bool on) { hz_cpu_repack = on ? 1 : 0; }, "256-bit GEMM of Q4_K and Q6_K on row-interleaved panels (true) or the row tiles");
    m.def("repack", []() { return hz_cpu_repack != 0; }, "whether the 256-bit Q4_K / Q6_K GEMM runs on row-interleaved panels");
    m.def("gemm512", []() { return hz_gemm512 != 0; }, "whether the AVX-512 level's GEMM uses its 512-bit kernels");
    m.def("set_matvec512", [](bool on) { hz_matvec512 = on ? 1 : 0; }, "AVX-512 level: 512-bit Q4_K/Q6_K mat-vec rows (true) or the 256-bit ones");
    m.def("matvec512", []() { return hz_matvec512 != 0; }, "whether the AVX-512 level's Q4_K/Q6_K mat-vec uses its 512-bit rows");
    m.def("set_prefetch_act", [](bool on) { hz_prefetch_act = on ? 1 : 0; }, "Q4_K panel mat-vec of K >= 4096: prefetch the next block's activation into L1 (true) or not");
    m.def("prefetch_act", []() { return hz_prefetch_act != 0; }, "whether the Q4_K panel mat-vec of K >= 4096 prefetches the next block's activation");
    m.def("set_prefetch_panels", [](bool on) { hz_prefetch_panels = on ? 1 : 0; },
          "Q4_K panel mat-vec: software prefetch of the weight panels as the rows have it (true) or none (false)");
    m.def("prefetch_panels", []() { return hz_prefetch_panels != 0; }, "whether the Q4_K panel mat-vec prefetches its weights");
    m.def("set_matvec_gfni", [](bool on) { hz_matvec_gfni = on ? 1 : 0; }, "AVX-512 level: the 512-bit Q6_K rows with GF2P8AFFINEQB where the CPU has it (true) or shifts and masks");
    m.def("set_adaptive_prefetch", [](bool on) { hz_adaptive_prefetch = on ? 1 : 0; },
          "mul_mat's row mat-vec: choose per weight, by measured speed, between the prefetch switches' software "
          "prefetch and none (true) or always the switches' (false)");
    m.def("set_graph_plans", [](bool on) { hz_graph_plans = on ? 1 : 0; },
          "CPU graph mat-vec nodes replay their prepared operands (true) or resolve them at every replay");
    m.def("graph_plans", []() { return hz_graph_plans != 0; }, "whether graph mat-vec nodes replay prepared operands");
    m.def("adaptive_prefetch", []() { return hz_adaptive_prefetch != 0; },
          "whether mul_mat's row mat-vec chooses its software prefetch per weight by measured speed");
    m.def("matvec_gfni", []() { return hz_matvec_gfni != 0; }, "whether the 512-bit Q6_K rows use GF2P8AFFINEQB where the CPU has it");
    m.def("panel_bytes", &panel_bytes, "bytes of the row-interleaved panels of an [N, rb] weight of a ggml type (-1: none)");
    m.def("pack_panels", &pack_panels, "fill out with the row-interleaved panels of w [N, rb] (uint8)");
    m.def("set_panels_of", &set_panels_of, "register filled panels for the mat-vec of weight w");
    m.def("drop_panels_of", &drop_panels_of, "forget the panels registered for weight w");
    m.def("drop_panels_at", &drop_panels_at, "forget the panels registered for the weight whose rows start at this address");
    m.def("panels_of", [](const torch::Tensor& w, int64_t type_id) { return panels_for(w.contiguous(), type_id) != nullptr; },
          "whether the mat-vec of w would read registered panels now");
    m.def("format_has_panels", [](int64_t type_id, int64_t isa_level) {
              const HzIsa* isa = isa_table(isa_level);
              for (int i = 0; i < isa->n_formats; ++i)
                  if (isa->formats[i].type_id == type_id) return isa->formats[i].matvec_panels != nullptr;
              return false;
          }, "whether ISA level l has a panel mat-vec for the ggml type");
    m.def("set_panels", [](bool on) { hz_use_panels.store(on ? 1 : 0); g_panels_gen.fetch_add(1); }, "mat-vec over registered panels (true) or the rows");
    m.def("panels", []() { return hz_use_panels.load() != 0; }, "whether the mat-vec reads registered panels");
    m.def("set_q6k_planes", [](bool on) { hz_use_q6k_planes.store(on ? 1 : 0); g_panels_gen.fetch_add(1); },
          "the avx2 mat-vec of Q6_K over registered planes (true) or the rows");
    m.def("q6k_planes", []() { return hz_use_q6k_planes.load() != 0; }, "whether Q6_K mat-vecs read registered planes");
    m.def("set_prefetch_bytes", [](int64_t l1, int64_t l2) { hz_prefetch_bytes = l1; hz_prefetch_l2_bytes = l2; },
          "mat-vec software prefetch distances into L1 and into L2 (bytes, 0: none)", py::arg("l1"), py::arg("l2"));
    m.def("set_prefetch_l2", [](bool on) { hz_prefetch_l2 = on ? 1 : 0; },
          "mat-vec weight prefetch into L2 at its distance (true) or into L1 at its distance");
    m.def("prefetch_l2", []() { return hz_prefetch_l2 != 0; }, "whether the mat-vec prefetches into L2");
    m.def("set_matvec_chunk_bytes", [](int64_t bytes, int64_t min_per_thread) { hz_mv_chunk_bytes = std::max<int64_t>(1, bytes); hz_mv_min_chunks = std::max<int64_t>(1, min_per_thread); },
          "mat-vec task size of the dynamic row split: bytes of weights per task, minimum tasks per thread (benchmark knob)",
          py::arg("bytes"), py::arg("min_per_thread") = 4);
    m.def("set_ranged_tasks", [](bool on) { hz_ranged_tasks.store(on); },
          "parallel regions: each thread's own contiguous range of tasks first (true) or one shared counter");
    m.def("ranged_tasks", []() { return hz_ranged_tasks.load(); }, "whether parallel regions deal contiguous task ranges");
    m.def("set_adaptive_threads", &hz_set_adaptive_threads,
          "adaptive thread count of the kernels' parallel regions on/off (resets its state); hold times in ns",
          py::arg("enabled"), py::arg("hold_min_ns") = 50'000'000, py::arg("hold_max_ns") = 1'000'000'000);
    m.def("thread_stats", &hz_thread_stats,
          "counters of the kernels' parallel regions: regions (asked for more than one thread), serial_regions "
          "(run serially by the adaptive controller), parallel_regions, losses (parallel regions slower than the "
          "calling thread's serial estimate), holds (switches to serial); state: enabled, serial, hold_ns");
    m.def("region_threads", &hz_region_threads, "testing: the controller's thread count for a region wanting nth threads");
    m.def("report_region", [](int64_t elapsed_ns, int64_t ntasks, int64_t own_tasks, int64_t own_ns) {
              hz_region_report(elapsed_ns, ntasks, own_tasks, own_ns);
          }, "testing: report a parallel region (elapsed_ns, ntasks, own_tasks, own_ns)");
    m.def("configure", &dispatch::configure, "set the formats ({name: type id}), the quantized formats lacking a "
          "kernel, ISA level and "
          "mat-vec row limit of the registered kernels");
    m.def("set_isa", &dispatch::set_isa, "ISA level of the registered kernels: 0 scalar, 1 avx2, 2 avx512, 3 avx512-sim");
    m.def("native_ops", &dispatch::native_ops, "the hanzo ops with a kernel on the CPU dispatch key");
    hz_graph_bind(m);
    m.def("formats", &formats, "(ggml type id, block size, block bytes) of every format with a kernel");
}

TORCH_LIBRARY_IMPL(hanzo, CPU, m) {
    m.impl("mul_mat", TORCH_FN(dispatch::mul_mat_cpu));
    m.impl("mul_mat_id", TORCH_FN(dispatch::mul_mat_id_cpu));
    m.impl("swiglu_mul_mat", TORCH_FN(dispatch::swiglu_mul_mat_cpu));
    m.impl("mul_mat_group", TORCH_FN(dispatch::mul_mat_group_cpu));
    m.impl("get_rows", TORCH_FN(dispatch::get_rows_cpu));
    m.impl("dequantize", TORCH_FN(dispatch::dequantize_cpu));
    m.impl("rms_norm", TORCH_FN(dispatch::rms_norm_cpu));
    m.impl("add_rms_norm", TORCH_FN(dispatch::add_rms_norm_cpu));
    m.impl("qk_norm_rope", TORCH_FN(dispatch::qk_norm_rope_cpu));
    m.impl("swiglu", TORCH_FN(dispatch::swiglu_cpu));
    m.impl("kv_cache_write", TORCH_FN(dispatch::kv_cache_write_cpu));
    m.impl("qk_norm_rope_kv_write", TORCH_FN(dispatch::qk_norm_rope_kv_write_cpu));
    m.impl("attention", TORCH_FN(dispatch::attention_cpu));
    m.impl("moe_route", TORCH_FN(dispatch::moe_route_cpu));
    m.impl("lora_mul_mat", TORCH_FN(dispatch::lora_mul_mat_cpu));
}

// Replaces the custom ops' Python ADInplaceOrView kernels of kv_cache_write and
// qk_norm_rope_kv_write (the loader silences the dispatcher's "overriding a kernel" warning,
// which is expected here).
TORCH_LIBRARY_IMPL(hanzo, ADInplaceOrView, m) {
    m.impl("kv_cache_write", TORCH_FN(dispatch::kv_cache_write_adinplace));
    m.impl("qk_norm_rope_kv_write", TORCH_FN(dispatch::qk_norm_rope_kv_write_adinplace));
}
