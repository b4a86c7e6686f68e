#include "fsdp2_ext/shard_loader.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace fsdp2_ext {
namespace {

std::vector<TargetSpec> targets() {
  return {
      {"model.embed_tokens.weight", {"lm_head.weight"}, {10, 4}, at::kBFloat16, Placement::kShard0},
      {"norm.weight", {}, {4}, at::kFloat, Placement::kShard0},
      {"rotary.inv_freq", {}, {2}, at::kFloat, Placement::kReplicate}};
}

TEST(StateValidation, AcceptsAliasKeysAndMatchingState) {
  std::vector<int64_t> index;
  const auto verdict = describe_state_mismatch(
      targets(),
      {"lm_head.weight", "norm.weight", "rotary.inv_freq"},
      {at::zeros({10, 4}, at::kBFloat16), at::zeros({4}), at::zeros({2})},
      &index);
  EXPECT_EQ(verdict, "");
  EXPECT_EQ(index, (std::vector<int64_t>{0, 1, 2}));
}

TEST(StateValidation, NamesEveryKindOfMismatch) {
  const auto verdict = describe_state_mismatch(
      targets(),
      {"model.embed_tokens.weight", "norm.weight", "extra.bias"},
      {at::zeros({10, 5}, at::kBFloat16), at::zeros({4}, at::kDouble), at::zeros({1})});
  EXPECT_NE(verdict.find("1 missing keys: rotary.inv_freq"), std::string::npos) << verdict;
  EXPECT_NE(verdict.find("1 unexpected keys: extra.bias"), std::string::npos) << verdict;
  EXPECT_NE(verdict.find("model.embed_tokens.weight (10, 5) vs model (10, 4)"), std::string::npos)
      << verdict;
  EXPECT_NE(verdict.find("norm.weight Double vs model Float"), std::string::npos) << verdict;
}

TEST(StateValidation, ListsOnlyTheFirstFewKeys) {
  std::vector<TargetSpec> many;
  for (int i = 0; i < 12; ++i) {
    many.push_back({"p" + std::to_string(i), {}, {1}, at::kFloat, Placement::kShard0});
  }
  const auto verdict = describe_state_mismatch(many, {}, {});
  EXPECT_NE(verdict.find("12 missing keys"), std::string::npos);
  EXPECT_NE(verdict.find("(7 more)"), std::string::npos);
}

}  // namespace
}  // namespace fsdp2_ext
