#include "fsdp2_ext/alias_map.h"
#include "fsdp2_ext/errors.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace fsdp2_ext {
namespace {

TEST(AliasMap, GroupsByIdentityInFirstAppearanceOrder) {
  const at::Tensor embed = at::zeros({4, 2});
  const at::Tensor same_values = at::zeros({4, 2});  // equal values, different object
  const at::Tensor view = embed.view({8});           // shares storage, but is another tensor
  const auto groups = group_by_identity(
      {"model.embed_tokens.weight", "norm.weight", "lm_head.weight", "flat"},
      {embed, same_values, embed, view});
  ASSERT_EQ(groups.size(), 3u);
  EXPECT_EQ(groups[0], (std::vector<std::string>{"model.embed_tokens.weight", "lm_head.weight"}));
  EXPECT_EQ(groups[1], (std::vector<std::string>{"norm.weight"}));
  EXPECT_EQ(groups[2], (std::vector<std::string>{"flat"}));
}

TEST(AliasMap, RejectsMismatchedInput) {
  EXPECT_THROW(group_by_identity({"a"}, {}), ValueError);
  EXPECT_THROW(group_by_identity({"a"}, {at::Tensor()}), ValueError);
}

}  // namespace
}  // namespace fsdp2_ext
