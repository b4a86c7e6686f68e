// Matching and validation of Transformers' `_no_placement_params`: FQN suffixes of frozen
// parameters that must stay on CPU (Qwen3.8-Flash-Next's ~95 GiB n-gram table).
#pragma once

#include <string>
#include <vector>

namespace fsdp2_ext {

// A `_no_placement_params` declaration of one module class, relative to that module.
struct NoPlacementDeclaration {
  std::string module_path;  // where the declaring module sits ("" for the root)
  std::string class_name;   // the declaring class, for error messages
  std::vector<std::string> suffixes;
};

struct ParameterRecord {
  std::string fqn;
  bool requires_grad = false;
};

struct NoPlacementMatch {
  int64_t parameter_index = 0;  // into the parameter records
  std::string suffix;
};

// [Note: no-placement matching]
// A suffix `s` declared by the module at path `p` matches the parameter FQN `f` when `f` lies
// under `p` and the part of `f` relative to `p` equals `s` or ends with "." + `s` (whole name
// components only: "weight" never matches "my_weight"). One suffix may match many parameters
// (one table per decoder layer). Every suffix must match at least one parameter, and no match
// may require grad: both are ValueErrors naming the suffix / FQN and the declaring class.
std::vector<NoPlacementMatch> match_no_placement_params(
    const std::vector<NoPlacementDeclaration>& declarations,
    const std::vector<ParameterRecord>& parameters);

bool fqn_has_suffix(const std::string& fqn, const std::string& suffix);

}  // namespace fsdp2_ext
