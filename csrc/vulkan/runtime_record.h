// Recording and graphs of the Vulkan runtime: the open command buffer and its barriers, the
// submissions in flight and their fences, the graph being captured, the profile counters. Their
// part of the runtime State, and the Graph (a recorded command buffer and its private pool).
#pragma once

#include <map>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "runtime_base.h"
#include "runtime_memory.h"

namespace hz::vk {

// A recorded command buffer and the private memory pool its baked-in addresses point into.
struct Graph {
  VkCommandBuffer cmd = VK_NULL_HANDLE;
  bool recorded = false;        // capture ended without error: replay() may submit cmd
  std::string error;            // the first refused operation of the capture
  uint64_t dispatches = 0, barriers = 0, copies = 0;
  // private pool: blocks allocated while capturing, or freed while capturing; a freed one goes
  // back to these lists only, so no tensor outside the graph ever gets its memory
  std::vector<rt::Block*> free_small[rt::kSmallClasses];
  std::multimap<uint64_t, rt::Block*> free_large;
  std::unordered_set<rt::Block*> owned;  // live or free
  uint64_t pool_bytes = 0;
};

}  // namespace hz::vk

namespace hz::vk::rt {

constexpr uint32_t kFlushEvery = 256;            // submit (no wait) after this many commands

struct Submission {
  VkCommandBuffer cmd = VK_NULL_HANDLE;
  VkFence fence = VK_NULL_HANDLE;
  std::vector<Block*> release;  // staging blocks to recycle once the fence signals
};

struct RecordState {
  VkCommandBuffer cur = VK_NULL_HANDLE;
  VkFence cur_fence = VK_NULL_HANDLE;
  std::vector<Block*> cur_release;
  uint32_t cur_commands = 0;
  bool need_barrier = false;
  int concurrent_depth = 0;
  bool concurrent_recorded = false;
  std::vector<Submission> in_flight;
  std::vector<std::pair<VkCommandBuffer, VkFence>> spare;
  Graph* capture = nullptr;  // the graph being recorded into (s.cur is its command buffer then)
  std::vector<VkCommandBuffer> dead_graphs;  // of graphs destroyed while another one was capturing

  bool profile = false;
  Profile prof;
};

// Open the command buffer (no-op when open).
void begin_locked(State& s);
// Count a recorded dispatch or copy: in the graph while capturing (it runs at replay), else in
// the profile.
void count_dispatch(State& s);
void count_copy(State& s);
// Refuse `what` while capturing: the capture fails (capture_end raises) and this raises now.
void refuse_in_capture(State& s, const char* what);
// Open the command buffer and record the barrier the next command needs.
void before_command(State& s);
// After a recorded command: the next one gets a barrier (outside Concurrent), and a long
// buffer is submitted.
void after_command(State& s);
// Device writes made visible to the host before the fence signals.
void host_barrier(VkCommandBuffer cmd);
// Submit the open command buffer, followed by `graph` (a recorded graph's) when given, in one
// vkQueueSubmit with the open buffer's fence.
void submit_locked(State& s, VkCommandBuffer graph = VK_NULL_HANDLE);
// Submit and wait for everything submitted; recycles the staging blocks of finished work.
void synchronize_locked(State& s);
// Nothing recorded and nothing in flight.
bool idle_locked(State& s);

}  // namespace hz::vk::rt
