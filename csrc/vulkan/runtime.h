// Vulkan runtime of the hanzo "vulkan" torch device: instance, device and compute queue, the
// caching allocator whose pointers are buffer device addresses, command recording and
// submission, compute pipelines loaded from SPIR-V, and profile counters.
//
// Memory model: a tensor's data_ptr() is the VkDeviceAddress (VK_KHR_buffer_device_address,
// core in 1.2) of its first element, so a view is pointer arithmetic and a shader takes every
// tensor as a 64-bit address in its push constants (no descriptor sets).
//
// Execution model: like a CUDA stream. dispatch() and the device-side copies record into one
// open command buffer (a global memory barrier before a command that follows another one);
// synchronize() submits what is recorded and waits on a fence. A copy to the host, .item() and
// torch.vulkan.synchronize() synchronize. Every function here is thread-safe (one lock).
//
// Implemented by concern: runtime_device.cpp (device choice, init), runtime_memory.cpp (memory
// types, allocator), runtime_record.cpp (recording, submission, copies, profile),
// runtime_graph.cpp (graphs), runtime_pipelines.cpp (pipelines); each part of the one State in
// its own header (runtime_state.h joins them).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

#include <cstdint>
#include <string>

namespace hz::vk {

// What the chosen physical device offers (read once at init()).
struct Features {
  std::string device_name;
  std::string driver_name;
  uint32_t api_version = 0;
  uint32_t vendor_id = 0;
  uint32_t device_id = 0;
  int device_index = 0;           // index in vkEnumeratePhysicalDevices (HANZO_VK_DEVICE)
  std::string device_type;        // "discrete", "integrated", "virtual", "cpu", "other"
  uint32_t subgroup_size = 0;
  uint32_t min_subgroup_size = 0, max_subgroup_size = 0;
  bool subgroup_arithmetic = false;      // GL_KHR_shader_subgroup_arithmetic in compute shaders
  uint32_t shared_memory_bytes = 0;      // maxComputeSharedMemorySize
  uint32_t max_workgroup_invocations = 0;
  uint32_t max_workgroup_size[3] = {0, 0, 0};
  uint32_t max_workgroup_count[3] = {0, 0, 0};
  bool float16 = false;          // shaderFloat16 (float16_t arithmetic)
  bool int8 = false;             // shaderInt8 (int8_t arithmetic)
  bool int16 = false;            // shaderInt16
  bool int8_dot = false;         // shaderIntegerDotProduct (GL_EXT_integer_dot_product)
  bool int8_dot_accelerated = false;  // integerDotProduct4x8BitPackedSignedAccelerated
  bool bfloat16 = false;         // VK_KHR_shader_bfloat16 shaderBFloat16Type
  bool host_visible = false;     // tensor memory is host-visible: copies to/from the CPU are memcpy
  uint64_t memory_bytes = 0;     // size of the heap tensors are allocated from
  uint64_t max_allocation_bytes = 0;  // maxMemoryAllocationSize
};

// A compute pipeline over the shared layout (128 bytes of push constants, no descriptor sets).
struct Pipeline {
  std::string name;
  uint64_t handle = 0;  // VkPipeline
};

// Start the runtime (idempotent): instance, device (HANZO_VK_DEVICE=<index> or the first discrete,
// integrated, virtual then CPU device), compute queue, allocator. spv_dir holds <name>.spv.
// Throws c10::Error naming the reason: no loader/driver/device, or the required features the
// device lacks (bufferDeviceAddress, storageBuffer8BitAccess, ...).
void init(const std::string& spv_dir);
bool initialized();
const std::string& spv_dir();
const Features& features();

// The device address of t's first element; TORCH_CHECKs that t is on the vulkan device.
uint64_t address(const at::Tensor& t);

// The pipeline of <spv_dir>/<name>.spv, created once (TORCH_CHECK naming the file if missing).
Pipeline& pipeline(const std::string& name);

// Record one dispatch of p with push constants push[0:push_bytes] (push_bytes <= 128, a multiple
// of 4) over gx*gy*gz workgroups, after a barrier if anything was recorded since the last one.
// A zero group count records nothing.
void dispatch(Pipeline& p, const void* push, uint32_t push_bytes, uint32_t gx, uint32_t gy = 1, uint32_t gz = 1);

// Workgroups for n invocations of local_size each, split into (gx, gy) so that gx stays within
// the device's maxComputeWorkGroupCount[0]; a shader indexes with hz_linear_id() (common.glsl).
void groups_1d(uint64_t n, uint32_t local_size, uint32_t& gx, uint32_t& gy);

// Dispatches recorded while an object of this type lives are independent of each other (none
// reads what another writes): one barrier before the first, none between them. Nestable.
struct Concurrent {
  Concurrent();
  ~Concurrent();
  Concurrent(const Concurrent&) = delete;
  Concurrent& operator=(const Concurrent&) = delete;
};

// Submit the recorded work (no wait).
void flush();
// Submit the recorded work and wait for everything submitted.
void synchronize();

// Copies. Addresses are device addresses from the allocator (a tensor's data_ptr()).
// Host -> device: recorded in order with the other work (memcpy when nothing is pending and the
// memory is host-visible, else through a staging buffer). Device -> host: synchronizes first.
void copy_from_host(uint64_t dst, const void* src, size_t bytes);
void copy_to_host(void* dst, uint64_t src, size_t bytes);
void copy_device(uint64_t dst, uint64_t src, size_t bytes);
// Fill bytes [dst, dst + bytes) with a repeated 32-bit pattern (dst and bytes multiples of 4).
void fill32(uint64_t dst, uint32_t pattern, size_t bytes);

// The caching allocator (device memory, VK_MEMORY_ALLOCATE_DEVICE_ADDRESS_BIT); data pointers
// are device addresses. Out of memory raises torch.OutOfMemoryError (a RuntimeError) naming the
// bytes asked and the device; the process can go on.
c10::Allocator* allocator();
struct MemoryStats {
  uint64_t allocated = 0;      // bytes in live tensors (rounded sizes)
  uint64_t reserved = 0;       // bytes of Vulkan memory held (live + cached)
  uint64_t peak_allocated = 0;
  uint64_t allocations = 0;    // allocate() calls since start
  uint64_t device_allocations = 0;  // vkAllocateMemory calls that succeeded
  uint64_t graph_pool = 0;     // bytes in the private pools of live graphs (live or free blocks)
};
MemoryStats memory_stats();
// Release cached blocks that no tensor uses (synchronizes first).
void empty_cache();

// Graphs: one recorded command buffer, replayed many times (the twin of a CUDA graph).
//
// Between capture_begin(g) and capture_end(g), dispatches, device copies and fills record into
// g's command buffer and are not submitted (what was recorded before capture_begin is submitted
// first). replay(g) submits g's command buffer after the work recorded so far, in one submit:
// a barrier at its start makes earlier writes (the inputs written by copy_from_host, fill_,
// copy_) visible to it, and later work is ordered after it. Push constants are baked in at
// capture, so the addresses and every host-side value (sizes, group counts) are those of the
// capture; only the contents of device buffers may change between replays.
//
// Memory: while capturing, allocations come from g's private pool, and every block freed while
// capturing goes back to that pool (allocated outside it or not), where only later captures into g
// can reuse it: a tensor created outside the graph never gets memory the graph reads or writes.
// destroy_graph() waits for the device and releases the pool: its free blocks return to the
// shared cache (large ones to the driver), its live ones (the graph's outputs) return there when
// their tensors are freed.
//
// Refused while capturing, with a c10::Error naming the operation (and the capture then fails):
// a copy to the host (.item(), .cpu(), printing), synchronize(), flush(), empty_cache(), a copy
// from the host (its bytes would be read at capture, not at replay), the CPU fallback. One capture
// at a time; every thread's work records into it (one queue).
struct Graph;
Graph* create_graph();
// Waits for the device when the graph was submitted; aborts its capture if it is capturing.
void destroy_graph(Graph* g);
void capture_begin(Graph* g);
// Ends the capture; raises (and g stays empty) when an operation was refused during it.
void capture_end(Graph* g);
// Ends the capture and discards what was recorded (after an exception); never raises.
void capture_abort(Graph* g) noexcept;
void replay(Graph* g);
// Drop the recorded commands (the pool is kept); capture_begin may then record again.
void reset_graph(Graph* g);
struct GraphInfo {
  bool recorded = false;
  uint64_t dispatches = 0, barriers = 0, copies = 0;  // recorded commands (replay adds them to Profile)
  uint64_t pool_bytes = 0;                              // bytes in the private pool (live or free)
};
GraphInfo graph_info(Graph* g);
// True while a capture is under way.
bool capturing();
// Raise (and fail the capture) when capturing: `what` cannot be recorded.
void check_not_capturing(const char* what);

// Profile counters, collected when HANZO_VK_PROFILE=1 was set at init(). A replay adds the
// graph's recorded dispatches, barriers and copies; commands recorded while capturing are
// counted there and not here (they run at replay), their record time is counted here.
struct Profile {
  uint64_t dispatches = 0;
  uint64_t barriers = 0;
  uint64_t copies = 0;
  uint64_t submits = 0;
  double record_us = 0;   // time spent recording commands
  double submit_us = 0;   // time in vkQueueSubmit
  double wait_us = 0;     // time waiting on fences
};
bool profiling();
// Turn the counters on or off (HANZO_VK_PROFILE sets the initial state); resets them.
void set_profiling(bool on);
// The counters since the last call (or init), and reset them.
Profile take_profile();

}  // namespace hz::vk
