// Device choice of the Vulkan runtime (runtime.h): instance, physical device, features, logical
// device and compute queue (init()), and the State that the runtime's parts share.
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

State& S() {
  static State* s = new State();  // never destroyed: tensors may be freed at interpreter exit
  return *s;
}

State& ready_state() {
  State& s = S();
  TORCH_CHECK(s.ready, "the Vulkan runtime is not initialized (import hanzo_torch.backends.vulkan and check its "
              "status())");
  return s;
}

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

  create_layout(s);

  bool unified = P.deviceType == VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU || P.deviceType == VK_PHYSICAL_DEVICE_TYPE_CPU;
  choose_memory(s, unified);

  const char* prof = std::getenv("HANZO_VK_PROFILE");
  s.profile = prof && *prof && std::strcmp(prof, "0") != 0;
  s.spv_dir = spv_dir;
  s.ready = true;
}

}  // namespace rt

using namespace rt;

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

}  // namespace hz::vk
