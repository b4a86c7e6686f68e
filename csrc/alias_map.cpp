#include "fsdp2_ext/alias_map.h"

#include "fsdp2_ext/errors.h"

#include <unordered_map>

namespace fsdp2_ext {

std::vector<std::vector<std::string>> group_by_identity(
    const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors) {
  FSDP2_CHECK_VALUE(
      names.size() == tensors.size(),
      "group_by_identity: got ",
      names.size(),
      " names for ",
      tensors.size(),
      " tensors");
  std::vector<std::vector<std::string>> groups;
  std::unordered_map<const c10::TensorImpl*, size_t> group_of;
  for (size_t i = 0; i < names.size(); ++i) {
    FSDP2_CHECK_VALUE(
        tensors[i].defined(), "group_by_identity: tensor '", names[i], "' is undefined (None)");
    const auto* impl = tensors[i].unsafeGetTensorImpl();
    auto [it, inserted] = group_of.emplace(impl, groups.size());
    if (inserted) {
      groups.push_back({names[i]});
    } else {
      groups[it->second].push_back(names[i]);
    }
  }
  return groups;
}

}  // namespace fsdp2_ext
