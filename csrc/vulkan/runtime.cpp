// Vulkan runtime: see runtime.h for the model. One global state behind one mutex.
#include "runtime.h"

#include <vulkan/vulkan.h>

#include <c10/util/Exception.h>

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
struct Graph;
namespace {

constexpr uint32_t kPushBytes = 128;
constexpr uint64_t kAlign = 256;                 // every block starts at a multiple of this
constexpr int kSmallClasses = 13;                // 256 B << 0..12: 256 B .. 1 MiB
constexpr uint64_t kSmallMax = kAlign << (kSmallClasses - 1);
constexpr uint64_t kChunkBytes = 16ull << 20;    // small blocks are carved from 16 MiB chunks
constexpr uint32_t kFlushEvery = 256;            // submit (no wait) after this many commands

const char* vk_result_name(VkResult r) {
  switch (r) {
    case VK_SUCCESS: return "VK_SUCCESS";
    case VK_ERROR_OUT_OF_HOST_MEMORY: return "VK_ERROR_OUT_OF_HOST_MEMORY";
    case VK_ERROR_OUT_OF_DEVICE_MEMORY: return "VK_ERROR_OUT_OF_DEVICE_MEMORY";
    case VK_ERROR_INITIALIZATION_FAILED: return "VK_ERROR_INITIALIZATION_FAILED";
    case VK_ERROR_DEVICE_LOST: return "VK_ERROR_DEVICE_LOST";
    case VK_ERROR_MEMORY_MAP_FAILED: return "VK_ERROR_MEMORY_MAP_FAILED";
    case VK_ERROR_LAYER_NOT_PRESENT: return "VK_ERROR_LAYER_NOT_PRESENT";
    case VK_ERROR_EXTENSION_NOT_PRESENT: return "VK_ERROR_EXTENSION_NOT_PRESENT";
    case VK_ERROR_FEATURE_NOT_PRESENT: return "VK_ERROR_FEATURE_NOT_PRESENT";
    case VK_ERROR_INCOMPATIBLE_DRIVER: return "VK_ERROR_INCOMPATIBLE_DRIVER";
    case VK_ERROR_TOO_MANY_OBJECTS: return "VK_ERROR_TOO_MANY_OBJECTS";
    case VK_ERROR_INVALID_SHADER_NV: return "VK_ERROR_INVALID_SHADER_NV";
    case VK_TIMEOUT: return "VK_TIMEOUT";
    default: return "VkResult";
  }
}

#define HZ_VK_CHECK(expr)                                                                       \
  do {                                                                                          \
    VkResult hz_r_ = (expr);                                                                    \
    TORCH_CHECK(hz_r_ == VK_SUCCESS, "Vulkan: ", #expr, " failed: ", vk_result_name(hz_r_), " (", \
                static_cast<int>(hz_r_), ")");                                                  \
  } while (0)

using Clock = std::chrono::steady_clock;
double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

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

struct Submission {
  VkCommandBuffer cmd = VK_NULL_HANDLE;
  VkFence fence = VK_NULL_HANDLE;
  std::vector<Block*> release;  // staging blocks to recycle once the fence signals
};

}  // namespace

// A recorded command buffer and the private memory pool its baked-in addresses point into.
struct Graph {
  VkCommandBuffer cmd = VK_NULL_HANDLE;
  bool recorded = false;        // capture ended without error: replay() may submit cmd
  std::string error;            // the first refused operation of the capture
  uint64_t dispatches = 0, barriers = 0, copies = 0;
  // private pool: blocks allocated while capturing, or freed while capturing; a freed one goes
  // back to these lists only, so no tensor outside the graph ever gets its memory
  std::vector<Block*> free_small[kSmallClasses];
  std::multimap<uint64_t, Block*> free_large;
  std::unordered_set<Block*> owned;  // live or free
  uint64_t pool_bytes = 0;
};

namespace {

struct State {
  std::recursive_mutex mu;
  bool ready = false;
  std::string spv_dir;
  Features feat;
  bool profile = false;
  Profile prof;

  VkInstance instance = VK_NULL_HANDLE;
  VkPhysicalDevice phys = VK_NULL_HANDLE;
  VkDevice device = VK_NULL_HANDLE;
  VkQueue queue = VK_NULL_HANDLE;
  uint32_t queue_family = 0;
  VkCommandPool cmd_pool = VK_NULL_HANDLE;
  VkPipelineLayout layout = VK_NULL_HANDLE;
  uint32_t mem_type[kPools] = {0, 0};
  uint32_t mem_flags[kPools] = {0, 0};
  uint64_t heap_bytes[kPools] = {0, 0};
  uint64_t max_buffer_bytes = 0;

  // allocator
  std::map<uint64_t, Chunk*> chunks;  // by address
  Chunk* carving[kPools] = {nullptr, nullptr};
  std::vector<Block*> free_small[kPools][kSmallClasses];
  std::multimap<uint64_t, Block*> free_large[kPools];
  MemoryStats stats;

  // recording
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

  std::unordered_map<std::string, std::unique_ptr<Pipeline>> pipelines;
};

State& S() {
  static State* s = new State();  // never destroyed: tensors may be freed at interpreter exit
  return *s;
}

// ------------------------------------------------------------------ device choice

const char* type_name(VkPhysicalDeviceType t) {
  switch (t) {
    case VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU: return "discrete";
    case VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU: return "integrated";
    case VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU: return "virtual";
    case VK_PHYSICAL_DEVICE_TYPE_CPU: return "cpu";
    default: return "other";
  }
}

int type_rank(VkPhysicalDeviceType t) {
  switch (t) {
    case VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU: return 0;
    case VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU: return 1;
    case VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU: return 2;
    case VK_PHYSICAL_DEVICE_TYPE_CPU: return 3;
    default: return 4;
  }
}

struct FeatureQuery {
  VkPhysicalDeviceFeatures2 f2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2};
  VkPhysicalDeviceVulkan11Features f11{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES};
  VkPhysicalDeviceVulkan12Features f12{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES};
  VkPhysicalDeviceVulkan13Features f13{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES};
  bool has13 = false;
#ifdef VK_KHR_shader_bfloat16
  VkPhysicalDeviceShaderBfloat16FeaturesKHR fbf16{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_BFLOAT16_FEATURES_KHR};
#endif
  bool has_bf16_ext = false;

  // Chain the structs the device knows (1.3 ones only on 1.3 devices).
  void chain(uint32_t api, bool bf16_ext) {
    has13 = VK_API_VERSION_MINOR(api) >= 3 || VK_API_VERSION_MAJOR(api) > 1;
    has_bf16_ext = bf16_ext;
    f2.pNext = &f11;
    f11.pNext = &f12;
    void** tail = &f12.pNext;
    if (has13) {
      *tail = &f13;
      tail = &f13.pNext;
    }
#ifdef VK_KHR_shader_bfloat16
    if (has_bf16_ext) {
      *tail = &fbf16;
      tail = &fbf16.pNext;
    }
#endif
    *tail = nullptr;
  }
};

bool has_extension(VkPhysicalDevice pd, const char* name) {
  uint32_t n = 0;
  vkEnumerateDeviceExtensionProperties(pd, nullptr, &n, nullptr);
  std::vector<VkExtensionProperties> ext(n);
  vkEnumerateDeviceExtensionProperties(pd, nullptr, &n, ext.data());
  for (auto& e : ext)
    if (std::strcmp(e.extensionName, name) == 0) return true;
  return false;
}

// The required features pd lacks (empty when it has them all).
std::vector<std::string> missing_features(VkPhysicalDevice pd) {
  VkPhysicalDeviceProperties props;
  vkGetPhysicalDeviceProperties(pd, &props);
  std::vector<std::string> missing;
  if (props.apiVersion < VK_API_VERSION_1_2) {
    missing.push_back("Vulkan 1.2 (the device offers " + std::to_string(VK_API_VERSION_MAJOR(props.apiVersion)) +
                      "." + std::to_string(VK_API_VERSION_MINOR(props.apiVersion)) + ")");
    return missing;
  }
  FeatureQuery q;
  q.chain(props.apiVersion, false);
  vkGetPhysicalDeviceFeatures2(pd, &q.f2);
  if (!q.f12.bufferDeviceAddress) missing.push_back("bufferDeviceAddress");
  if (!q.f12.storageBuffer8BitAccess) missing.push_back("storageBuffer8BitAccess");
  if (!q.f11.storageBuffer16BitAccess) missing.push_back("storageBuffer16BitAccess");
  if (!q.f2.features.shaderInt64) missing.push_back("shaderInt64");
  if (!q.f12.scalarBlockLayout) missing.push_back("scalarBlockLayout");
  uint32_t nq = 0;
  vkGetPhysicalDeviceQueueFamilyProperties(pd, &nq, nullptr);
  std::vector<VkQueueFamilyProperties> qf(nq);
  vkGetPhysicalDeviceQueueFamilyProperties(pd, &nq, qf.data());
  bool compute = false;
  for (auto& f : qf) compute |= (f.queueFlags & VK_QUEUE_COMPUTE_BIT) != 0;
  if (!compute) missing.push_back("a compute queue");
  return missing;
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

std::string device_list(const std::vector<VkPhysicalDevice>& devs) {
  std::string out;
  for (size_t i = 0; i < devs.size(); ++i) {
    VkPhysicalDeviceProperties p;
    vkGetPhysicalDeviceProperties(devs[i], &p);
    out += (i ? ", " : "") + std::to_string(i) + ": " + p.deviceName + " (" + type_name(p.deviceType) + ")";
  }
  return out;
}

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

void init_locked(State& s, const std::string& spv_dir) {
  // ---- instance
  uint32_t loader_api = VK_API_VERSION_1_0;
  vkEnumerateInstanceVersion(&loader_api);
  TORCH_CHECK(loader_api >= VK_API_VERSION_1_2, "Vulkan: the loader supports Vulkan ",
              VK_API_VERSION_MAJOR(loader_api), ".", VK_API_VERSION_MINOR(loader_api), "; 1.2 is required");
  VkApplicationInfo app{VK_STRUCTURE_TYPE_APPLICATION_INFO};
  app.pApplicationName = "hanzo-torch";
  app.pEngineName = "hanzo-torch";
  app.apiVersion = loader_api >= VK_API_VERSION_1_3 ? VK_API_VERSION_1_3 : VK_API_VERSION_1_2;
  std::vector<const char*> inst_ext;
  VkInstanceCreateInfo ici{VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO};
  {
    uint32_t n = 0;
    vkEnumerateInstanceExtensionProperties(nullptr, &n, nullptr);
    std::vector<VkExtensionProperties> ext(n);
    vkEnumerateInstanceExtensionProperties(nullptr, &n, ext.data());
    for (auto& e : ext) {
      if (std::strcmp(e.extensionName, "VK_KHR_portability_enumeration") == 0) {
        inst_ext.push_back("VK_KHR_portability_enumeration");
        ici.flags |= 0x00000001;  // VK_INSTANCE_CREATE_ENUMERATE_PORTABILITY_BIT_KHR
      }
    }
  }
  ici.pApplicationInfo = &app;
  ici.enabledExtensionCount = static_cast<uint32_t>(inst_ext.size());
  ici.ppEnabledExtensionNames = inst_ext.data();
  VkResult r = vkCreateInstance(&ici, nullptr, &s.instance);
  TORCH_CHECK(r == VK_SUCCESS, "Vulkan: no usable driver (vkCreateInstance: ", vk_result_name(r), ")");

  // ---- physical device
  uint32_t n = 0;
  r = vkEnumeratePhysicalDevices(s.instance, &n, nullptr);
  TORCH_CHECK(r == VK_SUCCESS || r == VK_INCOMPLETE, "Vulkan: vkEnumeratePhysicalDevices failed: ", vk_result_name(r));
  std::vector<VkPhysicalDevice> devs(n);
  if (n) vkEnumeratePhysicalDevices(s.instance, &n, devs.data());
  TORCH_CHECK(n > 0, "Vulkan: no Vulkan device found (no driver/ICD for this machine; on Debian/Ubuntu "
              "`apt-get install mesa-vulkan-drivers` provides lavapipe, a CPU device)");
  int chosen = -1;
  const char* env = std::getenv("HANZO_VK_DEVICE");
  if (env && *env) {
    char* end = nullptr;
    long idx = std::strtol(env, &end, 10);
    TORCH_CHECK(end && *end == '\0' && idx >= 0 && idx < static_cast<long>(n), "HANZO_VK_DEVICE=", env,
                ": expected a device index in [0, ", n, "); devices: ", device_list(devs));
    chosen = static_cast<int>(idx);
    auto miss = missing_features(devs[chosen]);
    VkPhysicalDeviceProperties p;
    vkGetPhysicalDeviceProperties(devs[chosen], &p);
    TORCH_CHECK(miss.empty(), "Vulkan: device ", chosen, " (", p.deviceName, ") lacks required feature(s): ",
                join(miss, ", "));
  } else {
    int best_rank = 99;
    std::string why;
    for (uint32_t i = 0; i < n; ++i) {
      VkPhysicalDeviceProperties p;
      vkGetPhysicalDeviceProperties(devs[i], &p);
      auto miss = missing_features(devs[i]);
      if (!miss.empty()) {
        why += std::string(why.empty() ? "" : "; ") + p.deviceName + " lacks " + join(miss, ", ");
        continue;
      }
      if (type_rank(p.deviceType) < best_rank) {
        best_rank = type_rank(p.deviceType);
        chosen = static_cast<int>(i);
      }
    }
    TORCH_CHECK(chosen >= 0, "Vulkan: no device has the required features: ", why);
  }
  s.phys = devs[chosen];

  // ---- properties
  VkPhysicalDeviceProperties2 p2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2};
  VkPhysicalDeviceVulkan11Properties p11{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_PROPERTIES};
  VkPhysicalDeviceVulkan12Properties p12{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_PROPERTIES};
  VkPhysicalDeviceVulkan13Properties p13{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_PROPERTIES};
  VkPhysicalDeviceProperties base;
  vkGetPhysicalDeviceProperties(s.phys, &base);
  bool is13 = base.apiVersion >= VK_API_VERSION_1_3;
  p2.pNext = &p11;
  p11.pNext = &p12;
  p12.pNext = is13 ? &p13 : nullptr;
  vkGetPhysicalDeviceProperties2(s.phys, &p2);
  auto& P = p2.properties;
  Features& F = s.feat;
  F.device_name = P.deviceName;
  F.driver_name = p12.driverName;
  F.api_version = P.apiVersion;
  F.vendor_id = P.vendorID;
  F.device_id = P.deviceID;
  F.device_index = chosen;
  F.device_type = type_name(P.deviceType);
  F.subgroup_size = p11.subgroupSize;
  F.min_subgroup_size = is13 ? p13.minSubgroupSize : p11.subgroupSize;
  F.max_subgroup_size = is13 ? p13.maxSubgroupSize : p11.subgroupSize;
  F.subgroup_arithmetic = (p11.subgroupSupportedStages & VK_SHADER_STAGE_COMPUTE_BIT) &&
                          (p11.subgroupSupportedOperations & VK_SUBGROUP_FEATURE_ARITHMETIC_BIT);
  F.shared_memory_bytes = P.limits.maxComputeSharedMemorySize;
  F.max_workgroup_invocations = P.limits.maxComputeWorkGroupInvocations;
  for (int i = 0; i < 3; ++i) {
    F.max_workgroup_size[i] = P.limits.maxComputeWorkGroupSize[i];
    F.max_workgroup_count[i] = P.limits.maxComputeWorkGroupCount[i];
  }
  F.max_allocation_bytes = p11.maxMemoryAllocationSize;
  s.max_buffer_bytes = is13 ? p13.maxBufferSize : p11.maxMemoryAllocationSize;
  if (is13) {
    VkPhysicalDeviceShaderIntegerDotProductProperties dp{
        VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_INTEGER_DOT_PRODUCT_PROPERTIES};
    VkPhysicalDeviceProperties2 q2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2};
    q2.pNext = &dp;
    vkGetPhysicalDeviceProperties2(s.phys, &q2);
    F.int8_dot_accelerated = dp.integerDotProduct4x8BitPackedSignedAccelerated;
  }

  // ---- features: the required ones and the optional ones the device has
  bool bf16_ext = has_extension(s.phys, "VK_KHR_shader_bfloat16");
#ifndef VK_KHR_shader_bfloat16
  bf16_ext = false;
#endif
  FeatureQuery have;
  have.chain(P.apiVersion, bf16_ext);
  vkGetPhysicalDeviceFeatures2(s.phys, &have.f2);
  FeatureQuery want;
  want.chain(P.apiVersion, bf16_ext);
  want.f2.features.shaderInt64 = VK_TRUE;
  want.f2.features.shaderInt16 = have.f2.features.shaderInt16;
  want.f11.storageBuffer16BitAccess = VK_TRUE;
  want.f12.bufferDeviceAddress = VK_TRUE;
  want.f12.storageBuffer8BitAccess = VK_TRUE;
  want.f12.scalarBlockLayout = VK_TRUE;
  want.f12.shaderFloat16 = have.f12.shaderFloat16;
  want.f12.shaderInt8 = have.f12.shaderInt8;
  if (want.has13) {
    want.f13.shaderIntegerDotProduct = have.f13.shaderIntegerDotProduct;
    want.f13.subgroupSizeControl = have.f13.subgroupSizeControl;
    want.f13.computeFullSubgroups = have.f13.computeFullSubgroups;
  }
#ifdef VK_KHR_shader_bfloat16
  if (bf16_ext) want.fbf16.shaderBFloat16Type = have.fbf16.shaderBFloat16Type;
  F.bfloat16 = bf16_ext && have.fbf16.shaderBFloat16Type;
#endif
  F.float16 = have.f12.shaderFloat16;
  F.int8 = have.f12.shaderInt8;
  F.int16 = have.f2.features.shaderInt16;
  F.int8_dot = want.has13 && have.f13.shaderIntegerDotProduct;

  // ---- queue: the first family with compute
  uint32_t nq = 0;
  vkGetPhysicalDeviceQueueFamilyProperties(s.phys, &nq, nullptr);
  std::vector<VkQueueFamilyProperties> qf(nq);
  vkGetPhysicalDeviceQueueFamilyProperties(s.phys, &nq, qf.data());
  s.queue_family = UINT32_MAX;
  for (uint32_t i = 0; i < nq && s.queue_family == UINT32_MAX; ++i)
    if (qf[i].queueFlags & VK_QUEUE_COMPUTE_BIT) s.queue_family = i;
  float prio = 1.0f;
  VkDeviceQueueCreateInfo qci{VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO};
  qci.queueFamilyIndex = s.queue_family;
  qci.queueCount = 1;
  qci.pQueuePriorities = &prio;
  std::vector<const char*> dev_ext;
  if (bf16_ext && F.bfloat16) dev_ext.push_back("VK_KHR_shader_bfloat16");
  VkDeviceCreateInfo dci{VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO};
  dci.pNext = &want.f2;
  dci.queueCreateInfoCount = 1;
  dci.pQueueCreateInfos = &qci;
  dci.enabledExtensionCount = static_cast<uint32_t>(dev_ext.size());
  dci.ppEnabledExtensionNames = dev_ext.data();
  r = vkCreateDevice(s.phys, &dci, nullptr, &s.device);
  TORCH_CHECK(r == VK_SUCCESS, "Vulkan: vkCreateDevice on ", F.device_name, " failed: ", vk_result_name(r));
  vkGetDeviceQueue(s.device, s.queue_family, 0, &s.queue);

  VkCommandPoolCreateInfo cpi{VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO};
  cpi.flags = VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT;
  cpi.queueFamilyIndex = s.queue_family;
  HZ_VK_CHECK(vkCreateCommandPool(s.device, &cpi, nullptr, &s.cmd_pool));

  VkPushConstantRange pcr{VK_SHADER_STAGE_COMPUTE_BIT, 0, kPushBytes};
  VkPipelineLayoutCreateInfo pli{VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO};
  pli.pushConstantRangeCount = 1;
  pli.pPushConstantRanges = &pcr;
  HZ_VK_CHECK(vkCreatePipelineLayout(s.device, &pli, nullptr, &s.layout));

  bool unified = P.deviceType == VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU || P.deviceType == VK_PHYSICAL_DEVICE_TYPE_CPU;
  choose_memory(s, unified);

  const char* prof = std::getenv("HANZO_VK_PROFILE");
  s.profile = prof && *prof && std::strcmp(prof, "0") != 0;
  s.spv_dir = spv_dir;
  s.ready = true;
}

// ------------------------------------------------------------------ allocator internals

std::string human(uint64_t b) {
  std::ostringstream o;
  o.precision(3);
  if (b >= (1ull << 30)) o << static_cast<double>(b) / (1ull << 30) << " GiB";
  else if (b >= (1ull << 20)) o << static_cast<double>(b) / (1ull << 20) << " MiB";
  else o << b << " bytes";
  return o.str();
}

void release_cached_locked(State& s);
void synchronize_locked(State& s);

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

// ------------------------------------------------------------------ recording internals

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

void submit_locked(State& s, VkCommandBuffer graph = VK_NULL_HANDLE);

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

State& ready_state() {
  State& s = S();
  TORCH_CHECK(s.ready, "the Vulkan runtime is not initialized (import hanzo_torch.backends.vulkan and check its "
              "status())");
  return s;
}

// ------------------------------------------------------------------ torch allocator

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

}  // namespace

// ------------------------------------------------------------------ public API

void init(const std::string& dir) {
  State& s = S();
  std::lock_guard<std::recursive_mutex> g(s.mu);
  if (s.ready) return;
  try {
    init_locked(s, dir);
  } catch (...) {
    if (s.device) vkDestroyDevice(s.device, nullptr);
    if (s.instance) vkDestroyInstance(s.instance, nullptr);
    s.device = VK_NULL_HANDLE;
    s.instance = VK_NULL_HANDLE;
    throw;
  }
}

bool initialized() { return S().ready; }
const std::string& spv_dir() { return S().spv_dir; }
const Features& features() { return ready_state().feat; }

uint64_t address(const at::Tensor& t) {
  TORCH_CHECK(t.device().type() == c10::DeviceType::PrivateUse1, "expected a tensor on the vulkan device, got one on ",
              t.device());
  return reinterpret_cast<uint64_t>(t.data_ptr());
}

Pipeline& pipeline(const std::string& name) {
  State& s = ready_state();
  std::lock_guard<std::recursive_mutex> g(s.mu);
  auto it = s.pipelines.find(name);
  if (it != s.pipelines.end()) return *it->second;
  std::string path = s.spv_dir + "/" + name + ".spv";
  std::ifstream f(path, std::ios::binary);
  TORCH_CHECK(f.good(), "Vulkan: no compiled shader ", path, " (the shader ", name, " is missing or failed to build)");
  std::vector<char> code((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  TORCH_CHECK(!code.empty() && code.size() % 4 == 0, "Vulkan: ", path, " is not SPIR-V (", code.size(), " bytes)");
  VkShaderModuleCreateInfo smi{VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO};
  smi.codeSize = code.size();
  smi.pCode = reinterpret_cast<const uint32_t*>(code.data());
  VkShaderModule mod = VK_NULL_HANDLE;
  VkResult r = vkCreateShaderModule(s.device, &smi, nullptr, &mod);
  TORCH_CHECK(r == VK_SUCCESS, "Vulkan: vkCreateShaderModule(", path, ") failed: ", vk_result_name(r));
  VkComputePipelineCreateInfo cpi{VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO};
  cpi.stage.sType = VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO;
  cpi.stage.stage = VK_SHADER_STAGE_COMPUTE_BIT;
  cpi.stage.module = mod;
  cpi.stage.pName = "main";
  cpi.layout = s.layout;
  VkPipeline pipe = VK_NULL_HANDLE;
  r = vkCreateComputePipelines(s.device, VK_NULL_HANDLE, 1, &cpi, nullptr, &pipe);
  vkDestroyShaderModule(s.device, mod, nullptr);
  TORCH_CHECK(r == VK_SUCCESS, "Vulkan: creating the pipeline of ", path, " failed: ", vk_result_name(r));
  auto p = std::make_unique<Pipeline>();
  p->name = name;
  p->handle = reinterpret_cast<uint64_t>(pipe);
  Pipeline& ref = *p;
  s.pipelines.emplace(name, std::move(p));
  return ref;
}

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

// ------------------------------------------------------------------ graphs

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
