// Pipelines of the Vulkan runtime: the one pipeline layout (128 bytes of push constants, no
// descriptor sets) and the compute pipelines loaded from <spv_dir>/<name>.spv. Their part of the
// runtime State.
#pragma once

#include <memory>
#include <string>
#include <unordered_map>

#include "runtime_base.h"

namespace hz::vk::rt {

constexpr uint32_t kPushBytes = 128;

struct PipelineState {
  VkPipelineLayout layout = VK_NULL_HANDLE;
  std::unordered_map<std::string, std::unique_ptr<Pipeline>> pipelines;
};

// The pipeline layout, at init() (after the device).
void create_layout(State& s);

}  // namespace hz::vk::rt
