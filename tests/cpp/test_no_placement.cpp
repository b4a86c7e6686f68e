#include "fsdp2_ext/errors.h"
#include "fsdp2_ext/no_placement.h"

#include <gtest/gtest.h>

namespace fsdp2_ext {
namespace {

const std::vector<ParameterRecord> kParams = {
    {"model.layers.0.ple.ple_embedding.ngram_embedding.weight", false},
    {"model.layers.0.mlp.weight", true},
    {"model.layers.1.ple.ple_embedding.ngram_embedding.weight", false},
    {"model.my_weight", true}};

TEST(NoPlacement, SuffixMatchesWholeComponentsOnly) {
  EXPECT_TRUE(fqn_has_suffix("a.b.weight", "weight"));
  EXPECT_TRUE(fqn_has_suffix("weight", "weight"));
  EXPECT_FALSE(fqn_has_suffix("a.my_weight", "weight"));
  EXPECT_FALSE(fqn_has_suffix("a.b", ""));
}

TEST(NoPlacement, OneSuffixMatchesEveryLayer) {
  const auto matches = match_no_placement_params(
      {{"", "Qwen4ExpForCausalLM", {"ple.ple_embedding.ngram_embedding.weight"}}}, kParams);
  ASSERT_EQ(matches.size(), 2u);
  EXPECT_EQ(matches[0].parameter_index, 0);
  EXPECT_EQ(matches[1].parameter_index, 2);
}

TEST(NoPlacement, TrainableMatchIsRefused) {
  try {
    match_no_placement_params({{"", "Toy", {"mlp.weight"}}}, kParams);
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot train"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("model.layers.0.mlp.weight"), std::string::npos);
  }
}

TEST(NoPlacement, UnmatchedSuffixMatchesNothing) {
  // A class declares its tables for every config; a model built without them has none.
  EXPECT_TRUE(match_no_placement_params({{"", "Toy", {"nothing.weight"}}}, kParams).empty());
}

TEST(NoPlacement, SuffixIsRelativeToDeclaringModule) {
  // Declared by the module at "model.layers.1": layer 0's table is outside it.
  const auto matches = match_no_placement_params(
      {{"model.layers.1", "Layer", {"ple.ple_embedding.ngram_embedding.weight"}}}, kParams);
  ASSERT_EQ(matches.size(), 1u);
  EXPECT_EQ(matches[0].parameter_index, 2);
  EXPECT_THROW(match_no_placement_params({{"", "Toy", {".weight"}}}, kParams), ValueError);
}

}  // namespace
}  // namespace fsdp2_ext
