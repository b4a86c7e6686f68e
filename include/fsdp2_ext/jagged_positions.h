// Jagged (nested) position IDs with an explicit layout: (values, offsets, ragged_idx), never
// inferred from component shapes. Covers 1-D ids (samples (L_i,)) and multi-row ids such as mRoPE
// (samples (C, L_i), C = 3 or 4 or anything else: nothing here hard-codes C).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

namespace fsdp2_ext {

// [Note: jagged layout]
// A batch of B samples of shape (*rows, L_i) is stored as `values` of shape (*rows, sum L_i)
// packed along its last dim, `offsets` = [0, L_1, L_1+L_2, ...] (int64, B+1 entries) and
// `ragged_idx` = values.dim(): the outer (batched) dim that is ragged, so the packed dim of
// `values` is ragged_idx - 1, as in torch.nested's jagged layout. Shape inference
// (`as_nested_tensor`) picks the first dim whose size differs across samples and falls back to
// dim 1 when none does, so equal lengths, B = 1 and L == C turn the row axis into the "ragged"
// one (coordinate-packed: values (B*C, L), offsets [0, C, 2C, ...], ragged_idx 1); pickling or
// TensorDict consolidation in older releases could also reset ragged_idx to 1 on a correct
// sequence-packed tensor (label-reset). Builders here always set the layout; `repair` turns either
// bad layout back into this one only when exactly one reading fits, and says which two readings it
// saw otherwise.
struct JaggedPositions {
  at::Tensor values;
  at::Tensor offsets;  // int64, (B + 1)
  int64_t ragged_idx = 1;

  int64_t batch_size() const;
  int64_t packed_dim() const {
    return ragged_idx - 1;
  }
  std::vector<int64_t> lengths() const;

  // Throws ValueError naming the broken invariant.
  void validate() const;
  // Only the offsets' own invariants (non-empty 1-D, start at 0, non-decreasing).
  void validate_offsets() const;

  // Per-sample tensors (*rows, L_i): views of `values`.
  std::vector<at::Tensor> split() const;
  // (B, *rows, max_len) filled with `padding_value`; `max_len` < longest sample is an error.
  at::Tensor to_padded(
      double padding_value, std::optional<int64_t> max_len, bool left_padded) const;
  // Consecutive batch chunks (torch.chunk semantics on the batch dim); layouts kept.
  std::vector<JaggedPositions> chunk(int64_t chunks) const;
  JaggedPositions index_select(const std::vector<int64_t>& indices) const;
};

// From per-sample tensors (*rows, L_i): rows must agree, lengths may differ or not.
JaggedPositions jagged_from_list(const std::vector<at::Tensor>& samples);

// From a padded batch (B, L) or (B, *rows, L) and a (B, L) mask (nonzero = real token, left or
// right padding or any pattern: real positions are kept in order).
JaggedPositions jagged_from_padded(const at::Tensor& padded, const at::Tensor& mask);

// Concatenates along the batch; rows and dtypes must agree.
JaggedPositions jagged_concat(const std::vector<JaggedPositions>& parts);

struct RepairResult {
  JaggedPositions positions;
  std::string action;  // "" (already canonical), "coordinate-packed", "label-reset"
};

// Validates, and rebuilds the two bad layouts of [Note: jagged layout] when unambiguous. `rows` is
// the expected number of position rows (C), if known; 0 means 1-D ids.
RepairResult repair_jagged(
    const at::Tensor& values,
    const at::Tensor& offsets,
    int64_t ragged_idx,
    std::optional<int64_t> rows);

}  // namespace fsdp2_ext
