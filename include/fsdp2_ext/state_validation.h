// What every rank checks before data moves: a provided full state against the tensors to build.
#pragma once

#include "fsdp2_ext/sharding_plan.h"

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace fsdp2_ext {

// One tensor to build on every rank.
struct TargetSpec {
  std::string fqn;
  std::vector<std::string> aliases;  // other FQNs of the same tensor, accepted as source keys
  std::vector<int64_t> shape;        // the global (unsharded) shape
  at::ScalarType dtype = at::kFloat;
  Placement placement = Placement::kShard0;
};

// Compares the targets with a provided state (key names, shapes, dtypes). Returns "" when they
// match, else one message naming the missing / unexpected keys and the shape and dtype
// mismatches (the first few of each, with counts). `source_index` receives, per target, the
// index of the provided tensor that feeds it. With `convert_dtype`, a floating-point source of
// another floating-point dtype is accepted (the copy converts it).
std::string describe_state_mismatch(
    const std::vector<TargetSpec>& targets,
    const std::vector<std::string>& names,
    const std::vector<at::Tensor>& tensors,
    std::vector<int64_t>* source_index = nullptr,
    bool convert_dtype = false);

}  // namespace fsdp2_ext
