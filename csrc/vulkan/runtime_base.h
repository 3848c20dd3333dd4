// Internal to the Vulkan runtime (runtime_*.cpp), shared by its parts: the Vulkan error check and
// the profile clock. Each concern declares its part of the runtime's one global State in its own
// header (runtime_device.h, runtime_memory.h, runtime_record.h, runtime_pipelines.h);
// runtime_state.h joins them.
#pragma once

#include <vulkan/vulkan.h>

#include <c10/util/Exception.h>

#include <chrono>

#include "runtime.h"

namespace hz::vk::rt {

struct State;

// The enumerator name of a VkResult ("VK_ERROR_DEVICE_LOST") for error messages.
const char* vk_result_name(VkResult r);

#define HZ_VK_CHECK(expr)                                                                       \
  do {                                                                                          \
    VkResult hz_r_ = (expr);                                                                    \
    TORCH_CHECK(hz_r_ == VK_SUCCESS, "Vulkan: ", #expr, " failed: ", vk_result_name(hz_r_), " (", \
                static_cast<int>(hz_r_), ")");                                                  \
  } while (0)


using Clock = std::chrono::steady_clock;
inline double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

}  // namespace hz::vk::rt
