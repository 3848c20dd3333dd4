// Parallel regions of the CPU kernels (ops.cpp, fused.cpp) and the adaptive thread count.
//
// A region is one at::parallel_for (an OpenMP fork-join in torch's CPU build) whose threads take
// their own contiguous range of tasks first, then the others' (hz_run_tasks), so a thread that runs
// late delays only the task it holds. The join still waits for every thread of the pool, including one the OS has descheduled
// before it arrived: on a machine whose cores are busy with other processes, such waits can make
// a parallel region slower than the same tasks run by the calling thread alone.
//
// The adaptive controller (HzThreads in threading.cpp) watches each region: the calling thread times its
// own tasks, which estimates the serial time (tasks x its mean task time); a region that took
// longer than that estimate is a "loss". When losses are frequent the next regions run serially
// (no fork) for a hold time, then a few regions run parallel again as a probe; a failed probe
// doubles the hold. Results never depend on it: every kernel's split is fixed by its shapes, not
// by the thread count, so serial and parallel runs give identical bits.
// Off switch: set_adaptive_threads(false) (HANZO_CPU_ADAPTIVE_THREADS=0 on the Python side).
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <string>

inline int64_t hz_now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

// Threads for a region that wants nth > 1 threads: nth, or 1 while the controller holds regions
// serial. Counts the region.
int64_t hz_region_threads(int64_t nth);
// Outcome of a parallel region: its wall time, the tasks in all, and the tasks the calling thread
// ran with the time it spent running them.
// start_skew_ns / tail_ns: the last thread's start after the first's, and its finish after the
// first finish (the time one thread of the region had no task), summed into hz_thread_stats.
void hz_region_report(int64_t elapsed_ns, int64_t ntasks, int64_t own_tasks, int64_t own_ns,
                      int64_t start_skew_ns = 0, int64_t tail_ns = 0);
// The controller on/off (resets its state), with its shortest and longest serial hold in ns.
void hz_set_adaptive_threads(bool enabled, int64_t hold_min_ns, int64_t hold_max_ns);
// Its counters (regions, serial_regions, parallel_regions, losses, holds) and state (enabled,
// serial, hold_ns).
std::map<std::string, int64_t> hz_thread_stats();

// Tasks of a region: thread c owns the contiguous range [c * n / nth, (c + 1) * n / nth) and takes
// its tasks from the front; a thread whose range is empty takes the others' from their back. So
// each thread's tasks are neighbours in memory (a mat-vec thread streams one run of weight rows:
// its prefetches past a task's end fetch its own next task), while a thread that runs late still delays only the task it holds
// (the others take the rest of its range). One 64-bit word per range packs [lo, hi).
// Measured (2 threads, Zen 4, 1 GiB read in huge pages): one contiguous half per thread 52-58
// GB/s against 48-53 GB/s for 256 KiB pieces taken in turn, in the box's fast minutes.
struct alignas(64) HzTaskRange {
    std::atomic<uint64_t> v;
};
constexpr int64_t kHzMaxRanges = 64;  // more threads share one counter instead
// false: every thread takes the next index from one shared counter (set_ranged_tasks, for A/B).
extern std::atomic<bool> hz_ranged_tasks;

inline bool hz_take(HzTaskRange& r, bool front, int64_t& i) {
    uint64_t v = r.v.load(std::memory_order_relaxed);
    for (;;) {
        const uint64_t lo = v & 0xffffffffu, hi = v >> 32;
        if (lo >= hi) return false;
        const uint64_t next = front ? ((hi << 32) | (lo + 1)) : (((hi - 1) << 32) | lo);
        if (r.v.compare_exchange_weak(v, next, std::memory_order_relaxed)) {
            i = (int64_t)(front ? lo : hi - 1);
            return true;
        }
    }
}

// Runs task(i) for i in [0, n) on up to nth threads (nth <= 1: inline, no region), each thread
// taking its tasks as HzTaskRange says (more than kHzMaxRanges threads, 2^32 tasks or more, or
// set_ranged_tasks(false): the next index from one shared counter). task must not depend on which thread runs it.
template <class F>
void hz_run_tasks(int64_t n, int64_t nth, const F& task) {
    if (n <= 0) return;
    nth = std::min(nth, n);
    if (nth > 1 && !at::in_parallel_region()) nth = hz_region_threads(nth);
    else nth = 1;
    if (nth <= 1) {
        for (int64_t i = 0; i < n; ++i) task(i);
        return;
    }
    const bool ranged = nth <= kHzMaxRanges && n < (int64_t(1) << 32) && hz_ranged_tasks.load(std::memory_order_relaxed);
    HzTaskRange ranges[kHzMaxRanges];
    if (ranged)
        for (int64_t c = 0; c < nth; ++c)
            ranges[c].v.store((uint64_t)((c + 1) * n / nth) << 32 | (uint64_t)(c * n / nth), std::memory_order_relaxed);
    std::atomic<int64_t> next{0};
    int64_t own_tasks = 0, own_ns = 0;
    // each range's start and finish (-1: no chunk of at::parallel_for began at that index)
    int64_t began[kHzMaxRanges], ended[kHzMaxRanges];
    const bool timed = nth <= kHzMaxRanges;
    if (timed) std::fill(began, began + nth, int64_t(-1));
    const int64_t t0 = hz_now_ns();
    at::parallel_for(0, nth, 1, [&](int64_t c, int64_t) {
        // chunk 0 of at::parallel_for runs on the calling thread (OpenMP's master)
        const int64_t s = hz_now_ns();
        if (timed) began[c] = s;
        int64_t k = 0, i;
        if (ranged) {
            while (hz_take(ranges[c], true, i)) { task(i); ++k; }
            for (int64_t d = 1; d < nth; ++d)
                while (hz_take(ranges[(c + d) % nth], false, i)) { task(i); ++k; }
        } else {
            for (; (i = next.fetch_add(1)) < n; ++k) task(i);
        }
        const int64_t e = hz_now_ns();
        if (timed) ended[c] = e;
        if (c == 0) {
            own_tasks = k;
            own_ns = e - s;
        }
    });
    int64_t skew = 0, tail = 0;
    if (timed) {
        int64_t s0 = INT64_MAX, s1 = 0, e0 = INT64_MAX, e1 = 0;
        for (int64_t c = 0; c < nth; ++c)
            if (began[c] >= 0) {
                s0 = std::min(s0, began[c]); s1 = std::max(s1, began[c]);
                e0 = std::min(e0, ended[c]); e1 = std::max(e1, ended[c]);
            }
        if (s1 >= s0) {
            skew = s1 - s0;
            tail = e1 - e0;
        }
    }
    hz_region_report(hz_now_ns() - t0, n, own_tasks, own_ns, skew, tail);
}
