// The adaptive thread count of the CPU kernels' parallel regions (the controller of threading.h):
// its state, the two calls every region makes (hz_region_threads, hz_region_report), and the
// switch and counters the Python side reads (hz_set_adaptive_threads, hz_thread_stats).
#include "threading.h"

#include <c10/util/Exception.h>

#include <mutex>

// Every parallel region reports whether it was a loss (slower than its calling thread's estimate
// of running all its tasks alone). kTrip losses among the last kWindow parallel regions switch the
// regions to serial for the hold time, provided those kWindow regions together took longer than
// their serial estimates: a few regions delayed by a short-lived co-runner (a server's HTTP thread,
// the tokenizer) do not outweigh the time the parallel regions around them saved. Then the next
// regions run parallel as a probe, and a trip among the probe's kWindow regions doubles the hold
// (up to hold_max), while a probe without one resets it to hold_min. The state is shared by all kernels and guarded by one mutex (one uncontended lock
// per region, against tens of microseconds of work).
std::atomic<bool> hz_ranged_tasks{true};

namespace {
constexpr int kWindow = 16, kTrip = 4;

struct HzThreads {
    std::mutex mu;
    std::atomic<bool> enabled{true};
    int64_t hold_min = 50'000'000, hold_max = 1'000'000'000;  // ns
    bool serial = false;     // regions run serially until hold_until
    int64_t hold_until = 0;  // steady-clock ns
    int64_t hold = 50'000'000;
    bool probing = false;
    int probe_seen = 0;
    uint32_t window = 0;     // outcomes of the last kWindow parallel regions, bit set = loss
    // wall time and serial estimate of the same regions (ns), a ring indexed by at, and their sums
    int64_t wall[kWindow] = {}, est[kWindow] = {};
    int at = 0;
    int64_t wall_sum = 0, est_sum = 0;
    std::atomic<int64_t> regions{0}, serial_regions{0}, parallel_regions{0}, losses{0}, holds{0};
    std::atomic<int64_t> start_skew_ns{0}, tail_ns{0};  // summed over parallel regions

    void reset() {  // with mu held
        serial = probing = false;
        hold = hold_min;
        probe_seen = 0;
        clear_window();
    }
    void clear_window() {  // with mu held
        window = 0;
        for (int i = 0; i < kWindow; ++i) wall[i] = est[i] = 0;
        at = 0;
        wall_sum = est_sum = 0;
    }
    void push(bool loss, int64_t w, int64_t e) {  // with mu held
        window = ((window << 1) | (loss ? 1u : 0u)) & ((1u << kWindow) - 1);
        wall_sum += w - wall[at];
        est_sum += e - est[at];
        wall[at] = w;
        est[at] = e;
        at = (at + 1) % kWindow;
    }
};

HzThreads& hz_threads() {
    static HzThreads t;
    return t;
}
}  // namespace

int64_t hz_region_threads(int64_t nth) {
    HzThreads& t = hz_threads();
    t.regions.fetch_add(1, std::memory_order_relaxed);
    if (!t.enabled.load(std::memory_order_relaxed)) return nth;
    std::lock_guard<std::mutex> lock(t.mu);
    if (t.serial) {
        if (hz_now_ns() < t.hold_until) {
            t.serial_regions.fetch_add(1, std::memory_order_relaxed);
            return 1;
        }
        t.serial = false;
        t.probing = true;
        t.probe_seen = 0;
        t.clear_window();
    }
    return nth;
}

void hz_region_report(int64_t elapsed_ns, int64_t ntasks, int64_t own_tasks, int64_t own_ns, int64_t start_skew_ns,
                      int64_t tail_ns) {
    HzThreads& t = hz_threads();
    t.parallel_regions.fetch_add(1, std::memory_order_relaxed);
    t.start_skew_ns.fetch_add(start_skew_ns, std::memory_order_relaxed);
    t.tail_ns.fetch_add(tail_ns, std::memory_order_relaxed);
    // serial estimate: ntasks * own_ns / own_tasks (none when the calling thread ran no task: the
    // other threads did the work, so the region was no loss, and it counts as its own wall time)
    const bool loss = own_tasks > 0 && elapsed_ns * own_tasks > own_ns * ntasks;
    const int64_t est = own_tasks > 0 ? own_ns * ntasks / own_tasks : elapsed_ns;
    if (loss) t.losses.fetch_add(1, std::memory_order_relaxed);
    if (!t.enabled.load(std::memory_order_relaxed)) return;
    std::lock_guard<std::mutex> lock(t.mu);
    if (t.serial) return;  // a region that started before the switch
    t.push(loss, elapsed_ns, est);
    if (__builtin_popcount(t.window) >= kTrip && t.wall_sum > t.est_sum) {
        if (t.probing) t.hold = std::min(2 * t.hold, t.hold_max);
        t.serial = true;
        t.probing = false;
        t.clear_window();
        t.hold_until = hz_now_ns() + t.hold;
        t.holds.fetch_add(1, std::memory_order_relaxed);
    } else if (t.probing && ++t.probe_seen >= kWindow) {
        t.probing = false;
        t.hold = t.hold_min;
    }
}

void hz_set_adaptive_threads(bool enabled, int64_t hold_min_ns, int64_t hold_max_ns) {
    TORCH_CHECK(hold_min_ns >= 0 && hold_max_ns >= hold_min_ns,
                "set_adaptive_threads: need 0 <= hold_min_ns <= hold_max_ns, got ", hold_min_ns, ", ", hold_max_ns);
    HzThreads& t = hz_threads();
    std::lock_guard<std::mutex> lock(t.mu);
    t.hold_min = hold_min_ns;
    t.hold_max = hold_max_ns;
    t.reset();
    t.enabled.store(enabled);
}

std::map<std::string, int64_t> hz_thread_stats() {
    HzThreads& t = hz_threads();
    std::lock_guard<std::mutex> lock(t.mu);
    return std::map<std::string, int64_t>{
        {"enabled", t.enabled.load()}, {"serial", t.serial}, {"hold_ns", t.hold},
        {"regions", t.regions.load()}, {"serial_regions", t.serial_regions.load()},
        {"parallel_regions", t.parallel_regions.load()}, {"losses", t.losses.load()},
        {"holds", t.holds.load()}, {"start_skew_ns", t.start_skew_ns.load()}, {"tail_ns", t.tail_ns.load()}};
}
