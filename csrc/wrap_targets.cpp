#include "fsdp2_ext/wrap_targets.h"

#include "fsdp2_ext/errors.h"

#include <optional>

namespace fsdp2_ext {
namespace {

std::string leaf_name(const std::string& path) {
  const auto dot = path.rfind('.');
  return dot == std::string::npos ? path : path.substr(dot + 1);
}

std::optional<WrapReason> wrap_candidate_reason(
    const ModuleRecord& module,
    const std::unordered_set<std::string>& layer_class_names,
    bool tie_word_embeddings) {
  if (module.path.empty()) {
    return std::nullopt;  // the root is sharded by the caller, last
  }
  if (layer_class_names.count(module.class_name) != 0) {
    return WrapReason::kLayerClass;
  }
  if (tie_word_embeddings) {
    return std::nullopt;  // tied embed/head stay together in the root unit
  }
  if (module.is_embedding) {
    return WrapReason::kEmbedding;
  }
  const std::string leaf = leaf_name(module.path);
  if ((leaf == "embed_tokens" || leaf == "lm_head") && module.has_weight) {
    return WrapReason::kEmbeddingName;
  }
  return std::nullopt;
}

}  // namespace

const char* to_string(WrapReason reason) {
  switch (reason) {
    case WrapReason::kLayerClass:
      return "layer class";
    case WrapReason::kEmbedding:
      return "untied nn.Embedding";
    case WrapReason::kEmbeddingName:
      return "untied embed_tokens/lm_head by name";
  }
  return "?";
}

WrapSelection select_wrap_targets(
    const std::vector<ModuleRecord>& modules,
    const std::unordered_set<std::string>& layer_class_names,
    bool tie_word_embeddings) {
  WrapSelection selection;
  std::unordered_set<std::string> selected_paths;
  std::unordered_set<std::string> seen_paths;
  for (int64_t index = 0; index < static_cast<int64_t>(modules.size()); ++index) {
    const ModuleRecord& module = modules[index];
    FSDP2_CHECK_VALUE(
        seen_paths.insert(module.path).second,
        "select_wrap_targets: module path '",
        module.path,
        "' appears twice; pass named_modules() of one model");
    const auto reason = wrap_candidate_reason(module, layer_class_names, tie_word_embeddings);
    if (!reason) {
      continue;
    }
    // Walk the proper ancestors "a", "a.b", ... of "a.b.c"; see [Note: non-overlapping wrap
    // targets].
    std::string covered_by;
    for (size_t dot = module.path.find('.'); dot != std::string::npos;
         dot = module.path.find('.', dot + 1)) {
      std::string ancestor = module.path.substr(0, dot);
      if (selected_paths.count(ancestor) != 0) {
        covered_by = std::move(ancestor);
        break;
      }
    }
    if (covered_by.empty()) {
      selected_paths.insert(module.path);
      selection.selected.push_back(WrapDecision{index, *reason, {}});
    } else {
      selection.skipped.push_back(WrapDecision{index, *reason, std::move(covered_by)});
    }
  }
  return selection;
}

}  // namespace fsdp2_ext
