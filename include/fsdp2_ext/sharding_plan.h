// Shard(0) layout math (FSDP2's own chunking, bit for bit) and the bucket packer that groups the
// per-rank byte segments of many tensors into flat transfer buffers. No torch in here: pure math.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp2_ext {

// [Note: shard padding]
// FSDP2 (`FSDPParam._init_sharded_param`) chunks dim 0 with `torch.chunk` padded to the world
// size: every rank owns `ceil(d0 / W)` rows except the trailing ones, which own fewer or none
// (d0 = 5, W = 4 -> 2, 2, 1, 0). Each rank's storage is a zero-filled *padded* buffer of
// `ceil(d0 / W)` rows whose head holds its real rows; the parameter's local tensor is a narrow of
// it, and `_sharded_param_data` is its flat view. We build exactly that buffer, so
// `reset_sharded_param` recognises the storage and copies nothing. Because every rank's padded
// segment has the same size, one flat bucket layout serves all ranks, which is what makes a
// single fixed-size scatter per bucket possible.
struct ShardRows {
  int64_t row_begin = 0;    // first global row owned by the rank
  int64_t rows = 0;         // real rows owned (0 for trailing ranks when d0 < W * chunk)
  int64_t padded_rows = 0;  // ceil(d0 / W): rows of every rank's padded buffer
};

// FSDP2's chunking of a dimension of size `dim0` over `world_size` ranks, for `rank`.
ShardRows shard_rows(int64_t dim0, int64_t world_size, int64_t rank);

enum class Placement { kShard0, kReplicate };

// What the plan needs to know of one tensor.
struct TensorLayout {
  std::string fqn;
  std::vector<int64_t> shape;
  int64_t element_size = 0;
  Placement placement = Placement::kShard0;
};

// One tensor in the plan: its per-rank segment (identical in size on every rank).
struct PlanEntry {
  TensorLayout layout;
  int64_t row_bytes = 0;      // bytes of one dim-0 row (for a 1-D tensor: one element)
  int64_t padded_rows = 0;    // Shard0: ceil(d0 / W); Replicate: d0
  int64_t segment_bytes = 0;  // bytes every rank receives for this tensor

  // Bytes of real data of `rank`'s segment (the rest is zero padding).
  int64_t valid_bytes(int64_t world_size, int64_t rank) const;
  // Offset of `rank`'s segment in the full, contiguous source tensor.
  int64_t source_offset(int64_t world_size, int64_t rank) const;
};

// A contiguous byte range [segment_begin, segment_end) of one entry's segment, placed at
// `bucket_offset` in every rank's part of a bucket.
struct BucketPiece {
  int64_t entry = 0;
  int64_t segment_begin = 0;
  int64_t segment_end = 0;
  int64_t bucket_offset = 0;
};

struct Bucket {
  std::vector<BucketPiece> pieces;
  int64_t bytes_per_rank = 0;
  // One piece of a large segment, moved straight from the source tensor into the destination
  // (no staging, no unpack); see [Note: rank-0 transfer].
  bool direct = false;
};

class ShardingPlan {
 public:
  // `bucket_bytes` bounds one bucket summed over all ranks (what the source rank stages);
  // each rank's part is bucket_bytes / world_size, at least 1 MiB. Large segments are split.
  // Segments of at least `direct_bytes` (0: none) get buckets of their own, marked `direct`.
  ShardingPlan(
      std::vector<TensorLayout> layouts,
      int64_t world_size,
      int64_t bucket_bytes,
      int64_t direct_bytes = 0);

  // Each rank's part of a full bucket: bucket_bytes / world_size, at least 1 MiB.
  static int64_t part_capacity(int64_t bucket_bytes, int64_t world_size);

  int64_t world_size() const {
    return world_size_;
  }
  const std::vector<PlanEntry>& entries() const {
    return entries_;
  }
  const std::vector<Bucket>& buckets() const {
    return buckets_;
  }
  int64_t bytes_per_rank() const;  // sum of segments, padding included
  int64_t source_bytes() const;    // bytes of the full state the plan covers
  // The largest staged (not direct) bucket's bytes per rank: one part of a staging slot. A
  // rank-0 load stages two slots: rank 0 holds world_size - 1 parts in each, the others one.
  int64_t staging_part_bytes() const;
  std::string to_json() const;

 private:
  int64_t world_size_;
  std::vector<PlanEntry> entries_;
  std::vector<Bucket> buckets_;
};

}  // namespace fsdp2_ext
