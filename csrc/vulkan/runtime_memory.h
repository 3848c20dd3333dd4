// Memory of the Vulkan runtime: the memory types of the device, the chunks (VkDeviceMemory +
// VkBuffer with a device address), the caching allocator's blocks and free lists (shared, and
// the private pools of graphs), the torch allocator over them. Their part of the runtime State.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "runtime_base.h"

namespace hz::vk::rt {

constexpr uint64_t kAlign = 256;                 // every block starts at a multiple of this
constexpr int kSmallClasses = 13;                // 256 B << 0..12: 256 B .. 1 MiB
constexpr uint64_t kSmallMax = kAlign << (kSmallClasses - 1);
constexpr uint64_t kChunkBytes = 16ull << 20;    // small blocks are carved from 16 MiB chunks

enum Pool { kDevicePool = 0, kStagingPool = 1, kPools = 2 };

struct Chunk {
  VkDeviceMemory memory = VK_NULL_HANDLE;
  VkBuffer buffer = VK_NULL_HANDLE;
  uint64_t address = 0;
  uint64_t size = 0;
  uint8_t* mapped = nullptr;  // host pointer of byte 0 when the memory is host-visible
  int pool = kDevicePool;
  bool dedicated = false;     // holds exactly one large block
  uint64_t bump = 0;          // small chunks: first byte not yet carved
};

struct Block {
  Chunk* chunk = nullptr;
  uint64_t address = 0;
  uint64_t size = 0;          // rounded size
  int cls = -1;               // small size class, -1 for a large (dedicated) block
  int pool = kDevicePool;
  Graph* owner = nullptr;     // the graph whose private pool holds this block (nullptr: the shared cache)
};

struct MemoryState {
  uint32_t mem_type[kPools] = {0, 0};
  uint32_t mem_flags[kPools] = {0, 0};
  uint64_t heap_bytes[kPools] = {0, 0};
  std::map<uint64_t, Chunk*> chunks;  // by address
  Chunk* carving[kPools] = {nullptr, nullptr};
  std::vector<Block*> free_small[kPools][kSmallClasses];
  std::multimap<uint64_t, Block*> free_large[kPools];
  MemoryStats stats;
};

// The memory type of each pool (tensors: DEVICE_LOCAL; staging: HOST_VISIBLE | HOST_COHERENT),
// at init(); unified: the device shares the host's RAM (integrated GPU, CPU device).
void choose_memory(State& s, bool unified);
// A block of at least `bytes` of pool (from a graph's pool while capturing); raises
// torch.OutOfMemoryError when the device has no memory left for it.
Block* allocate_locked(State& s, uint64_t bytes, int pool);
// Back to its free list (a graph's while capturing or when the graph owns it).
void recycle_locked(State& s, Block* b);
// g's pool takes b (from the shared cache or another graph's pool).
void adopt(State& s, Graph* g, Block* b);
// Free the cached large blocks (their memory goes back to the driver). Waits for the device.
void release_cached_locked(State& s);
void free_chunk(State& s, Chunk* c);
// The chunk holding [addr, addr + bytes) and the offset of addr in it.
Chunk* resolve(State& s, uint64_t addr, uint64_t bytes, uint64_t& offset);

}  // namespace hz::vk::rt
