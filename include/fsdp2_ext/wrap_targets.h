// Selection of FSDP2 wrap units over module paths: VERL's rules, but outermost wins.
#pragma once

#include <string>
#include <unordered_set>
#include <vector>

namespace fsdp2_ext {

// One entry of `named_modules()` (pre-order; the root has the empty path).
struct ModuleRecord {
  std::string path;
  std::string class_name;
  bool is_embedding = false;  // isinstance(module, nn.Embedding)
  bool has_weight = false;    // hasattr(module, "weight")
};

enum class WrapReason { kLayerClass, kEmbedding, kEmbeddingName };

struct WrapDecision {
  int64_t index = 0;  // into the records
  WrapReason reason = WrapReason::kLayerClass;
  std::string covered_by;  // non-empty: a candidate skipped because this ancestor is selected
};

struct WrapSelection {
  std::vector<WrapDecision> selected;
  std::vector<WrapDecision> skipped;
};

// [Note: non-overlapping wrap targets]
// A module is a candidate when its class is in `layer_class_names` (`_no_split_modules` or the
// configured wrap list) or, for untied models, when it is an nn.Embedding or a leaf named
// `embed_tokens` / `lm_head` that has a weight (PEFT's ModulesToSaveWrapper hides the class).
// A candidate whose ancestor is already selected is skipped: FSDP2 would otherwise manage the
// same parameters from two units (an nn.Embedding inside a decoder block), which breaks with
// "Invariant encountered: value was None". The root is never a candidate; the caller shards it
// last. Records must be in pre-order so that ancestors are decided before descendants.
WrapSelection select_wrap_targets(
    const std::vector<ModuleRecord>& modules,
    const std::unordered_set<std::string>& layer_class_names,
    bool tie_word_embeddings);

const char* to_string(WrapReason reason);

}  // namespace fsdp2_ext
