#version 450
// hanzo::rms_norm (body in norm.glsl)
#include "fused.glsl"
#include "norm.glsl"
