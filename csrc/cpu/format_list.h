// Generated from hanzo_torch/backends/cpu/rules.py (python -m hanzo_torch.backends.cpu.rules);
// do not edit. The formats of the CPU kernels' table: X(F<NAME>) per trait of formats.h.
#pragma once

#define HZ_FOR_EACH_FORMAT(X) \
    X(FQ4_0) X(FQ4_1) X(FQ5_0) X(FQ5_1) X(FQ8_0) X(FQ2_K) X(FQ3_K) X(FQ4_K) \
    X(FQ5_K) X(FQ6_K) X(FIQ2_XXS) X(FIQ2_XS) X(FIQ2_S) X(FIQ3_XXS) X(FIQ3_S) X(FIQ1_S) \
    X(FIQ1_M) X(FIQ4_NL) X(FIQ4_XS) X(FTQ1_0) X(FTQ2_0) X(FMXFP4) X(FQ1_0)
