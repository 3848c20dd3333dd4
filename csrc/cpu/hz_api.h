// Plain C++ interface between the torch binding (ops.cpp) and the per-ISA kernel translation
// units (isa_*.cpp). The ISA units include no torch or STL headers, so nothing compiled with
// AVX2/AVX-512 code generation can leak into shared inline functions (ODR safety).
#pragma once
#include <stdint.h>
#ifdef __cplusplus
#include <atomic>
#endif

#include "ggml_blocks.h"  // block structs, type ids and table slots, generated from the format registry

// Q4_K / Q5_K 6-bit scales and mins: 12 bytes -> 8 scales, 8 mins (ggml get_scale_min_k4); the
// formats' unpacking (formats.h) and the Q4_K panel packing (ops.cpp) share it.
static inline void kquant_scales_6bit(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
    for (int j = 0; j < 4; ++j) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 0x0f) | ((s[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

// An activation quantized to int8: row m holds q[m*K .. m*K+K), one float scale per qa values
// (qa = the weight format's block size: 32, 128 for Q1_0, 256 for the K-quant style formats) and one int16
// sum of q per 16 values.
struct HzAct {
    const int8_t* q;
    const float* d;
    const int16_t* s;
    const float* sf;  // d * s as float, [M][K/16] (the min terms of the GEMM use it)
    int64_t K;
    int64_t qa;
    // 1: the mat-vec kernels skip their software prefetch of the weight stream in this call (the
    // per-weight choice of ops.cpp's adaptive prefetch); the same bits either way.
    int32_t no_prefetch = 0;
};

// y[m*ldy + n] = sum_k x[m,k] * W[n,k] for n in [n0, n1), m in [0, M).
typedef void (*hz_matmul_fn)(const uint8_t* W, int64_t row_bytes, int64_t n0, int64_t n1,
                             const HzAct* a, int64_t M, float* y, int64_t ldy);
// Weights stored as row-interleaved panels (kernels_panels.h): rows [n0, n1) of the panels P of a
// weight of K values per row, y[m*ldy + n - n0] for m in [0, M).
typedef void (*hz_panel_fn)(const uint8_t* P, int64_t K, int64_t n0, int64_t n1, const HzAct* a, int64_t M,
                            float* y, int64_t ldy);
// Bytes of one Q4_K panel block: 8 rows x 256 values (layout in kernels_panels.h).
#define HZ_Q4K_PANEL_BYTES 1184
#define HZ_Q4K_PANEL_SC 0     // 6-bit scales, decoded: byte 8s + r
#define HZ_Q4K_PANEL_MN 64    // 6-bit mins, decoded: byte 16q + 2r + e = min of sub-block 2q + e
#define HZ_Q4K_PANEL_D 128    // d of rows 0..7 (fp16)
#define HZ_Q4K_PANEL_DM 144   // dmin of rows 0..7 (fp16)
#define HZ_Q4K_PANEL_QS 160   // qs, 1024 bytes
// Bytes of the three planes of one 128-value half of a Q6_K planes block (layout in kernels_panels.h).
#define HZ_Q6K_PLANES_HALF 96
// One packed row of K values -> float32.
typedef void (*hz_dequant_fn)(const uint8_t* row, int64_t K, float* out);
// Rows [0, M) of x (f32, row stride K) -> int8 activation blocks of qa values.
typedef void (*hz_quant_fn)(const float* x, int64_t M, int64_t K, int64_t qa, int8_t* q, float* d, int16_t* s, float* sf);

struct HzFormatKernels {
    int type_id, qk, bytes;
    hz_matmul_fn matvec;  // small M: reads each weight block once per 4 activation rows
    hz_matmul_fn gemm;    // large M: unpacks weight tiles once, register-blocked int8 tiles
    hz_dequant_fn dequant_row;
    int gemm_nr;          // weight rows per GEMM register tile (thread chunks are multiples of it)
    int table;            // HzTableSlot the format reads (hz_tables), -1 if none
    hz_panel_fn matvec_panels;  // small M over the format's panels; null: the format has none here
};
struct HzIsa {
    const char* name;
    hz_quant_fn quantize;
    const HzFormatKernels* formats;
    int n_formats;
};

extern "C" {
const HzIsa* hz_isa_scalar();
const HzIsa* hz_isa_avx2();
const HzIsa* hz_isa_avx512();
// The AVX-512 kernels built for AVX2 with SIMDe's AVX-512 intrinsics (isa_avx512_sim.cpp); null when
// the extension was built without the SIMDe headers.
const HzIsa* hz_isa_avx512_sim();
// Constant tables by HzTableSlot (the i-quant codebook grids, int8 rows), installed from the
// format registry (set_table) before use.
extern const int8_t* hz_tables[HZ_N_TABLES];
// Software prefetch of the mat-vec weight stream (hz_prefetch_stream in kernels.h, measurements
// in ops.cpp): on the SIMD levels with hz_prefetch_l2 on, into L2 only, hz_prefetch_l2_bytes
// ahead; otherwise into L1, hz_prefetch_bytes ahead.
extern int64_t hz_prefetch_bytes, hz_prefetch_l2_bytes;
extern int hz_prefetch_l2;
// 1: the AVX-512 level's GEMM uses its 512-bit kernels (kernels_gemm512.h); 0: its 256-bit ones.
extern int hz_gemm512;
// 1: the AVX-512 level's M = 1 mat-vec of Q4_K and Q6_K uses its 512-bit rows (kernels_matvec.h);
// 0: the 256-bit rows of the other levels. Same bits either way.
extern int hz_matvec512;
// 1: those 512-bit Q6_K rows assemble the six-bit values with GF2P8AFFINEQB where the CPU reports
// gfni (always on avx512-sim, through SIMDe); 0: shifts and masks. Same bits. HANZO_CPU_GFNI.
extern int hz_matvec_gfni;
// 1: mul_mat's row mat-vec chooses per weight, by measured speed, between the software prefetch the
// switches above give and none (ops.cpp, PrefetchChoice); 0: always the switches' prefetch.
extern int hz_adaptive_prefetch;
// 1: the Q4_K panel mat-vec of K >= 4096 prefetches each next block's activation into L1
// (kernels_panels.h); 0: it does not. Same bits. HANZO_CPU_PREFETCH_ACT.
extern int hz_prefetch_act;
// 1: the Q4_K panel mat-vec prefetches its weight stream as the rows do (hz_prefetch_stream);
// 0 (the default): it leaves the panels to the hardware prefetchers. Same bits.
// HANZO_CPU_PREFETCH_PANELS.
extern int hz_prefetch_panels;
// 1: the 256-bit GEMM of Q4_K and Q6_K repacks each weight panel into rows interleaved 8 at a
// time (gemm_il_q4k, gemm_il_q6k, kernels_gemm.h); 0: the row tiles. HANZO_CPU_REPACK.
extern int hz_cpu_repack;
// GEMM cache blocking: K panel in values (a multiple of 256) and M block in rows (see ops.cpp).
extern int64_t hz_gemm_kc, hz_gemm_mc;
}

#ifdef __cplusplus
// The instruction set the registered kernels use (0 scalar, 1 avx2, 2 avx512, 3 avx512-sim), set by ops.cpp's
// configure/set_isa; the fused kernels (fused.cpp) pick their loops by it.
extern std::atomic<int64_t> hz_active_isa;
// silu(g[i]) * u[i] -> y[i] for i < n, float32 (fused.cpp): the SwiGLU product of hanzo_cpu::swiglu and of
// swiglu_mul_mat's epilogue, one function so that both give the same bits. y may be g or u.
void hz_silu_mul(const float* g, const float* u, float* y, int64_t n);
#endif
