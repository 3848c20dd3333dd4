// The Vulkan runtime's one global State: each concern's part (runtime_device.h, runtime_memory.h,
// runtime_record.h, runtime_pipelines.h) behind one recursive mutex, which every public function
// of runtime.h takes.
#pragma once

#include <mutex>

#include "runtime_device.h"
#include "runtime_memory.h"
#include "runtime_pipelines.h"
#include "runtime_record.h"

namespace hz::vk::rt {

struct State : DeviceState, MemoryState, RecordState, PipelineState {
  std::recursive_mutex mu;
};

// The state (never destroyed: tensors may be freed at interpreter exit).
State& S();
// The state, raising when init() has not succeeded.
State& ready_state();

}  // namespace hz::vk::rt
