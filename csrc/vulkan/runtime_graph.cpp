// Graphs of the Vulkan runtime (runtime.h): capture into a graph's command buffer and private
// memory pool, replay, reset and destruction.
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



}  // namespace rt

using namespace rt;

Graph* create_graph() {
  ready_state();
  return new Graph();
}

namespace {

void free_graph_cmd(State& s, Graph* g) {
  if (g->cmd != VK_NULL_HANDLE) vkFreeCommandBuffers(s.device, s.cmd_pool, 1, &g->cmd);
  g->cmd = VK_NULL_HANDLE;
  g->recorded = false;
  g->dispatches = g->barriers = g->copies = 0;
}

void end_capture_locked(State& s, Graph* g) {
  // the graph's writes made visible to the host (and to what follows: the next buffer starts
  // with a barrier)
  host_barrier(g->cmd);
  VkResult r = vkEndCommandBuffer(g->cmd);
  s.capture = nullptr;
  s.cur = VK_NULL_HANDLE;
  s.cur_fence = VK_NULL_HANDLE;
  s.cur_commands = 0;
  s.need_barrier = true;
  if (r != VK_SUCCESS && g->error.empty()) g->error = std::string("vkEndCommandBuffer failed: ") + vk_result_name(r);
}

}  // namespace

void destroy_graph(Graph* g) {
  if (g == nullptr) return;
  State& s = S();
  std::lock_guard<std::recursive_mutex> lock(s.mu);
  if (s.capture == g) capture_abort(g);
  if (s.capture != nullptr) {
    // Another graph is capturing: no waiting now. Its pool takes this one's blocks (work in
    // flight may still use them) and the command buffer is freed after the next wait.
    if (g->cmd != VK_NULL_HANDLE) s.dead_graphs.push_back(g->cmd);
    std::vector<Block*> blocks(g->owned.begin(), g->owned.end());
    for (Block* b : blocks) adopt(s, s.capture, b);
    for (auto& fl : g->free_small) {
      for (Block* b : fl) s.capture->free_small[b->cls].push_back(b);
    }
    for (auto& kv : g->free_large) s.capture->free_large.emplace(kv.first, kv.second);
    delete g;
    return;
  }
  if (s.ready) synchronize_locked(s);  // a replay, or work on the pool's blocks, may still run
  if (s.ready) free_graph_cmd(s, g);
  // free blocks: small ones back to the shared cache, large ones to the driver
  for (auto& fl : g->free_small) {
    for (Block* b : fl) s.free_small[b->pool][b->cls].push_back(b);
    fl.clear();
  }
  for (auto& kv : g->free_large) {
    g->owned.erase(kv.second);
    s.stats.graph_pool -= kv.second->size;
    if (s.ready) free_chunk(s, kv.second->chunk);
    delete kv.second;
  }
  g->free_large.clear();
  // live blocks (the graph's outputs) and the small free ones belong to the shared cache now
  for (Block* b : g->owned) {
    b->owner = nullptr;
    s.stats.graph_pool -= b->size;
  }
  g->owned.clear();
  delete g;
}

void capture_begin(Graph* g) {
  State& s = ready_state();
  std::lock_guard<std::recursive_mutex> lock(s.mu);
  TORCH_CHECK(s.capture == nullptr, "Vulkan graph capture: another capture is under way (one at a time)");
  TORCH_CHECK(g->cmd == VK_NULL_HANDLE, "Vulkan graph capture: this graph already holds a capture (reset() it first)");
  TORCH_CHECK(s.concurrent_depth == 0, "Vulkan graph capture: cannot begin inside a Concurrent region");
  submit_locked(s);  // what was recorded before belongs to no graph
  VkCommandBufferAllocateInfo ai{VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO};
  ai.commandPool = s.cmd_pool;
  ai.level = VK_COMMAND_BUFFER_LEVEL_PRIMARY;
  ai.commandBufferCount = 1;
  HZ_VK_CHECK(vkAllocateCommandBuffers(s.device, &ai, &g->cmd));
  VkCommandBufferBeginInfo bi{VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO};
  bi.flags = VK_COMMAND_BUFFER_USAGE_SIMULTANEOUS_USE_BIT;  // replays may be in flight together
  VkResult r = vkBeginCommandBuffer(g->cmd, &bi);
  if (r != VK_SUCCESS) free_graph_cmd(s, g);
  HZ_VK_CHECK(r);
  g->error.clear();
  g->dispatches = g->barriers = g->copies = 0;
  s.capture = g;
  s.cur = g->cmd;
  s.cur_fence = VK_NULL_HANDLE;
  s.cur_commands = 0;
  s.need_barrier = true;  // the first command waits for the work submitted before the replay
}

void capture_end(Graph* g) {
  State& s = ready_state();
  std::lock_guard<std::recursive_mutex> lock(s.mu);
  TORCH_CHECK(s.capture == g, "Vulkan graph capture: capture_end() without capture_begin() on this graph");
  TORCH_CHECK(s.concurrent_depth == 0, "Vulkan graph capture: cannot end inside a Concurrent region");
  end_capture_locked(s, g);
  if (!g->error.empty()) {
    std::string err = g->error;
    free_graph_cmd(s, g);
    TORCH_CHECK(false, "Vulkan graph capture failed: ", err);
  }
  g->recorded = true;
}

void capture_abort(Graph* g) noexcept {
  State& s = S();
  std::lock_guard<std::recursive_mutex> lock(s.mu);
  if (s.capture != g) return;
  end_capture_locked(s, g);
  free_graph_cmd(s, g);
}

void replay(Graph* g) {
  State& s = ready_state();
  std::lock_guard<std::recursive_mutex> lock(s.mu);
  TORCH_CHECK(s.capture != g, "Vulkan graph: replay() of the graph being captured");
  refuse_in_capture(s, "replaying another graph");
  TORCH_CHECK(g->recorded, "Vulkan graph: replay() of a graph without a successful capture");
  if (s.profile) {
    s.prof.dispatches += g->dispatches;
    s.prof.barriers += g->barriers;
    s.prof.copies += g->copies;
  }
  submit_locked(s, g->cmd);
}

void reset_graph(Graph* g) {
  State& s = ready_state();
  std::lock_guard<std::recursive_mutex> lock(s.mu);
  TORCH_CHECK(s.capture != g, "Vulkan graph: reset() while capturing it");
  if (g->cmd != VK_NULL_HANDLE) synchronize_locked(s);
  free_graph_cmd(s, g);
  g->error.clear();
}

GraphInfo graph_info(Graph* g) {
  State& s = S();
  std::lock_guard<std::recursive_mutex> lock(s.mu);
  GraphInfo i;
  i.recorded = g->recorded;
  i.dispatches = g->dispatches;
  i.barriers = g->barriers;
  i.copies = g->copies;
  i.pool_bytes = g->pool_bytes;
  return i;
}

bool capturing() {
  State& s = S();
  std::lock_guard<std::recursive_mutex> lock(s.mu);
  return s.capture != nullptr;
}

void check_not_capturing(const char* what) {
  State& s = S();
  std::lock_guard<std::recursive_mutex> lock(s.mu);
  refuse_in_capture(s, what);
}

}  // namespace hz::vk
