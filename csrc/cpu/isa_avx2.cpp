// AVX2 + FMA + F16C instantiation. The target pragma applies to this translation unit only,
// which includes no torch/STL headers; ops.cpp calls it only when the CPU reports AVX2/FMA/F16C.
#pragma GCC target("avx2,fma,f16c,bmi2,popcnt")
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "hz_api.h"
#define HZ_ISA 1
namespace hz_avx2 {
#include "formats.h"
#include "kernels.h"
static const HzIsa isa = {"avx2", HZ_QUANT, hz_format_table, (int)(sizeof(hz_format_table) / sizeof(hz_format_table[0]))};
}  // namespace hz_avx2
extern "C" const HzIsa* hz_isa_avx2() { return &hz_avx2::isa; }
