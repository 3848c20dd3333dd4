// The AVX-512 instantiation again (HZ_ISA 2, the same formats.h / kernels.h as isa_avx512.cpp),
// compiled for AVX2 + FMA + F16C only, with every AVX-512 intrinsic the kernels name resolved to
// SIMDe's portable implementation (https://github.com/simd-everywhere/simde, Debian libsimde-dev).
// It runs on any AVX2 CPU, so the logic of the AVX-512 source is tested where no AVX-512 CPU is
// at hand; it says nothing about the speed or the code generation of the native build.
// Without the SIMDe headers this unit builds to a stub (hz_isa_avx512_sim() returns null) and
// the level is not offered.
#pragma GCC target("avx2,fma,f16c,bmi2,popcnt")
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "hz_api.h"

#if defined(__has_include)
#if __has_include(<simde/x86/avx512.h>)
#define HZ_HAVE_SIMDE 1
#endif
#endif

#ifdef HZ_HAVE_SIMDE
// GCC's C++ front end does not define __AVX2__/__FMA__/__F16C__ for a target pragma, so SIMDe
// would take AVX2 itself for absent and emulate it too: declare the instruction sets of the
// pragma native, so that SIMDe's aliases (the _mm*_ names mapped to simde_mm*_) cover the
// AVX-512 names only and everything else is GCC's own intrinsic, as in isa_avx2.cpp. GCC's
// __m512i types are reused (immintrin.h comes first); an AVX-512 name SIMDe lacks still reaches
// GCC's always_inline definition and fails to compile ("target specific option mismatch").
#define SIMDE_X86_AVX2_NATIVE
#define SIMDE_X86_FMA_NATIVE
#define SIMDE_X86_F16C_NATIVE
#define SIMDE_ENABLE_NATIVE_ALIASES
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // 512-bit vector arguments of inline functions without AVX-512
#include <simde/x86/avx512.h>
#if __has_include(<simde/x86/gfni.h>)
#include <simde/x86/gfni.h>
#define HZ_SIM_GFNI 1  // else the Q6_K rows' GF2P8AFFINEQB variant is left out of this level
#endif
// An AVX-512F name SIMDe 0.7.4 lacks, from two 256-bit halves (same results: lane-wise conversion).
static inline __m512 hz_sim_cvtepi32_ps(__m512i a) {
    const __m256 lo = _mm256_cvtepi32_ps(_mm512_castsi512_si256(a));
    const __m256 hi = _mm256_cvtepi32_ps(_mm512_extracti64x4_epi64(a, 1));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
#define _mm512_cvtepi32_ps(a) hz_sim_cvtepi32_ps(a)
#define HZ_ISA 2
namespace hz_avx512_sim {
#include "formats.h"
#include "kernels.h"
static const HzIsa isa = {"avx512-sim", HZ_QUANT, hz_format_table, (int)(sizeof(hz_format_table) / sizeof(hz_format_table[0]))};
}  // namespace hz_avx512_sim
#pragma GCC diagnostic pop
extern "C" const HzIsa* hz_isa_avx512_sim() { return &hz_avx512_sim::isa; }
#else
extern "C" const HzIsa* hz_isa_avx512_sim() { return nullptr; }
#endif
