// Memory of the Vulkan runtime (runtime.h): memory types, chunks, the caching allocator with its
// graph pools, the torch allocator, memory_stats() and empty_cache().
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

// Memory type for pool: tensors prefer DEVICE_LOCAL (host-visible too on integrated/CPU devices,
// where it is the same RAM); staging wants HOST_VISIBLE | HOST_COHERENT (cached if possible).
void choose_memory(State& s, bool unified) {
  VkPhysicalDeviceMemoryProperties mp;
  vkGetPhysicalDeviceMemoryProperties(s.phys, &mp);
  auto score_device = [&](uint32_t i) -> int64_t {
    auto fl = mp.memoryTypes[i].propertyFlags;
    if (fl & (VK_MEMORY_PROPERTY_PROTECTED_BIT | VK_MEMORY_PROPERTY_LAZILY_ALLOCATED_BIT)) return -1;
    int64_t sc = 0;
    if (fl & VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT) sc += 1000;
    bool hv = (fl & VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT) && (fl & VK_MEMORY_PROPERTY_HOST_COHERENT_BIT);
    if (unified && hv) sc += 100;
    if (!unified && !hv) sc += 100;  // the large VRAM heap, not the BAR window
    if (fl & VK_MEMORY_PROPERTY_HOST_CACHED_BIT) sc += 10;
    return sc;
  };
  auto score_staging = [&](uint32_t i) -> int64_t {
    auto fl = mp.memoryTypes[i].propertyFlags;
    if (!(fl & VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT) || !(fl & VK_MEMORY_PROPERTY_HOST_COHERENT_BIT)) return -1;
    if (fl & VK_MEMORY_PROPERTY_PROTECTED_BIT) return -1;
    int64_t sc = 1000;
    if (fl & VK_MEMORY_PROPERTY_HOST_CACHED_BIT) sc += 10;
    return sc;
  };
  for (int pool = 0; pool < kPools; ++pool) {
    int64_t best = -1;
    for (uint32_t i = 0; i < mp.memoryTypeCount; ++i) {
      int64_t sc = pool == kDevicePool ? score_device(i) : score_staging(i);
      if (sc < 0) continue;
      sc = sc * 64 + std::min<uint64_t>(63, mp.memoryHeaps[mp.memoryTypes[i].heapIndex].size >> 30);
      if (sc > best) {
        best = sc;
        s.mem_type[pool] = i;
      }
    }
    TORCH_CHECK(best >= 0, "Vulkan: ", s.feat.device_name, " has no ",
                pool == kDevicePool ? "usable" : "host-visible coherent", " memory type");
    s.mem_flags[pool] = mp.memoryTypes[s.mem_type[pool]].propertyFlags;
    s.heap_bytes[pool] = mp.memoryHeaps[mp.memoryTypes[s.mem_type[pool]].heapIndex].size;
  }
  s.feat.memory_bytes = s.heap_bytes[kDevicePool];
  s.feat.host_visible = (s.mem_flags[kDevicePool] & VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT) &&
                        (s.mem_flags[kDevicePool] & VK_MEMORY_PROPERTY_HOST_COHERENT_BIT);
}

std::string human(uint64_t b) {
  std::ostringstream o;
  o.precision(3);
  if (b >= (1ull << 30)) o << static_cast<double>(b) / (1ull << 30) << " GiB";
  else if (b >= (1ull << 20)) o << static_cast<double>(b) / (1ull << 20) << " MiB";
  else o << b << " bytes";
  return o.str();
}

// A new VkDeviceMemory + VkBuffer of `bytes` in pool; nullptr when the device is out of memory.
Chunk* new_chunk(State& s, int pool, uint64_t bytes) {
  VkBufferCreateInfo bci{VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO};
  bci.size = bytes;
  bci.usage = VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | VK_BUFFER_USAGE_SHADER_DEVICE_ADDRESS_BIT |
              VK_BUFFER_USAGE_TRANSFER_SRC_BIT | VK_BUFFER_USAGE_TRANSFER_DST_BIT;
  bci.sharingMode = VK_SHARING_MODE_EXCLUSIVE;
  VkBuffer buf = VK_NULL_HANDLE;
  VkResult r = vkCreateBuffer(s.device, &bci, nullptr, &buf);
  if (r == VK_ERROR_OUT_OF_DEVICE_MEMORY || r == VK_ERROR_OUT_OF_HOST_MEMORY) return nullptr;
  HZ_VK_CHECK(r);
  VkMemoryRequirements req;
  vkGetBufferMemoryRequirements(s.device, buf, &req);
  if (!(req.memoryTypeBits & (1u << s.mem_type[pool]))) {
    vkDestroyBuffer(s.device, buf, nullptr);
    TORCH_CHECK(false, "Vulkan: buffers on ", s.feat.device_name, " cannot use the chosen memory type ",
                s.mem_type[pool]);
  }
  VkMemoryAllocateFlagsInfo fi{VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_FLAGS_INFO};
  fi.flags = VK_MEMORY_ALLOCATE_DEVICE_ADDRESS_BIT;
  VkMemoryAllocateInfo mai{VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO};
  mai.pNext = &fi;
  mai.allocationSize = req.size;
  mai.memoryTypeIndex = s.mem_type[pool];
  VkDeviceMemory mem = VK_NULL_HANDLE;
  r = vkAllocateMemory(s.device, &mai, nullptr, &mem);
  if (r != VK_SUCCESS) {
    vkDestroyBuffer(s.device, buf, nullptr);
    if (r == VK_ERROR_OUT_OF_DEVICE_MEMORY || r == VK_ERROR_OUT_OF_HOST_MEMORY || r == VK_ERROR_TOO_MANY_OBJECTS)
      return nullptr;
    HZ_VK_CHECK(r);
  }
  HZ_VK_CHECK(vkBindBufferMemory(s.device, buf, mem, 0));
  auto* c = new Chunk();
  c->memory = mem;
  c->buffer = buf;
  c->size = bytes;
  c->pool = pool;
  VkBufferDeviceAddressInfo ai{VK_STRUCTURE_TYPE_BUFFER_DEVICE_ADDRESS_INFO};
  ai.buffer = buf;
  c->address = vkGetBufferDeviceAddress(s.device, &ai);
  if ((s.mem_flags[pool] & VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT)) {
    void* p = nullptr;
    HZ_VK_CHECK(vkMapMemory(s.device, mem, 0, VK_WHOLE_SIZE, 0, &p));
    c->mapped = static_cast<uint8_t*>(p);
  }
  TORCH_CHECK(c->address % kAlign == 0, "Vulkan: buffer address not aligned to ", kAlign);
  s.chunks[c->address] = c;
  s.stats.reserved += bytes;
  s.stats.device_allocations += 1;
  return c;
}

void free_chunk(State& s, Chunk* c) {
  s.chunks.erase(c->address);
  if (c->mapped) vkUnmapMemory(s.device, c->memory);
  vkDestroyBuffer(s.device, c->buffer, nullptr);
  vkFreeMemory(s.device, c->memory, nullptr);
  s.stats.reserved -= c->size;
  delete c;
}

int small_class(uint64_t bytes) {
  int cls = 0;
  while ((kAlign << cls) < bytes) ++cls;
  return cls;
}

// Large sizes round up to a multiple of 1/8 of their power of two (at most 12.5% more).
uint64_t large_round(uint64_t bytes) {
  uint64_t p = 1;
  while (p < bytes) p <<= 1;
  uint64_t step = std::max<uint64_t>(p / 8, kAlign);
  return (bytes + step - 1) / step * step;
}

[[noreturn]] void oom(State& s, uint64_t bytes, const std::string& why) {
  std::ostringstream o;
  o << "Vulkan out of memory: tried to allocate " << bytes << " bytes (" << human(bytes) << ") on "
    << s.feat.device_name << " (" << why << "; " << human(s.stats.allocated) << " held by tensors, "
    << human(s.stats.reserved) << " reserved, heap " << human(s.heap_bytes[kDevicePool]) << ")";
  TORCH_CHECK_WITH(OutOfMemoryError, false, o.str());
}

Block* allocate_shared_locked(State& s, uint64_t bytes, int pool);

// Take a block out of g's free lists (nullptr when none fits).
Block* take_from_graph(Graph* g, uint64_t bytes) {
  Block* b = nullptr;
  if (bytes <= kSmallMax) {
    auto& fl = g->free_small[small_class(bytes)];
    if (fl.empty()) return nullptr;
    b = fl.back();
    fl.pop_back();
  } else {
    auto it = g->free_large.find(large_round(bytes));
    if (it == g->free_large.end()) return nullptr;
    b = it->second;
    g->free_large.erase(it);
  }
  return b;
}

void adopt(State& s, Graph* g, Block* b) {
  if (b->owner == g) return;
  if (b->owner != nullptr) {
    b->owner->owned.erase(b);
    b->owner->pool_bytes -= b->size;
    s.stats.graph_pool -= b->size;
  }
  b->owner = g;
  g->owned.insert(b);
  g->pool_bytes += b->size;
  s.stats.graph_pool += b->size;
}

// While capturing, device blocks come from the graph's pool first, else from the shared cache or
// the driver, and join the pool.
Block* allocate_locked(State& s, uint64_t bytes, int pool) {
  if (pool != kDevicePool || s.capture == nullptr) return allocate_shared_locked(s, bytes, pool);
  Block* b = take_from_graph(s.capture, bytes);
  if (b != nullptr) {
    s.stats.allocated += b->size;
    s.stats.peak_allocated = std::max(s.stats.peak_allocated, s.stats.allocated);
    s.stats.allocations += 1;
    return b;
  }
  b = allocate_shared_locked(s, bytes, pool);
  adopt(s, s.capture, b);
  return b;
}

Block* allocate_shared_locked(State& s, uint64_t bytes, int pool) {
  Block* b = nullptr;
  if (bytes <= kSmallMax) {
    int cls = small_class(bytes);
    uint64_t size = kAlign << cls;
    auto& fl = s.free_small[pool][cls];
    if (!fl.empty()) {
      b = fl.back();
      fl.pop_back();
    } else {
      Chunk* c = s.carving[pool];
      if (c == nullptr || c->bump + size > c->size) {
        c = new_chunk(s, pool, kChunkBytes);
        if (c == nullptr) {
          release_cached_locked(s);
          c = new_chunk(s, pool, kChunkBytes);
        }
        if (c == nullptr) oom(s, bytes, "a new 16 MiB chunk for small tensors failed");
        s.carving[pool] = c;
      }
      b = new Block();
      b->chunk = c;
      b->address = c->address + c->bump;
      b->size = size;
      b->cls = cls;
      b->pool = pool;
      c->bump += size;
    }
  } else {
    uint64_t size = large_round(bytes);
    auto& fl = s.free_large[pool];
    auto it = fl.find(size);
    if (it != fl.end()) {
      b = it->second;
      fl.erase(it);
    } else {
      if (size > s.heap_bytes[pool]) oom(s, bytes, "more than the whole memory heap");
      if (s.feat.max_allocation_bytes && size > s.feat.max_allocation_bytes)
        oom(s, bytes, "more than the device's maxMemoryAllocationSize of " + human(s.feat.max_allocation_bytes));
      if (s.max_buffer_bytes && size > s.max_buffer_bytes)
        oom(s, bytes, "more than the device's maxBufferSize of " + human(s.max_buffer_bytes));
      Chunk* c = new_chunk(s, pool, size);
      if (c == nullptr) {
        release_cached_locked(s);
        c = new_chunk(s, pool, size);
      }
      if (c == nullptr) oom(s, bytes, "vkAllocateMemory failed");
      c->dedicated = true;
      b = new Block();
      b->chunk = c;
      b->address = c->address;
      b->size = size;
      b->pool = pool;
    }
  }
  if (pool == kDevicePool) {
    s.stats.allocated += b->size;
    s.stats.peak_allocated = std::max(s.stats.peak_allocated, s.stats.allocated);
    s.stats.allocations += 1;
  }
  return b;
}

void recycle_locked(State& s, Block* b) {
  if (b->pool == kDevicePool) s.stats.allocated -= b->size;
  // freed while capturing: the graph may read or write it on replay, so its pool keeps it
  if (b->pool == kDevicePool && s.capture != nullptr) adopt(s, s.capture, b);
  if (Graph* g = b->owner) {
    if (b->cls >= 0) g->free_small[b->cls].push_back(b);
    else g->free_large.emplace(b->size, b);
    return;
  }
  if (b->cls >= 0) s.free_small[b->pool][b->cls].push_back(b);
  else s.free_large[b->pool].emplace(b->size, b);
}

// Free the cached large blocks (their memory goes back to the driver). Waits for the device.
void release_cached_locked(State& s) {
  if (s.capture != nullptr) return;  // cannot wait while capturing: the caller raises out of memory
  synchronize_locked(s);
  for (int pool = 0; pool < kPools; ++pool) {
    for (auto& kv : s.free_large[pool]) {
      free_chunk(s, kv.second->chunk);
      delete kv.second;
    }
    s.free_large[pool].clear();
  }
}

// The chunk holding [addr, addr + bytes) and the offset of addr in it.
Chunk* resolve(State& s, uint64_t addr, uint64_t bytes, uint64_t& offset) {
  auto it = s.chunks.upper_bound(addr);
  TORCH_CHECK(it != s.chunks.begin(), "Vulkan: address 0x", std::hex, addr, " is not vulkan device memory");
  --it;
  Chunk* c = it->second;
  TORCH_CHECK(addr >= c->address && addr + bytes <= c->address + c->size, "Vulkan: range [0x", std::hex, addr,
              ", +", std::dec, bytes, ") is not inside one vulkan allocation");
  offset = addr - c->address;
  return c;
}

void delete_block(void* ctx) {
  if (ctx == nullptr) return;
  State& s = S();
  std::lock_guard<std::recursive_mutex> g(s.mu);
  // In-order queue: later work may reuse the block at once; host writes wait for idle (copy_from_host).
  recycle_locked(s, static_cast<Block*>(ctx));
}

struct VulkanAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    c10::Device dev(c10::DeviceType::PrivateUse1, 0);
    if (nbytes == 0) return c10::DataPtr(nullptr, nullptr, &delete_block, dev);
    State& s = ready_state();
    std::lock_guard<std::recursive_mutex> g(s.mu);
    Block* b = allocate_locked(s, nbytes, kDevicePool);
    return c10::DataPtr(reinterpret_cast<void*>(b->address), b, &delete_block, dev);
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    copy_device(reinterpret_cast<uint64_t>(dest), reinterpret_cast<uint64_t>(src), count);
  }
};

VulkanAllocator g_allocator;

}  // namespace rt

using namespace rt;

uint64_t address(const at::Tensor& t) {
  TORCH_CHECK(t.device().type() == c10::DeviceType::PrivateUse1, "expected a tensor on the vulkan device, got one on ",
              t.device());
  return reinterpret_cast<uint64_t>(t.data_ptr());
}

c10::Allocator* allocator() { return &g_allocator; }

MemoryStats memory_stats() {
  State& s = S();
  std::lock_guard<std::recursive_mutex> g(s.mu);
  return s.stats;
}

void empty_cache() {
  State& s = S();
  std::lock_guard<std::recursive_mutex> g(s.mu);
  refuse_in_capture(s, "empty_cache");
  if (s.ready) release_cached_locked(s);
}

}  // namespace hz::vk
