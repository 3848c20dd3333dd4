// Recording of the Vulkan runtime (runtime.h): the open command buffer, barriers, dispatches,
// copies and fills, submission and synchronization, Concurrent regions, profile counters.
#include "runtime_state.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace hz::vk {
namespace rt {

void begin_locked(State& s) {
  if (s.cur != VK_NULL_HANDLE) return;
  if (!s.spare.empty()) {
    s.cur = s.spare.back().first;
    s.cur_fence = s.spare.back().second;
    s.spare.pop_back();
  } else {
    VkCommandBufferAllocateInfo ai{VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO};
    ai.commandPool = s.cmd_pool;
    ai.level = VK_COMMAND_BUFFER_LEVEL_PRIMARY;
    ai.commandBufferCount = 1;
    HZ_VK_CHECK(vkAllocateCommandBuffers(s.device, &ai, &s.cur));
    VkFenceCreateInfo fci{VK_STRUCTURE_TYPE_FENCE_CREATE_INFO};
    HZ_VK_CHECK(vkCreateFence(s.device, &fci, nullptr, &s.cur_fence));
  }
  VkCommandBufferBeginInfo bi{VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO};
  bi.flags = VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT;
  HZ_VK_CHECK(vkBeginCommandBuffer(s.cur, &bi));
  s.cur_commands = 0;
}

void barrier_locked(State& s) {
  VkMemoryBarrier mb{VK_STRUCTURE_TYPE_MEMORY_BARRIER};
  mb.srcAccessMask = VK_ACCESS_SHADER_WRITE_BIT | VK_ACCESS_TRANSFER_WRITE_BIT;
  mb.dstAccessMask = VK_ACCESS_SHADER_READ_BIT | VK_ACCESS_SHADER_WRITE_BIT | VK_ACCESS_TRANSFER_READ_BIT |
                     VK_ACCESS_TRANSFER_WRITE_BIT;
  auto stages = VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | VK_PIPELINE_STAGE_TRANSFER_BIT;
  vkCmdPipelineBarrier(s.cur, stages, stages, 0, 1, &mb, 0, nullptr, 0, nullptr);
  if (s.capture != nullptr) s.capture->barriers += 1;
  else if (s.profile) s.prof.barriers += 1;
}

// Count a recorded dispatch or copy: in the graph while capturing (it runs at replay), else in
// the profile.
void count_dispatch(State& s) {
  if (s.capture != nullptr) s.capture->dispatches += 1;
  else if (s.profile) s.prof.dispatches += 1;
}
void count_copy(State& s) {
  if (s.capture != nullptr) s.capture->copies += 1;
  else if (s.profile) s.prof.copies += 1;
}

// Refuse `what` while capturing: the capture fails (capture_end raises) and this raises now.
void refuse_in_capture(State& s, const char* what) {
  if (s.capture == nullptr) return;
  std::string msg = std::string("Vulkan graph capture: ") + what +
                    " is not allowed while capturing (a captured graph runs only on the device, at replay); "
                    "do it before or after the capture";
  if (s.capture->error.empty()) s.capture->error = msg;
  TORCH_CHECK(false, msg);
}

// Open the command buffer and record the barrier the next command needs.
void before_command(State& s) {
  begin_locked(s);
  if (s.need_barrier) {
    barrier_locked(s);
    s.need_barrier = false;
  }
}

void after_command(State& s) {
  s.cur_commands += 1;
  if (s.concurrent_depth > 0) s.concurrent_recorded = true;
  else s.need_barrier = true;
  if (s.cur_commands >= kFlushEvery && s.capture == nullptr) submit_locked(s);
}

// Device writes made visible to the host before the fence signals.
void host_barrier(VkCommandBuffer cmd) {
  VkMemoryBarrier mb{VK_STRUCTURE_TYPE_MEMORY_BARRIER};
  mb.srcAccessMask = VK_ACCESS_SHADER_WRITE_BIT | VK_ACCESS_TRANSFER_WRITE_BIT;
  mb.dstAccessMask = VK_ACCESS_HOST_READ_BIT;
  vkCmdPipelineBarrier(cmd, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | VK_PIPELINE_STAGE_TRANSFER_BIT,
                       VK_PIPELINE_STAGE_HOST_BIT, 0, 1, &mb, 0, nullptr, 0, nullptr);
}

// Submit the open command buffer, followed by `graph` (a recorded graph's) when given, in one
// vkQueueSubmit with the open buffer's fence.
void submit_locked(State& s, VkCommandBuffer graph) {
  refuse_in_capture(s, "submitting the recorded work (flush/synchronize)");
  if (graph != VK_NULL_HANDLE) begin_locked(s);
  if (s.cur == VK_NULL_HANDLE) return;
  if (graph == VK_NULL_HANDLE) host_barrier(s.cur);  // a graph ends with its own
  HZ_VK_CHECK(vkEndCommandBuffer(s.cur));
  VkCommandBuffer cmds[2] = {s.cur, graph};
  VkSubmitInfo si{VK_STRUCTURE_TYPE_SUBMIT_INFO};
  si.commandBufferCount = graph != VK_NULL_HANDLE ? 2 : 1;
  si.pCommandBuffers = cmds;
  auto t0 = Clock::now();
  VkResult r = vkQueueSubmit(s.queue, 1, &si, s.cur_fence);
  if (s.profile) {
    s.prof.submit_us += us_since(t0);
    s.prof.submits += 1;
  }
  HZ_VK_CHECK(r);
  Submission sub;
  sub.cmd = s.cur;
  sub.fence = s.cur_fence;
  sub.release.swap(s.cur_release);
  s.in_flight.push_back(std::move(sub));
  s.cur = VK_NULL_HANDLE;
  s.cur_fence = VK_NULL_HANDLE;
  s.cur_commands = 0;
  // work in the next command buffer is ordered after this one by a barrier
  s.need_barrier = true;
}

void synchronize_locked(State& s) {
  if (!s.ready) return;
  refuse_in_capture(s, "synchronize (waiting for the device)");
  submit_locked(s);
  if (s.in_flight.empty()) return;
  std::vector<VkFence> fences;
  for (auto& sub : s.in_flight) fences.push_back(sub.fence);
  auto t0 = Clock::now();
  VkResult r = vkWaitForFences(s.device, static_cast<uint32_t>(fences.size()), fences.data(), VK_TRUE, UINT64_MAX);
  if (s.profile) s.prof.wait_us += us_since(t0);
  HZ_VK_CHECK(r);
  HZ_VK_CHECK(vkResetFences(s.device, static_cast<uint32_t>(fences.size()), fences.data()));
  for (auto& sub : s.in_flight) {
    vkResetCommandBuffer(sub.cmd, 0);
    s.spare.emplace_back(sub.cmd, sub.fence);
    for (Block* b : sub.release) recycle_locked(s, b);
  }
  s.in_flight.clear();
  if (!s.dead_graphs.empty()) {
    vkFreeCommandBuffers(s.device, s.cmd_pool, static_cast<uint32_t>(s.dead_graphs.size()), s.dead_graphs.data());
    s.dead_graphs.clear();
  }
}

bool idle_locked(State& s) { return s.cur == VK_NULL_HANDLE && s.in_flight.empty(); }

}  // namespace rt

using namespace rt;

void dispatch(Pipeline& p, const void* push, uint32_t push_bytes, uint32_t gx, uint32_t gy, uint32_t gz) {
  TORCH_CHECK(push_bytes <= kPushBytes && push_bytes % 4 == 0, "Vulkan dispatch of ", p.name, ": push constants of ",
              push_bytes, " bytes (at most ", kPushBytes, ", a multiple of 4)");
  if (gx == 0 || gy == 0 || gz == 0) return;
  State& s = ready_state();
  std::lock_guard<std::recursive_mutex> g(s.mu);
  const auto& mc = s.feat.max_workgroup_count;
  TORCH_CHECK(gx <= mc[0] && gy <= mc[1] && gz <= mc[2], "Vulkan dispatch of ", p.name, ": ", gx, "x", gy, "x", gz,
              " workgroups exceed the device's maximum ", mc[0], "x", mc[1], "x", mc[2]);
  auto t0 = Clock::now();
  before_command(s);
  vkCmdBindPipeline(s.cur, VK_PIPELINE_BIND_POINT_COMPUTE, reinterpret_cast<VkPipeline>(p.handle));
  if (push_bytes) vkCmdPushConstants(s.cur, s.layout, VK_SHADER_STAGE_COMPUTE_BIT, 0, push_bytes, push);
  vkCmdDispatch(s.cur, gx, gy, gz);
  count_dispatch(s);
  if (s.profile) s.prof.record_us += us_since(t0);
  after_command(s);
}

void groups_1d(uint64_t n, uint32_t local_size, uint32_t& gx, uint32_t& gy) {
  uint64_t groups = (n + local_size - 1) / local_size;
  uint64_t maxx = std::min<uint64_t>(ready_state().feat.max_workgroup_count[0], 65535);
  if (groups <= maxx) {
    gx = static_cast<uint32_t>(groups);
    gy = groups ? 1 : 0;
    return;
  }
  gx = static_cast<uint32_t>(maxx);
  uint64_t y = (groups + maxx - 1) / maxx;
  TORCH_CHECK(y <= ready_state().feat.max_workgroup_count[1], "Vulkan: ", n, " invocations exceed the grid limits");
  gy = static_cast<uint32_t>(y);
}

Concurrent::Concurrent() {
  State& s = S();
  std::lock_guard<std::recursive_mutex> g(s.mu);
  if (s.concurrent_depth++ == 0) s.concurrent_recorded = false;
}

Concurrent::~Concurrent() {
  State& s = S();
  std::lock_guard<std::recursive_mutex> g(s.mu);
  if (--s.concurrent_depth == 0 && s.concurrent_recorded) s.need_barrier = true;
}

void flush() {
  State& s = S();
  std::lock_guard<std::recursive_mutex> g(s.mu);
  if (s.ready) submit_locked(s);
}

void synchronize() {
  State& s = S();
  std::lock_guard<std::recursive_mutex> g(s.mu);
  synchronize_locked(s);
}

void copy_from_host(uint64_t dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  State& s = ready_state();
  std::lock_guard<std::recursive_mutex> g(s.mu);
  refuse_in_capture(s, "a copy from the host (its bytes would be read now, not at replay)");
  uint64_t off = 0;
  Chunk* c = resolve(s, dst, bytes, off);
  if (c->mapped && idle_locked(s)) {  // nothing in flight may still read the old bytes
    std::memcpy(c->mapped + off, src, bytes);
    return;
  }
  auto t0 = Clock::now();
  Block* st = allocate_locked(s, bytes, kStagingPool);
  std::memcpy(st->chunk->mapped + (st->address - st->chunk->address), src, bytes);
  before_command(s);
  VkBufferCopy region{st->address - st->chunk->address, off, bytes};
  vkCmdCopyBuffer(s.cur, st->chunk->buffer, c->buffer, 1, &region);
  s.cur_release.push_back(st);
  count_copy(s);
  if (s.profile) s.prof.record_us += us_since(t0);
  after_command(s);
}

void copy_to_host(void* dst, uint64_t src, size_t bytes) {
  if (bytes == 0) return;
  State& s = ready_state();
  std::lock_guard<std::recursive_mutex> g(s.mu);
  refuse_in_capture(s, "a copy to the host (.item(), .cpu(), .tolist(), printing a tensor)");
  uint64_t off = 0;
  Chunk* c = resolve(s, src, bytes, off);
  if (c->mapped) {
    synchronize_locked(s);
    std::memcpy(dst, c->mapped + off, bytes);
    return;
  }
  Block* st = allocate_locked(s, bytes, kStagingPool);
  before_command(s);
  VkBufferCopy region{off, st->address - st->chunk->address, bytes};
  vkCmdCopyBuffer(s.cur, c->buffer, st->chunk->buffer, 1, &region);
  count_copy(s);
  after_command(s);
  synchronize_locked(s);
  std::memcpy(dst, st->chunk->mapped + (st->address - st->chunk->address), bytes);
  recycle_locked(s, st);
}

void copy_device(uint64_t dst, uint64_t src, size_t bytes) {
  if (bytes == 0) return;
  State& s = ready_state();
  std::lock_guard<std::recursive_mutex> g(s.mu);
  uint64_t so = 0, d_o = 0;
  Chunk* sc = resolve(s, src, bytes, so);
  Chunk* dc = resolve(s, dst, bytes, d_o);
  TORCH_CHECK(sc != dc || so + bytes <= d_o || d_o + bytes <= so, "Vulkan: overlapping device copy");
  auto t0 = Clock::now();
  before_command(s);
  VkBufferCopy region{so, d_o, bytes};
  vkCmdCopyBuffer(s.cur, sc->buffer, dc->buffer, 1, &region);
  count_copy(s);
  if (s.profile) s.prof.record_us += us_since(t0);
  after_command(s);
}

void fill32(uint64_t dst, uint32_t pattern, size_t bytes) {
  if (bytes == 0) return;
  TORCH_CHECK(dst % 4 == 0 && bytes % 4 == 0, "Vulkan fill32: address and size must be multiples of 4");
  State& s = ready_state();
  std::lock_guard<std::recursive_mutex> g(s.mu);
  uint64_t off = 0;
  Chunk* c = resolve(s, dst, bytes, off);
  auto t0 = Clock::now();
  before_command(s);
  vkCmdFillBuffer(s.cur, c->buffer, off, bytes, pattern);
  count_copy(s);
  if (s.profile) s.prof.record_us += us_since(t0);
  after_command(s);
}

bool profiling() { return S().profile; }

void set_profiling(bool on) {
  State& s = S();
  std::lock_guard<std::recursive_mutex> g(s.mu);
  s.profile = on;
  s.prof = Profile();
}

Profile take_profile() {
  State& s = S();
  std::lock_guard<std::recursive_mutex> g(s.mu);
  Profile p = s.prof;
  s.prof = Profile();
  return p;
}

}  // namespace hz::vk
