#include "fsdp2_ext/sharding_plan.h"

#include "fsdp2_ext/errors.h"

#include <nlohmann/json.hpp>

#include <algorithm>

namespace fsdp2_ext {

ShardRows shard_rows(int64_t dim0, int64_t world_size, int64_t rank) {
  FSDP2_CHECK_VALUE(
      world_size > 0 && rank >= 0 && rank < world_size,
      "shard_rows: rank ",
      rank,
      " is outside world size ",
      world_size);
  FSDP2_CHECK_VALUE(dim0 >= 0, "shard_rows: negative dimension ", dim0);
  // torch.chunk: chunk size ceil(d0 / W); see [Note: shard padding].
  const int64_t chunk = (dim0 + world_size - 1) / world_size;
  ShardRows result;
  result.padded_rows = chunk;
  result.row_begin = std::min(dim0, rank * chunk);
  result.rows = std::min(dim0, (rank + 1) * chunk) - result.row_begin;
  return result;
}

int64_t PlanEntry::valid_bytes(int64_t world_size, int64_t rank) const {
  if (layout.placement == Placement::kReplicate) {
    return segment_bytes;
  }
  return shard_rows(layout.shape.at(0), world_size, rank).rows * row_bytes;
}

int64_t PlanEntry::source_offset(int64_t world_size, int64_t rank) const {
  if (layout.placement == Placement::kReplicate) {
    return 0;
  }
  return shard_rows(layout.shape.at(0), world_size, rank).row_begin * row_bytes;
}

ShardingPlan::ShardingPlan(
    std::vector<TensorLayout> layouts,
    int64_t world_size,
    int64_t bucket_bytes,
    int64_t direct_bytes)
    : world_size_(world_size) {
  FSDP2_CHECK_VALUE(world_size > 0, "ShardingPlan: world_size must be positive, got ", world_size);
  FSDP2_CHECK_VALUE(
      bucket_bytes > 0, "ShardingPlan: bucket_bytes must be positive, got ", bucket_bytes);
  entries_.reserve(layouts.size());
  for (auto& layout : layouts) {
    FSDP2_CHECK_VALUE(
        layout.element_size > 0, "ShardingPlan: tensor '", layout.fqn, "' has no element size");
    PlanEntry entry;
    if (layout.shape.empty()) {
      // 0-d tensors cannot be Shard(0); FSDP2 rejects them too. Buffers may be 0-d.
      FSDP2_CHECK_VALUE(
          layout.placement != Placement::kShard0,
          "ShardingPlan: tensor '",
          layout.fqn,
          "' is 0-dimensional and cannot be sharded on dim 0; keep it replicated");
      entry.row_bytes = layout.element_size;
      entry.padded_rows = 1;
    } else {
      int64_t row_elements = 1;
      for (size_t i = 1; i < layout.shape.size(); ++i) {
        FSDP2_CHECK_VALUE(
            layout.shape[i] >= 0,
            "ShardingPlan: tensor '",
            layout.fqn,
            "' has a negative dimension");
        row_elements *= layout.shape[i];
      }
      entry.row_bytes = row_elements * layout.element_size;
      entry.padded_rows = layout.placement == Placement::kShard0
                              ? shard_rows(layout.shape[0], world_size, 0).padded_rows
                              : layout.shape[0];
    }
    entry.segment_bytes = entry.padded_rows * entry.row_bytes;
    entry.layout = std::move(layout);
    entries_.push_back(std::move(entry));
  }

  // Greedy packing in declaration order; a segment larger than the space left is split.
  const int64_t per_rank_capacity = part_capacity(bucket_bytes, world_size);
  Bucket current;
  for (int64_t index = 0; index < static_cast<int64_t>(entries_.size()); ++index) {
    const int64_t segment = entries_[index].segment_bytes;
    if (direct_bytes > 0 && segment >= direct_bytes) {
      for (int64_t begin = 0; begin < segment; begin += per_rank_capacity) {
        const int64_t end = std::min(segment, begin + per_rank_capacity);
        buckets_.push_back(Bucket{{BucketPiece{index, begin, end, 0}}, end - begin, true});
      }
      continue;
    }
    int64_t begin = 0;
    while (begin < segment) {
      if (current.bytes_per_rank == per_rank_capacity) {
        buckets_.push_back(std::move(current));
        current = Bucket{};
      }
      const int64_t take = std::min(segment - begin, per_rank_capacity - current.bytes_per_rank);
      current.pieces.push_back(BucketPiece{index, begin, begin + take, current.bytes_per_rank});
      current.bytes_per_rank += take;
      begin += take;
    }
  }
  if (!current.pieces.empty()) {
    buckets_.push_back(std::move(current));
  }
}

int64_t ShardingPlan::part_capacity(int64_t bucket_bytes, int64_t world_size) {
  return std::max<int64_t>(bucket_bytes / world_size, int64_t{1} << 20);
}

int64_t ShardingPlan::bytes_per_rank() const {
  int64_t total = 0;
  for (const auto& entry : entries_) {
    total += entry.segment_bytes;
  }
  return total;
}

int64_t ShardingPlan::staging_part_bytes() const {
  int64_t part = 0;
  for (const auto& bucket : buckets_) {
    part = bucket.direct ? part : std::max(part, bucket.bytes_per_rank);
  }
  return part;
}

int64_t ShardingPlan::source_bytes() const {
  int64_t total = 0;
  for (const auto& entry : entries_) {
    int64_t numel = 1;
    for (int64_t dim : entry.layout.shape) {
      numel *= dim;
    }
    total += numel * entry.layout.element_size;
  }
  return total;
}

std::string ShardingPlan::to_json() const {
  nlohmann::json plan;
  plan["world_size"] = world_size_;
  plan["bytes_per_rank"] = bytes_per_rank();
  plan["source_bytes"] = source_bytes();
  auto& entries = plan["entries"] = nlohmann::json::array();
  for (const auto& entry : entries_) {
    entries.push_back(
        {{"fqn", entry.layout.fqn},
         {"shape", entry.layout.shape},
         {"element_size", entry.layout.element_size},
         {"placement", entry.layout.placement == Placement::kShard0 ? "Shard(0)" : "Replicate()"},
         {"padded_rows", entry.padded_rows},
         {"segment_bytes", entry.segment_bytes}});
  }
  auto& buckets = plan["buckets"] = nlohmann::json::array();
  for (const auto& bucket : buckets_) {
    nlohmann::json pieces = nlohmann::json::array();
    for (const auto& piece : bucket.pieces) {
      pieces.push_back(
          {{"entry", piece.entry},
           {"segment_begin", piece.segment_begin},
           {"segment_end", piece.segment_end},
           {"bucket_offset", piece.bucket_offset}});
    }
    buckets.push_back(
        {{"bytes_per_rank", bucket.bytes_per_rank}, {"direct", bucket.direct}, {"pieces", pieces}});
  }
  return plan.dump();
}

}  // namespace fsdp2_ext
