// AVX-512 (VL/BW) + VNNI instantiation on 256-bit vectors: vpdpwssd fuses the scale multiply
// and accumulate of the int8 dot, and 32 vector registers allow a 4x3 GEMM register tile
// (HZ_GEMM_MR x HZ_GEMM_NR, kernels_gemm.h; AVX2: 3x3). This unit compiles everywhere but runs only
// where the CPU reports avx512f/bw/vl/dq/vnni; isa_avx512_sim.cpp builds the same source with SIMDe's
// AVX-512 intrinsics, so that its logic is tested on AVX2 CPUs too.
#pragma GCC target("avx2,fma,f16c,bmi2,popcnt,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "hz_api.h"
#define HZ_ISA 2
namespace hz_avx512 {
#include "formats.h"
#include "kernels.h"
static const HzIsa isa = {"avx512", HZ_QUANT, hz_format_table, (int)(sizeof(hz_format_table) / sizeof(hz_format_table[0]))};
}  // namespace hz_avx512
extern "C" const HzIsa* hz_isa_avx512() { return &hz_avx512::isa; }
