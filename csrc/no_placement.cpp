#include "fsdp2_ext/no_placement.h"

#include "fsdp2_ext/errors.h"

#include <unordered_set>

namespace fsdp2_ext {

bool fqn_has_suffix(const std::string& fqn, const std::string& suffix) {
  if (suffix.empty() || fqn.size() < suffix.size()) {
    return false;
  }
  if (fqn.compare(fqn.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return false;
  }
  return fqn.size() == suffix.size() || fqn[fqn.size() - suffix.size() - 1] == '.';
}

std::vector<NoPlacementMatch> match_no_placement_params(
    const std::vector<NoPlacementDeclaration>& declarations,
    const std::vector<ParameterRecord>& parameters) {
  std::vector<NoPlacementMatch> matches;
  std::unordered_set<int64_t> matched_indices;
  for (const auto& declaration : declarations) {
    const std::string prefix = declaration.module_path.empty() ? "" : declaration.module_path + ".";
    // An entry that matches nothing is no error: the class declares it for every config, and a
    // model built without the module that owns it (qwen4_exp without PLE layers) simply has none,
    // as Transformers' own placement treats it.
    for (const auto& suffix : declaration.suffixes) {
      FSDP2_CHECK_VALUE(
          !suffix.empty() && suffix.front() != '.' && suffix.back() != '.',
          declaration.class_name,
          "._no_placement_params has a malformed entry '",
          suffix,
          "'; entries are parameter FQN suffixes such as "
          "'ple.ple_embedding.ngram_embedding.weight'");
      for (int64_t index = 0; index < static_cast<int64_t>(parameters.size()); ++index) {
        const std::string& fqn = parameters[index].fqn;
        if (fqn.compare(0, prefix.size(), prefix) != 0 ||
            !fqn_has_suffix(fqn.substr(prefix.size()), suffix)) {
          continue;
        }
        FSDP2_CHECK_VALUE(
            !parameters[index].requires_grad,
            "fsdp2_ext cannot train no-placement parameter '",
            fqn,
            "' (matched by ",
            declaration.class_name,
            "._no_placement_params entry '",
            suffix,
            "'): it stays on CPU outside FSDP. Freeze it with requires_grad_(False), or "
            "remove "
            "it from _no_placement_params to shard and train it.");
        if (matched_indices.insert(index).second) {
          matches.push_back(NoPlacementMatch{index, suffix});
        }
      }
    }
  }
  return matches;
}

}  // namespace fsdp2_ext
