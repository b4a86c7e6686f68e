#include "fsdp2_ext/errors.h"
#include "fsdp2_ext/sharding_plan.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace fsdp2_ext {
namespace {

// Hand-computed torch.chunk + _chunk_with_empty results.
struct RowsCase {
  int64_t dim0, world, rank, begin, rows, padded;
};

TEST(ShardRows, MatchesFsdp2Chunking) {
  const RowsCase cases[] = {
      {8, 2, 0, 0, 4, 4},
      {8, 2, 1, 4, 4, 4},  // even
      {5, 4, 0, 0, 2, 2},
      {5, 4, 2, 4, 1, 2},
      {5, 4, 3, 5, 0, 2},  // 2,2,1,0
      {6, 4, 3, 6, 0, 2},
      {6, 4, 2, 4, 2, 2},  // torch.chunk gives 3 chunks of 2
      {1, 2, 0, 0, 1, 1},
      {1, 2, 1, 1, 0, 1},  // dim0 < world
      {3, 4, 3, 3, 0, 1},
      {0, 2, 1, 0, 0, 0},  // empty tensor
      {37, 2, 1, 19, 18, 19}};
  for (const auto& c : cases) {
    const ShardRows rows = shard_rows(c.dim0, c.world, c.rank);
    EXPECT_EQ(rows.row_begin, c.begin) << c.dim0 << "/" << c.world << "@" << c.rank;
    EXPECT_EQ(rows.rows, c.rows) << c.dim0 << "/" << c.world << "@" << c.rank;
    EXPECT_EQ(rows.padded_rows, c.padded) << c.dim0 << "/" << c.world << "@" << c.rank;
  }
}

TEST(ShardRows, RejectsBadRank) {
  EXPECT_THROW(shard_rows(4, 2, 2), ValueError);
  EXPECT_THROW(shard_rows(4, 0, 0), ValueError);
  EXPECT_THROW(shard_rows(-1, 2, 0), ValueError);
}

TEST(ShardingPlan, SegmentsAndValidBytes) {
  ShardingPlan plan(
      {{"w", {5, 3}, 2, Placement::kShard0},
       {"bias", {7}, 4, Placement::kShard0},
       {"inv_freq", {4}, 4, Placement::kReplicate}},
      4,
      int64_t{1} << 30);
  const auto& e = plan.entries();
  EXPECT_EQ(e[0].row_bytes, 6);
  EXPECT_EQ(e[0].segment_bytes, 12);  // 2 padded rows
  EXPECT_EQ(e[0].valid_bytes(4, 2), 6);
  EXPECT_EQ(e[0].valid_bytes(4, 3), 0);
  EXPECT_EQ(e[0].source_offset(4, 2), 24);
  EXPECT_EQ(e[1].segment_bytes, 8);  // 1-D: ceil(7/4)=2 elements
  EXPECT_EQ(e[1].valid_bytes(4, 3), 4);
  EXPECT_EQ(e[2].segment_bytes, 16);
  EXPECT_EQ(e[2].valid_bytes(4, 3), 16);
  EXPECT_EQ(plan.bytes_per_rank(), 36);
  EXPECT_EQ(plan.source_bytes(), 30 + 28 + 16);
  ASSERT_EQ(plan.buckets().size(), 1u);
  EXPECT_EQ(plan.buckets()[0].bytes_per_rank, 36);
}

TEST(ShardingPlan, BucketPackerSplitsLargeSegments) {
  const int64_t mib = int64_t{1} << 20;
  // world 2, bucket 4 MiB -> 2 MiB per rank part; a 3 MiB segment is split over two buckets.
  ShardingPlan plan(
      {{"a", {6 * 1024, 1024}, 1, Placement::kShard0},  // 3 MiB per rank
       {"b", {2 * 1024, 512}, 1, Placement::kShard0}},  // 0.5 MiB per rank
      2,
      4 * mib);
  const auto& buckets = plan.buckets();
  ASSERT_EQ(buckets.size(), 2u);
  EXPECT_EQ(buckets[0].bytes_per_rank, 2 * mib);
  ASSERT_EQ(buckets[0].pieces.size(), 1u);
  EXPECT_EQ(buckets[0].pieces[0].segment_end, 2 * mib);
  ASSERT_EQ(buckets[1].pieces.size(), 2u);
  EXPECT_EQ(buckets[1].pieces[0].segment_begin, 2 * mib);
  EXPECT_EQ(buckets[1].pieces[0].segment_end, 3 * mib);
  EXPECT_EQ(buckets[1].pieces[1].entry, 1);
  EXPECT_EQ(buckets[1].pieces[1].bucket_offset, mib);
  // Every byte of every segment is covered exactly once.
  int64_t covered = 0;
  for (const auto& bucket : buckets) {
    for (const auto& piece : bucket.pieces) {
      covered += piece.segment_end - piece.segment_begin;
    }
  }
  EXPECT_EQ(covered, plan.bytes_per_rank());
  const auto json = nlohmann::json::parse(plan.to_json());
  EXPECT_EQ(json["buckets"].size(), 2u);
  EXPECT_EQ(json["entries"][0]["placement"], "Shard(0)");
}

TEST(ShardingPlan, RejectsZeroDimShard) {
  EXPECT_THROW(ShardingPlan({{"scalar", {}, 4, Placement::kShard0}}, 2, 1 << 20), ValueError);
  ShardingPlan ok({{"scalar", {}, 4, Placement::kReplicate}}, 2, 1 << 20);
  EXPECT_EQ(ok.entries()[0].segment_bytes, 4);
}

}  // namespace
}  // namespace fsdp2_ext
