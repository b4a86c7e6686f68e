#include "fsdp2_ext/shard_loader.h"

#include "fsdp2_ext/errors.h"
#include "gloo_ranks.h"

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

// The transfer paths on real Gloo ranks (threads of this process over a FileStore), with 1 MiB
// per rank per bucket: a small uneven table and six 400 KiB-per-rank tables (three staged
// buckets, so a slot's parts are reused), one table large enough for direct buckets (> 1 MiB
// per rank, with trailing rows the last rank does not own), one whose last rank owns no row at
// all (an empty direct receive, all padding), and a replicated buffer. The last staged bucket is
// closed after the direct ones (buckets 0, 1 staged; 2-4 direct; 5 staged): direct buckets are
// posted up front, staged ones through the two slots.
constexpr int kMiddles = 6;

std::vector<TargetSpec> transfer_targets() {
  std::vector<TargetSpec> targets{{"small", {}, {10, 33}, at::kFloat, Placement::kShard0}};
  for (int i = 0; i < kMiddles; ++i) {
    targets.push_back(
        {"middle" + std::to_string(i), {}, {300, 1024}, at::kFloat, Placement::kShard0});
  }
  targets.push_back({"large", {}, {1000, 1024}, at::kFloat, Placement::kShard0});
  targets.push_back({"tail", {}, {4, 131072}, at::kFloat, Placement::kShard0});
  targets.push_back({"inv_freq", {}, {8}, at::kFloat, Placement::kReplicate});
  return targets;
}

std::vector<at::Tensor> transfer_state() {
  std::vector<at::Tensor> state{at::arange(10 * 33, at::kFloat).view({10, 33})};
  for (int i = 0; i < kMiddles; ++i) {
    state.push_back(at::arange(300 * 1024, at::kFloat).view({300, 1024}) + i);
  }
  state.push_back(at::arange(1000 * 1024, at::kFloat).view({1000, 1024}) * 0.5);
  state.push_back(at::arange(4 * 131072, at::kFloat).view({4, 131072}) - 7);
  state.push_back(at::linspace(0, 1, 8));
  return state;
}

// Rank `rank`'s padded Shard(0) buffer of `full`, built by hand.
at::Tensor expected_shard(const at::Tensor& full, int64_t world, int64_t rank) {
  const ShardRows rows = shard_rows(full.size(0), world, rank);
  at::Tensor padded = at::zeros_like(full).narrow(0, 0, rows.padded_rows).contiguous();
  padded.narrow(0, 0, rows.rows).copy_(full.narrow(0, rows.row_begin, rows.rows));
  return padded;
}

void expect_loaded(const LoadResult& result, int64_t world, int64_t rank) {
  const auto targets = transfer_targets();
  const auto state = transfer_state();
  ASSERT_EQ(result.tensors.size(), targets.size());
  for (size_t t = 0; t < targets.size(); ++t) {
    const at::Tensor expected = targets[t].placement == Placement::kShard0
                                    ? expected_shard(state[t], world, rank)
                                    : state[t];
    EXPECT_TRUE(at::equal(result.tensors[t], expected)) << targets[t].fqn << " on rank " << rank;
  }
}

std::vector<std::string> transfer_names() {
  std::vector<std::string> names;
  for (const auto& target : transfer_targets()) {
    names.push_back(target.fqn);
  }
  return names;
}

LoadOptions small_buckets() {
  LoadOptions options;
  options.bucket_bytes = int64_t{3} << 20;  // 1 MiB per rank: several buckets, both kinds
  options.timeout_s = 30.0;
  return options;
}

TEST(RankZeroTransfer, EveryRankGetsExactlyItsRowsOnThreeGlooRanks) {
  testing::on_gloo_ranks(3, [](int rank, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
    const bool source = rank == 0;
    const LoadResult result = load_from_rank0(
        group,
        transfer_targets(),
        source ? transfer_names() : std::vector<std::string>{},
        source ? transfer_state() : std::vector<at::Tensor>{},
        small_buckets());
    expect_loaded(result, 3, rank);
    EXPECT_EQ(result.buckets, 3 + 2 + 1);  // staged (2.3 MiB per rank), "large", "tail"
    if (source) {
      EXPECT_GT(result.bytes_sent, 0);
    } else {
      EXPECT_EQ(result.bytes_sent, 0);
    }
  });
}

TEST(LocalLoad, EveryRankCopiesItsRowsOnTwoGlooRanks) {
  testing::on_gloo_ranks(2, [](int rank, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
    expect_loaded(
        load_from_local(group, transfer_targets(), transfer_names(), transfer_state(), {}),
        2,
        rank);
  });
}

TEST(RankZeroTransfer, ABadStateOnRankZeroFailsEveryRankWithItsVerdict) {
  testing::on_gloo_ranks(2, [](int rank, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
    auto state = transfer_state();
    state[kMiddles + 1] = state[kMiddles + 1].narrow(0, 0, 999);  // "large", one row short
    try {
      load_from_rank0(
          group,
          transfer_targets(),
          rank == 0 ? transfer_names() : std::vector<std::string>{},
          rank == 0 ? state : std::vector<at::Tensor>{},
          small_buckets());
      ADD_FAILURE() << "rank " << rank << " loaded a bad state";
    } catch (const ValueError& error) {
      const std::string message = error.what();
      EXPECT_NE(message.find("large (999, 1024) vs model (1000, 1024)"), std::string::npos)
          << message;
      EXPECT_EQ(message.find("(reported by rank 0)") != std::string::npos, rank == 1) << message;
    }
  });
}

// Equal totals, another order: before the digest, the plan agreement compared four totals and
// passed this; the scatter then delivered middle1's rows into rank 1's middle0 without complaint.
TEST(RankZeroTransfer, TargetsInAnotherOrderWithEqualTotalsAreRefusedOnEveryRank) {
  testing::on_gloo_ranks(2, [](int rank, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
    auto targets = transfer_targets();
    if (rank == 1) {
      std::swap(targets[1], targets[2]);
    }
    try {
      load_from_rank0(
          group,
          targets,
          rank == 0 ? transfer_names() : std::vector<std::string>{},
          rank == 0 ? transfer_state() : std::vector<at::Tensor>{},
          small_buckets());
      ADD_FAILURE() << "rank " << rank << " loaded with another rank's targets";
    } catch (const ValueError& error) {
      const std::string message = error.what();
      EXPECT_NE(
          message.find("(the targets' names, shapes, dtypes or placements differ)"),
          std::string::npos)
          << message;
    }
  });
}

TEST(WaitBound, AllowsForTheBytesAtTheBandwidthFloorAndReadsTheKnobs) {
  const WaitBound bound{2.0, int64_t{1} << 30, "rank 0 writing its host's file"};
  EXPECT_EQ(bound.duration().count(), 2000 + 16000);  // 1 GiB at 64 MiB/s
  EXPECT_EQ(
      bound.describe(),
      "18.0 s (floor 2.0 s + 1.00 GiB at 64 MiB/s for rank 0 writing its host's file)");
  EXPECT_EQ(WaitBound{0.25}.describe(), "0.25 s (floor 0.25 s)");
  ::setenv(kMinBandwidthEnv, "1024", 1);
  ::setenv(kWaitFloorEnv, "7.5", 1);
  EXPECT_EQ(bound.duration().count(), 2000 + 1000);
  EXPECT_DOUBLE_EQ(wait_floor_seconds(), 7.5);
  ::setenv(kMinBandwidthEnv, "fast", 1);
  EXPECT_THROW(min_bandwidth_bytes_per_second(), ValueError);
  ::unsetenv(kMinBandwidthEnv);
  ::unsetenv(kWaitFloorEnv);
  EXPECT_DOUBLE_EQ(wait_floor_seconds(), kDefaultTimeoutSeconds);
}

TEST(BroadcastInChunks, ReachesEveryRankInChunks) {
  testing::on_gloo_ranks(3, [](int rank, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
    const at::Tensor expected = at::arange(100000, at::kInt);
    at::Tensor tensor = rank == 1 ? expected.clone() : at::zeros_like(expected);
    EXPECT_EQ(
        broadcast_in_chunks(group, tensor, 65536, /*root=*/1, kDefaultTimeoutSeconds),
        expected.nbytes());
    EXPECT_TRUE(at::equal(tensor, expected));
  });
}

}  // namespace
}  // namespace fsdp2_ext
