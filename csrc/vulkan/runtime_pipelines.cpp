// Pipelines of the Vulkan runtime (runtime.h): the pipeline layout and the compute pipelines
// created once per SPIR-V file.
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

void create_layout(State& s) {
  VkPushConstantRange pcr{VK_SHADER_STAGE_COMPUTE_BIT, 0, kPushBytes};
  VkPipelineLayoutCreateInfo pli{VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO};
  pli.pushConstantRangeCount = 1;
  pli.pPushConstantRanges = &pcr;
  HZ_VK_CHECK(vkCreatePipelineLayout(s.device, &pli, nullptr, &s.layout));
}

}  // namespace rt

using namespace rt;

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

}  // namespace hz::vk
