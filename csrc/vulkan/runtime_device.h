// Device choice of the Vulkan runtime: the instance, the physical device (HANZO_VK_DEVICE or the
// best ranked one with the required features), its features, the logical device, the compute
// queue and its command pool. Their part of the runtime State.
#pragma once

#include <string>

#include "runtime_base.h"

namespace hz::vk::rt {

struct DeviceState {
  bool ready = false;  // init() succeeded
  std::string spv_dir;
  Features feat;

  VkInstance instance = VK_NULL_HANDLE;
  VkPhysicalDevice phys = VK_NULL_HANDLE;
  VkDevice device = VK_NULL_HANDLE;
  VkQueue queue = VK_NULL_HANDLE;
  uint32_t queue_family = 0;
  VkCommandPool cmd_pool = VK_NULL_HANDLE;
  uint64_t max_buffer_bytes = 0;
};

}  // namespace hz::vk::rt
