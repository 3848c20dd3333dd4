// hz: per-format
// dequantize and get_rows: packed rows -> float32 / float16 / bfloat16 rows, bit-exact with the
// reference in float32 (one rounding for the other dtypes).
// Output row r (r0 + gl_WorkGroupID.y + 65535 * gl_WorkGroupID.z) is source row r, or ids[r] when
// ids is set (get_rows); an id outside [0, n_src) gives a row of NaN and reads nothing.
// One invocation per value of a row (gl_GlobalInvocationID.x = column).
#version 460
#include "formats.glsl"

layout(local_size_x = 256) in;

layout(push_constant, std430) uniform Push {
    uint64_t src;     // packed rows, row_bytes apart
    uint64_t dst;     // [n_rows, K] of out_dtype
    uint64_t ids;     // row ids (get_rows) or 0
    uint64_t table;   // the format's grid (formats.glsl hz_table) or 0
    uint row_bytes;
    uint K;           // values per row
    uint n_rows;      // output rows
    uint r0;          // first output row of this dispatch
    uint n_src;       // source rows (the id range)
    uint out_dtype;   // HZ_DT_*
    uint ids_int64;   // 1: ids are int64, 0: int32
} pc;

void main() {
    hz_table = pc.table;
    uint k = gl_GlobalInvocationID.x;
    uint r = pc.r0 + gl_WorkGroupID.y + 65535u * gl_WorkGroupID.z;
    if (k >= pc.K || r >= pc.n_rows) return;
    uint64_t src_row = uint64_t(r);
    if (pc.ids != 0ul) {
        int64_t id = pc.ids_int64 != 0u ? int64_t(U32Ptr(pc.ids + uint64_t(r) * 8ul).v[0]) |
                                              (int64_t(U32Ptr(pc.ids + uint64_t(r) * 8ul + 4ul).v[0]) << 32)
                                        : int64_t(int(U32Ptr(pc.ids + uint64_t(r) * 4ul).v[0]));
        if (id < 0l || id >= int64_t(pc.n_src)) {
            hz_store(pc.dst, pc.out_dtype, uint64_t(r) * pc.K + k, uintBitsToFloat(0x7FC00000u));
            return;
        }
        src_row = uint64_t(id);
    }
    float v = hz_value_at(pc.src + src_row * pc.row_bytes, k);
    hz_store(pc.dst, pc.out_dtype, uint64_t(r) * pc.K + k, v);
}
