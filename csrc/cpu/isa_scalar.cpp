// Portable scalar instantiation of the generic kernels (any CPU; also the forced reference path).
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "hz_api.h"
#define HZ_ISA 0
namespace hz_scalar {
#include "formats.h"
#include "kernels.h"
static const HzIsa isa = {"scalar", HZ_QUANT, hz_format_table, (int)(sizeof(hz_format_table) / sizeof(hz_format_table[0]))};
}  // namespace hz_scalar
extern "C" const HzIsa* hz_isa_scalar() { return &hz_scalar::isa; }
