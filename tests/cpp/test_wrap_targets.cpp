#include "fsdp2_ext/errors.h"
#include "fsdp2_ext/wrap_targets.h"

#include <algorithm>

#include <gtest/gtest.h>

namespace fsdp2_ext {
namespace {

std::vector<ModuleRecord> model_with_nested_embedding() {
  return {
      {"", "Model", false, false},
      {"embed_tokens", "Embedding", true, true},
      {"layers", "ModuleList", false, false},
      {"layers.0", "Block", false, false},
      {"layers.0.table", "Embedding", true, true},
      {"layers.0.proj", "Linear", false, true},
      {"layers.1", "Block", false, false},
      {"lm_head", "Linear", false, true},
  };
}

std::vector<std::string> paths(
    const std::vector<ModuleRecord>& m, const std::vector<WrapDecision>& d) {
  std::vector<std::string> out;
  for (const auto& x : d) {
    out.push_back(m[x.index].path);
  }
  return out;
}

TEST(WrapTargets, OutermostWinsOverNestedEmbedding) {
  const auto modules = model_with_nested_embedding();
  const auto selection = select_wrap_targets(modules, {"Block"}, /*tie=*/false);
  EXPECT_EQ(
      paths(modules, selection.selected),
      (std::vector<std::string>{"embed_tokens", "layers.0", "layers.1", "lm_head"}));
  ASSERT_EQ(selection.skipped.size(), 1u);
  EXPECT_EQ(modules[selection.skipped[0].index].path, "layers.0.table");
  EXPECT_EQ(selection.skipped[0].covered_by, "layers.0");
}

// The negative control: VERL's rule without the ancestor check wraps every candidate, the
// selected and the skipped ones alike, so parent and child both.
TEST(WrapTargets, NaiveSelectionPicksParentAndChild) {
  const auto modules = model_with_nested_embedding();
  const auto selection = select_wrap_targets(modules, {"Block"}, false);
  std::vector<int64_t> naive;
  for (const auto* decisions : {&selection.selected, &selection.skipped}) {
    for (const auto& decision : *decisions) {
      naive.push_back(decision.index);
    }
  }
  std::sort(naive.begin(), naive.end());
  std::vector<std::string> selected;
  for (auto i : naive) {
    selected.push_back(modules[i].path);
  }
  EXPECT_EQ(
      selected,
      (std::vector<std::string>{
          "embed_tokens", "layers.0", "layers.0.table", "layers.1", "lm_head"}));
}

TEST(WrapTargets, TiedWrapsNeitherEmbeddingNorHead) {
  const auto modules = model_with_nested_embedding();
  const auto selection = select_wrap_targets(modules, {"Block"}, /*tie=*/true);
  EXPECT_EQ(paths(modules, selection.selected), (std::vector<std::string>{"layers.0", "layers.1"}));
}

TEST(WrapTargets, MatchesModulesToSaveByNameAndNeverTheRoot) {
  const std::vector<ModuleRecord> modules = {
      {"", "Block", false, true},  // the root is never a candidate, even of a wrap class
      {"base_model.model.model.embed_tokens", "ModulesToSaveWrapper", false, true},
      {"base_model.model.model.embed_tokens.original_module", "Embedding", true, true},
      {"base_model.model.lm_head", "ModulesToSaveWrapper", false, true}};
  const auto selection = select_wrap_targets(modules, {"Block"}, false);
  EXPECT_EQ(
      paths(modules, selection.selected),
      (std::vector<std::string>{
          "base_model.model.model.embed_tokens", "base_model.model.lm_head"}));
  EXPECT_EQ(selection.skipped.size(), 1u);
}

TEST(WrapTargets, PrefixIsNotAncestor) {
  // "layers.1" must not be treated as covering "layers.10".
  const std::vector<ModuleRecord> modules = {
      {"", "M", false, false},
      {"layers.1", "Block", false, false},
      {"layers.10", "Block", false, false}};
  EXPECT_EQ(select_wrap_targets(modules, {"Block"}, false).selected.size(), 2u);
}

TEST(WrapTargets, DuplicatePathIsAnError) {
  const std::vector<ModuleRecord> modules = {
      {"", "M", false, false}, {"a", "B", false, false}, {"a", "B", false, false}};
  EXPECT_THROW(select_wrap_targets(modules, {"B"}, false), ValueError);
}

}  // namespace
}  // namespace fsdp2_ext
