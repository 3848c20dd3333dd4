// The Metal Shading Language subset of the generated kernels, as C++17 for the CPU harness
// (hanzo_torch/backends/mps/sim): address-space qualifiers as empty macros, vector types with
// component members, half as _Float16, as_type, the math, bit and atomic built-ins the
// translations call, and the dispatch runtime (one threadgroup at a time, its threads as
// ucontext fibers that switch at threadgroup_barrier; buffers end at a PROT_NONE page, so a read or
// write past a buffer's end faults and the dispatch reports it).
#pragma once
#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;

#define kernel
#define device
#define constant
#define thread
#define threadgroup

namespace metal {

template <class T, int N> struct vec;
template <class T> struct vec<T, 2> {
  T x, y;
  vec() = default;
  explicit vec(T s) : x(s), y(s) {}
  vec(T a, T b) : x(a), y(b) {}
  template <class U> explicit vec(const vec<U, 2>& o) : x(T(o.x)), y(T(o.y)) {}
  T& operator[](int i) { return (&x)[i]; }
  T operator[](int i) const { return (&x)[i]; }
};
template <class T> struct vec<T, 3> {
  T x, y, z;
  vec() = default;
  explicit vec(T s) : x(s), y(s), z(s) {}
  vec(T a, T b, T c) : x(a), y(b), z(c) {}
  template <class U> explicit vec(const vec<U, 3>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)) {}
  T& operator[](int i) { return (&x)[i]; }
  T operator[](int i) const { return (&x)[i]; }
};
template <class T> struct vec<T, 4> {
  T x, y, z, w;
  vec() = default;
  explicit vec(T s) : x(s), y(s), z(s), w(s) {}
  vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  template <class U> explicit vec(const vec<U, 4>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)), w(T(o.w)) {}
  T& operator[](int i) { return (&x)[i]; }
  T operator[](int i) const { return (&x)[i]; }
};
template <class T, int C, int R> struct matrix { vec<T, R> c[C]; };

#define HZ_VEC(T) typedef vec<T, 2> T##2; typedef vec<T, 3> T##3; typedef vec<T, 4> T##4;
HZ_VEC(float) HZ_VEC(half) HZ_VEC(uint) HZ_VEC(int) HZ_VEC(ushort) HZ_VEC(short) HZ_VEC(uchar) HZ_VEC(char) HZ_VEC(bool)
#undef HZ_VEC

template <class To, class From> inline To as_type(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  To t;
  std::memcpy(&t, &f, sizeof(To));
  return t;
}

template <class T> inline T fma(T a, T b, T c) { return std::fma(a, b, c); }
template <class T> inline T min(T a, T b) { return b < a ? b : a; }
template <class T> inline T max(T a, T b) { return a < b ? b : a; }
template <class T> inline T clamp(T v, T lo, T hi) { return min(max(v, lo), hi); }
template <class T> inline T abs(T a) { return a < T(0) ? -a : a; }
inline float abs(float a) { return std::fabs(a); }
template <class T> inline T sign(T a) { return a > T(0) ? T(1) : a < T(0) ? T(-1) : a; }
inline float rint(float a) { return std::rint(a); }
inline float trunc(float a) { return std::trunc(a); }
inline float floor(float a) { return std::floor(a); }
inline float ceil(float a) { return std::ceil(a); }
inline float sqrt(float a) { return std::sqrt(a); }
inline float rsqrt(float a) { return 1.0f / std::sqrt(a); }
inline float exp(float a) { return std::exp(a); }
inline float exp2(float a) { return std::exp2(a); }
inline float log(float a) { return std::log(a); }
inline float sin(float a) { return std::sin(a); }
inline float cos(float a) { return std::cos(a); }
inline bool isnan(float a) { return std::isnan(a); }
inline bool isinf(float a) { return std::isinf(a); }
namespace fast { using metal::max; using metal::min; using metal::clamp; using metal::exp; using metal::sqrt; using metal::rsqrt; }
namespace precise { using metal::max; using metal::min; using metal::clamp; using metal::exp; using metal::sqrt; using metal::rsqrt; }

inline int extract_bits(int x, uint off, uint bits) {
  if (bits == 0) return 0;
  if (bits >= 32) return x;
  return int(uint(x) << (32u - off - bits)) >> (32 - int(bits));
}
inline uint extract_bits(uint x, uint off, uint bits) {
  if (bits == 0) return 0;
  if (bits >= 32) return x;
  return (x >> off) & ((1u << bits) - 1u);
}

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
enum memory_order { memory_order_relaxed };
struct atomic_uint { uint v; };
struct atomic_int { int v; };
// the threads of a threadgroup are fibers switched only at barriers: a read-modify-write is atomic
inline uint atomic_fetch_add_explicit(atomic_uint* a, uint v, memory_order) { uint o = a->v; a->v += v; return o; }
inline int atomic_fetch_add_explicit(atomic_int* a, int v, memory_order) { int o = a->v; a->v += v; return o; }
inline uint atomic_fetch_max_explicit(atomic_uint* a, uint v, memory_order) { uint o = a->v; if (v > o) a->v = v; return o; }
inline uint atomic_fetch_add_explicit(volatile atomic_uint* a, uint v, memory_order) { uint o = a->v; a->v = o + v; return o; }
inline int atomic_fetch_add_explicit(volatile atomic_int* a, int v, memory_order) { int o = a->v; a->v = o + v; return o; }

void threadgroup_barrier(mem_flags);

}  // namespace metal

namespace hzsim {

typedef metal::vec<uint, 3> u3;

struct Grid {
  uint groups[3];  // threadgroups per grid
  uint local[3];   // threads per threadgroup
};

struct Ids {
  u3 thread_position_in_grid, threadgroup_position_in_grid, threadgroups_per_grid, thread_position_in_threadgroup;
};

constexpr size_t kStack = 256 * 1024;
constexpr int kMaxThreads = 1024;

// A fiber starts on its own stack through ucontext (makecontext/setcontext: one signal-mask
// system call per fiber and threadgroup) and then switches with _setjmp/_longjmp, which leave the
// signal mask alone (swapcontext makes two system calls per switch).
struct Fiber {
  ucontext_t ctx;
  jmp_buf jb;
  int state;  // 0 running, 1 at a barrier, 2 done
  bool started;
};

struct State {
  jmp_buf main;
  Fiber* fibers = nullptr;
  char* stacks = nullptr;
  int current = -1;
  bool fibered = false;
  sigjmp_buf fault_jmp;
  volatile sig_atomic_t faulted = 0;
  void* fault_addr = nullptr;
  const char* error = nullptr;
  void (*body)(void*, const Ids&) = nullptr;
  void* closure = nullptr;
  Ids ids[kMaxThreads];
};

inline State& state() {
  static State s;
  return s;
}

inline void fiber_main(int i) {
  State& s = state();
  s.body(s.closure, s.ids[i]);
  s.fibers[i].state = 2;
  _longjmp(s.main, 1);
}

inline void on_fault(int, siginfo_t* info, void*) {
  State& s = state();
  s.fault_addr = info->si_addr;
  s.faulted = 1;
  siglongjmp(s.fault_jmp, 1);
}

// Run every threadgroup of grid g; 0 on success, else an error (message in err).
template <class F>
inline int dispatch(const Grid& g, F& f, bool barriers, char* err, size_t errlen) {
  State& s = state();
  const uint L = g.local[0] * g.local[1] * g.local[2];
  if (L == 0 || L > (uint)kMaxThreads) {
    std::snprintf(err, errlen, "threadgroup of %u threads (1..%d)", L, kMaxThreads);
    return 1;
  }
  s.body = [](void* c, const Ids& ids) { (*static_cast<F*>(c))(ids); };
  s.closure = &f;
  s.error = nullptr;
  if (barriers && s.fibers == nullptr) {
    s.fibers = new Fiber[kMaxThreads];
    for (int f = 0; f < kMaxThreads; ++f) getcontext(&s.fibers[f].ctx);
    s.stacks = static_cast<char*>(mmap(nullptr, kStack * kMaxThreads, PROT_READ | PROT_WRITE,
                                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  }
  struct sigaction sa, old_segv, old_bus;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigaction(SIGSEGV, &sa, &old_segv);
  sigaction(SIGBUS, &sa, &old_bus);
  s.faulted = 0;
  int rc = 0;
  if (sigsetjmp(s.fault_jmp, 1) == 0) {
    const u3 ng(g.groups[0], g.groups[1], g.groups[2]);
    for (uint gz = 0; gz < g.groups[2] && rc == 0; ++gz)
      for (uint gy = 0; gy < g.groups[1] && rc == 0; ++gy)
        for (uint gx = 0; gx < g.groups[0] && rc == 0; ++gx) {
          const u3 tg(gx, gy, gz);
          uint i = 0;
          for (uint lz = 0; lz < g.local[2]; ++lz)
            for (uint ly = 0; ly < g.local[1]; ++ly)
              for (uint lx = 0; lx < g.local[0]; ++lx, ++i) {
                Ids& t = s.ids[i];
                t.thread_position_in_threadgroup = u3(lx, ly, lz);
                t.threadgroup_position_in_grid = tg;
                t.threadgroups_per_grid = ng;
                t.thread_position_in_grid = u3(gx * g.local[0] + lx, gy * g.local[1] + ly, gz * g.local[2] + lz);
              }
          if (!barriers) {
            s.fibered = false;
            for (i = 0; i < L; ++i) s.body(s.closure, s.ids[i]);
            continue;
          }
          s.fibered = true;
          for (i = 0; i < L; ++i) {
            s.fibers[i].ctx.uc_stack.ss_sp = s.stacks + kStack * i;
            s.fibers[i].ctx.uc_stack.ss_size = kStack;
            s.fibers[i].ctx.uc_link = nullptr;
            s.fibers[i].state = 0;
            s.fibers[i].started = false;
            makecontext(&s.fibers[i].ctx, (void (*)())fiber_main, 1, (int)i);
          }
          // rounds: every live thread runs to its next barrier or its end; a barrier that some
          // threads of the group wait at while others ended is an error (divergent barrier)
          for (;;) {
            uint waiting = 0, done = 0;
            for (i = 0; i < L; ++i) {
              if (s.fibers[i].state == 2) continue;
              s.current = (int)i;
              s.fibers[i].state = 0;
              if (_setjmp(s.main) == 0) {
                if (!s.fibers[i].started) {
                  s.fibers[i].started = true;
                  setcontext(&s.fibers[i].ctx);
                }
                _longjmp(s.fibers[i].jb, 1);
              }
              if (s.error) break;
            }
            s.current = -1;
            if (s.error) { std::snprintf(err, errlen, "%s", s.error); rc = 1; break; }
            for (i = 0; i < L; ++i) (s.fibers[i].state == 2 ? done : waiting) += 1;
            if (waiting == 0) break;
            if (done != 0) {
              std::snprintf(err, errlen, "threadgroup (%u,%u,%u): %u threads wait at a barrier that %u ended before",
                            gx, gy, gz, waiting, done);
              rc = 1;
              break;
            }
          }
        }
  } else {
    std::snprintf(err, errlen, "out-of-bounds access at address %p (a guard page after a buffer)", s.fault_addr);
    rc = 2;
  }
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  s.current = -1;
  return rc;
}

}  // namespace hzsim

inline void metal::threadgroup_barrier(mem_flags) {
  hzsim::State& s = hzsim::state();
  if (!s.fibered || s.current < 0) {
    s.error = "threadgroup_barrier in a kernel dispatched without fibers";
    return;
  }
  const int i = s.current;
  s.fibers[i].state = 1;
  if (_setjmp(s.fibers[i].jb) == 0) _longjmp(s.main, 1);
}

// Guarded buffers: n bytes whose end touches a PROT_NONE page (a read or write past the end
// faults); the start is 16-byte aligned when n is a multiple of 16.
extern "C" __attribute__((visibility("default"))) void* hz_sim_alloc(size_t n) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  const size_t data = (n + page - 1) / page * page;
  char* base = static_cast<char*>(mmap(nullptr, data + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (base == MAP_FAILED) return nullptr;
  mprotect(base + data, page, PROT_NONE);
  return base + data - n;
}
extern "C" __attribute__((visibility("default"))) void hz_sim_free(void* p, size_t n) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  const size_t data = (n + page - 1) / page * page;
  char* base = static_cast<char*>(p) + n - data;
  munmap(base, data + page);
}
