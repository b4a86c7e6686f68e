#include "fsdp2_ext/no_placement.h"

#include "fsdp2_ext/errors.h"

#include <sstream>
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
    for (const auto& suffix : declaration.suffixes) {
      if (suffix.empty() || suffix.front() == '.' || suffix.back() == '.') {
        FSDP2_THROW(
            ValueError,
            declaration.class_name + "._no_placement_params has a malformed entry '" + suffix +
                "'; entries are parameter FQN suffixes such as "
                "'ple.ple_embedding.ngram_embedding.weight'");
      }
      int64_t count = 0;
      for (int64_t index = 0; index < static_cast<int64_t>(parameters.size()); ++index) {
        const std::string& fqn = parameters[index].fqn;
        if (fqn.compare(0, prefix.size(), prefix) != 0 ||
            !fqn_has_suffix(fqn.substr(prefix.size()), suffix)) {
          continue;
        }
        ++count;
        if (parameters[index].requires_grad) {
          FSDP2_THROW(
              ValueError,
              "fsdp2_ext cannot train no-placement parameter '" + fqn + "' (matched by " +
                  declaration.class_name + "._no_placement_params entry '" + suffix +
                  "'): it stays on CPU outside FSDP. Freeze it with requires_grad_(False), or "
                  "remove "
                  "it from _no_placement_params to shard and train it.");
        }
        if (matched_indices.insert(index).second) {
          matches.push_back(NoPlacementMatch{index, suffix});
        }
      }
      if (count == 0) {
        std::ostringstream message;
        message << declaration.class_name << "._no_placement_params entry '" << suffix
                << "' matches no parameter";
        if (!declaration.module_path.empty()) {
          message << " under '" << declaration.module_path << "'";
        }
        message << " (" << parameters.size()
                << " parameters searched). Fix the suffix, or check that the model was built with "
                   "the module that owns it.";
        FSDP2_THROW(ValueError, message.str());
      }
    }
  }
  return matches;
}

}  // namespace fsdp2_ext
