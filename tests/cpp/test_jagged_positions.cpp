#include "fsdp2_ext/errors.h"
#include "fsdp2_ext/jagged_positions.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>

namespace fsdp2_ext {
namespace {

void expect_value_error(const JaggedPositions& positions, const std::string& fragment) {
  try {
    positions.validate();
    FAIL() << "expected ValueError containing '" << fragment << "'";
  } catch (const ValueError& error) {
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
  }
}

TEST(JaggedPositions, FromListSetsTheLayoutExplicitly) {
  // Equal lengths and L == C: exactly where shape inference goes wrong.
  const auto positions =
      jagged_from_list({at::arange(16).view({4, 4}), at::arange(16, 32).view({4, 4})});
  EXPECT_EQ(positions.ragged_idx, 2);
  EXPECT_EQ(positions.values.sizes(), (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(positions.lengths(), (std::vector<int64_t>{4, 4}));
  const auto samples = positions.split();
  EXPECT_TRUE(at::equal(samples[1], at::arange(16, 32).view({4, 4})));
}

TEST(JaggedPositions, FromPaddedLeftPadded) {
  const at::Tensor padded = at::tensor({0, 0, 1, 2, 5, 6, 7, 8}).view({2, 1, 4});
  const at::Tensor mask = at::tensor({0, 0, 1, 1, 1, 1, 1, 1}).view({2, 4});
  const auto positions = jagged_from_padded(padded, mask);
  EXPECT_EQ(positions.lengths(), (std::vector<int64_t>{2, 4}));
  EXPECT_TRUE(at::equal(positions.values, at::tensor({1, 2, 5, 6, 7, 8}).view({1, 6})));
  EXPECT_TRUE(at::equal(positions.to_padded(0, 4, /*left_padded=*/true), padded));
}

TEST(JaggedPositions, MalformedOffsetsAreNamed) {
  const at::Tensor values = at::zeros({3, 7});
  expect_value_error({values, at::tensor({0, 5, 3}), 2}, "non-decreasing");
  expect_value_error({values, at::tensor({2, 7}), 2}, "start at 0");
  expect_value_error({values, at::tensor({0, 6}), 2}, "end at 6");
  expect_value_error({values, at::tensor({0, -1, 7}), 2}, "non-decreasing");
  expect_value_error({values, at::tensor({0, 7}), 3}, "ragged_idx 3");
}

TEST(JaggedPositions, RepairCoordinatePackedAndRejectAmbiguous) {
  // Two (3, 5) samples packed along the row axis: values (6, 5), offsets [0, 3, 6].
  const at::Tensor a = at::arange(15).view({3, 5});
  const at::Tensor b = at::arange(15, 30).view({3, 5});
  const auto repaired = repair_jagged(at::cat({a, b}, 0), at::tensor({0, 3, 6}), 1, 3);
  EXPECT_EQ(repaired.action, "coordinate-packed");
  const auto samples = repaired.positions.split();
  EXPECT_TRUE(at::equal(samples[0], a));
  EXPECT_TRUE(at::equal(samples[1], b));
  // B = 1 and L == C: both readings fit and name the same sample; with C known that is no error.
  const at::Tensor square = at::arange(16).view({4, 4});
  const auto single = repair_jagged(square, at::tensor({0, 4}), 1, 4);
  EXPECT_EQ(single.positions.ragged_idx, 2);
  EXPECT_TRUE(at::equal(single.positions.split()[0], square));
  // Without C the same bytes stay ambiguous for more than one sample.
  EXPECT_THROW(
      repair_jagged(at::zeros({6, 6}), at::tensor({0, 3, 6}), 1, std::nullopt), ValueError);
}

TEST(JaggedPositions, ChunkAndConcatKeepTheLayout) {
  const auto positions = jagged_from_list({at::zeros({3, 2}), at::ones({3, 5}), at::zeros({3, 1})});
  const auto chunks = positions.chunk(2);
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[0].lengths(), (std::vector<int64_t>{2, 5}));
  const auto joined = jagged_concat(chunks);
  EXPECT_TRUE(at::equal(joined.values, positions.values));
  EXPECT_TRUE(at::equal(joined.offsets, positions.offsets));
}

TEST(JaggedPositions, ChunkWithTheLargestCountDoesNotOverflow) {
  const auto positions = jagged_from_list({at::zeros({3, 2}), at::ones({3, 5})});
  const auto chunks =
      positions.chunk(std::numeric_limits<int64_t>::max());  // was UB, then offs[-1]
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[1].lengths(), (std::vector<int64_t>{5}));
}

}  // namespace
}  // namespace fsdp2_ext
