#include "fsdp2_ext/jagged_positions.h"

#include "fsdp2_ext/detail/format.h"
#include "fsdp2_ext/errors.h"

#include <ATen/ATen.h>

#include <sstream>

namespace fsdp2_ext {
namespace {

std::vector<int64_t> offsets_vector(const at::Tensor& offsets) {
  const at::Tensor cpu = offsets.to(at::kCPU, at::kLong).contiguous();
  const int64_t* data = cpu.data_ptr<int64_t>();
  return std::vector<int64_t>(data, data + cpu.numel());
}

at::Tensor offsets_tensor(const std::vector<int64_t>& lengths, const at::Device& device) {
  std::vector<int64_t> offsets(lengths.size() + 1, 0);
  for (size_t i = 0; i < lengths.size(); ++i) {
    offsets[i + 1] = offsets[i] + lengths[i];
  }
  return at::tensor(offsets, at::TensorOptions().dtype(at::kLong)).to(device);
}

}  // namespace

int64_t JaggedPositions::batch_size() const {
  return offsets.numel() - 1;
}

std::vector<int64_t> JaggedPositions::lengths() const {
  const auto offs = offsets_vector(offsets);
  std::vector<int64_t> result;
  for (size_t i = 1; i < offs.size(); ++i) {
    result.push_back(offs[i] - offs[i - 1]);
  }
  return result;
}

void JaggedPositions::validate_offsets() const {
  FSDP2_CHECK_VALUE(
      offsets.defined() && offsets.dim() == 1 && offsets.numel() >= 1,
      "jagged positions: offsets must be a 1-D tensor with B + 1 >= 1 entries");
  FSDP2_CHECK_VALUE(
      offsets.scalar_type() == at::kLong || offsets.scalar_type() == at::kInt,
      "jagged positions: offsets must be int64 or int32, got ",
      c10::toString(offsets.scalar_type()));
  const auto offs = offsets_vector(offsets);
  FSDP2_CHECK_VALUE(
      offs.front() == 0, "jagged positions: offsets must start at 0, got ", offs.front());
  for (size_t i = 1; i < offs.size(); ++i) {
    FSDP2_CHECK_VALUE(
        offs[i] >= offs[i - 1],
        "jagged positions: offsets must be non-decreasing, but offsets[",
        i,
        "] = ",
        offs[i],
        " < offsets[",
        i - 1,
        "] = ",
        offs[i - 1]);
  }
}

void JaggedPositions::validate() const {
  FSDP2_CHECK_VALUE(
      values.defined() && offsets.defined(),
      "jagged positions: values and offsets must both be tensors");
  FSDP2_CHECK_VALUE(
      ragged_idx >= 1 && ragged_idx <= values.dim(),
      "jagged positions: ragged_idx ",
      ragged_idx,
      " is outside [1, ",
      values.dim(),
      "] for values of shape ",
      detail::shape_string(values));
  validate_offsets();
  const int64_t end = offsets_vector(offsets).back();
  FSDP2_CHECK_VALUE(
      end == values.size(packed_dim()),
      "jagged positions: offsets end at ",
      end,
      " but values (shape ",
      detail::shape_string(values),
      ") pack ",
      values.size(packed_dim()),
      " positions along dim ",
      packed_dim(),
      " (ragged_idx - 1)");
}

std::vector<at::Tensor> JaggedPositions::split() const {
  validate();
  return values.split_with_sizes(lengths(), packed_dim());
}

at::Tensor JaggedPositions::to_padded(
    double padding_value, std::optional<int64_t> max_len, bool left_padded) const {
  validate();
  const auto lens = lengths();
  int64_t longest = 0;
  for (int64_t length : lens) {
    longest = std::max(longest, length);
  }
  const int64_t width = max_len.value_or(longest);
  FSDP2_CHECK_VALUE(
      width >= longest,
      "to_padded: max_len ",
      width,
      " is shorter than the longest sample (",
      longest,
      ")");
  std::vector<int64_t> shape{batch_size()};
  for (int64_t d = 0; d < values.dim(); ++d) {
    shape.push_back(d == packed_dim() ? width : values.size(d));
  }
  // One pass over the output: each row gets its samples' positions and its padding, nothing twice.
  at::Tensor padded = at::empty(shape, values.options());
  const auto samples = split();
  for (int64_t b = 0; b < batch_size(); ++b) {
    const int64_t start = left_padded ? width - lens[b] : 0;
    at::Tensor row = padded.select(0, b);
    row.narrow(packed_dim(), start, lens[b]).copy_(samples[b]);
    row.narrow(packed_dim(), left_padded ? 0 : lens[b], width - lens[b]).fill_(padding_value);
  }
  return padded;
}

JaggedPositions JaggedPositions::index_select(const std::vector<int64_t>& indices) const {
  validate();
  const auto samples = split();
  std::vector<at::Tensor> picked;
  for (int64_t index : indices) {
    FSDP2_CHECK_VALUE(
        index >= -batch_size() && index < batch_size(),
        "index_select: index ",
        index,
        " is out of range for batch size ",
        batch_size());
    picked.push_back(samples[index < 0 ? index + batch_size() : index]);
  }
  if (picked.empty()) {
    std::vector<int64_t> shape = values.sizes().vec();
    shape[packed_dim()] = 0;
    return JaggedPositions{
        at::empty(shape, values.options()),
        at::zeros({1}, offsets.options().dtype(at::kLong)),
        ragged_idx};
  }
  std::vector<int64_t> lens;
  for (const auto& sample : picked) {
    lens.push_back(sample.size(packed_dim()));
  }
  return JaggedPositions{
      at::cat(picked, packed_dim()), offsets_tensor(lens, offsets.device()), ragged_idx};
}

std::vector<JaggedPositions> JaggedPositions::chunk(int64_t chunks) const {
  validate();
  FSDP2_CHECK_VALUE(chunks > 0, "chunk: chunks must be positive, got ", chunks);
  const int64_t batch = batch_size();
  const int64_t size = batch / chunks + (batch % chunks != 0 ? 1 : 0);  // ceil, without overflow
  const auto offs = offsets_vector(offsets);
  std::vector<JaggedPositions> result;
  for (int64_t begin = 0; begin < batch; begin += size) {
    const int64_t end = std::min(batch, begin + size);
    std::vector<int64_t> lens;
    for (int64_t b = begin; b < end; ++b) {
      lens.push_back(offs[b + 1] - offs[b]);
    }
    result.push_back(JaggedPositions{
        values.narrow(packed_dim(), offs[begin], offs[end] - offs[begin]),
        offsets_tensor(lens, offsets.device()),
        ragged_idx});
  }
  return result;
}

JaggedPositions jagged_from_list(const std::vector<at::Tensor>& samples) {
  FSDP2_CHECK_VALUE(!samples.empty(), "jagged_from_list: need at least one sample");
  const at::Tensor& first = samples.front();
  FSDP2_CHECK_VALUE(
      first.dim() >= 1, "jagged_from_list: samples must have a sequence dim, got a 0-d tensor");
  std::vector<int64_t> lens;
  for (size_t i = 0; i < samples.size(); ++i) {
    const at::Tensor& sample = samples[i];
    FSDP2_CHECK_VALUE(
        sample.dim() == first.dim() &&
            sample.sizes().slice(0, first.dim() - 1) == first.sizes().slice(0, first.dim() - 1),
        "jagged_from_list: sample ",
        i,
        " has shape ",
        detail::shape_string(sample),
        " but sample 0 has ",
        detail::shape_string(first),
        "; only the last (sequence) dim may differ");
    FSDP2_CHECK_VALUE(
        sample.scalar_type() == first.scalar_type(),
        "jagged_from_list: sample ",
        i,
        " has another dtype than sample 0");
    lens.push_back(sample.size(-1));
  }
  return JaggedPositions{at::cat(samples, -1), offsets_tensor(lens, first.device()), first.dim()};
}

JaggedPositions jagged_from_padded(const at::Tensor& padded, const at::Tensor& mask) {
  FSDP2_CHECK_VALUE(
      mask.dim() == 2 && padded.dim() >= 2 && padded.size(0) == mask.size(0) &&
          padded.size(-1) == mask.size(1),
      "jagged_from_padded: padded (B, [rows...], L) ",
      detail::shape_string(padded),
      " and mask (B, L) ",
      detail::shape_string(mask),
      " do not fit together");
  FSDP2_CHECK_VALUE(
      !(mask.numel() > 0 && !at::logical_or(mask == 0, mask == 1).all().item<bool>()),
      "jagged_from_padded: the attention mask must hold only 0 and 1 (a NaN or any other value "
      "is neither keep nor pad)");
  const at::Tensor keep = mask.to(at::kBool);
  const int64_t batch = padded.size(0);
  const int64_t length = padded.size(-1);
  if (length == 0) {  // no positions at all: B empty samples
    std::vector<int64_t> shape(padded.sizes().begin() + 1, padded.sizes().end());
    at::Tensor values = at::empty(shape, padded.options());
    return JaggedPositions{
        values, at::zeros({batch + 1}, at::kLong).to(padded.device()), values.dim()};
  }
  at::Tensor counts = keep.sum(1).to(at::kLong);
  at::Tensor offsets = at::cat({at::zeros({1}, counts.options()), counts.cumsum(0)});
  // Fast path (left or right padding): each row's real positions form one run [first, first +
  // count), which holds iff the running count at the run's last position equals the row's count.
  const at::Tensor first = keep.to(at::kByte).argmax(1);
  const at::Tensor last = (first + counts - 1).clamp_min(0);
  const at::Tensor running = keep.to(at::kLong).cumsum(1).gather(1, last.unsqueeze(1)).squeeze(1);
  if (at::equal(running, counts) && padded.is_cpu()) {
    const auto firsts = offsets_vector(first);
    const auto offs = offsets_vector(offsets);
    std::vector<int64_t> shape(padded.sizes().begin() + 1, padded.sizes().end());
    shape.back() = offs.back();
    at::Tensor values = at::empty(shape, padded.options());
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t count = offs[b + 1] - offs[b];
      if (count > 0) {
        values.narrow(-1, offs[b], count).copy_(padded.select(0, b).narrow(-1, firsts[b], count));
      }
    }
    return JaggedPositions{values, offsets, values.dim()};
  }
  // (B, *rows, L) -> (*rows, B * L), then keep the real positions in order.
  at::Tensor moved = padded.movedim(0, -2).reshape({-1, batch * length});
  at::Tensor values = moved.index_select(1, keep.reshape({-1}).nonzero().squeeze(1));
  std::vector<int64_t> rows(padded.sizes().begin() + 1, padded.sizes().end() - 1);
  rows.push_back(values.size(1));
  values = values.reshape(rows);
  return JaggedPositions{values, offsets, values.dim()};
}

JaggedPositions jagged_concat(const std::vector<JaggedPositions>& parts) {
  FSDP2_CHECK_VALUE(!parts.empty(), "jagged_concat: nothing to concatenate");
  std::vector<at::Tensor> values;
  std::vector<int64_t> lens;
  for (size_t i = 0; i < parts.size(); ++i) {
    parts[i].validate();
    FSDP2_CHECK_VALUE(
        parts[i].ragged_idx == parts[0].ragged_idx &&
            parts[i].values.dim() == parts[0].values.dim() &&
            parts[i].values.scalar_type() == parts[0].values.scalar_type(),
        "jagged_concat: part ",
        i,
        " has another layout than part 0");
    values.push_back(parts[i].values);
    const auto part_lens = parts[i].lengths();
    lens.insert(lens.end(), part_lens.begin(), part_lens.end());
  }
  const int64_t dim = parts[0].packed_dim();
  return JaggedPositions{
      at::cat(values, dim), offsets_tensor(lens, parts[0].offsets.device()), parts[0].ragged_idx};
}

RepairResult repair_jagged(
    const at::Tensor& values,
    const at::Tensor& offsets,
    int64_t ragged_idx,
    std::optional<int64_t> rows) {
  JaggedPositions given{values, offsets, ragged_idx};
  const bool one_d = rows.has_value() && *rows == 0;
  if (one_d || values.dim() == 1) {
    given.validate();
    return {given, ""};
  }
  if (values.dim() != 2) {
    given.validate();
    return {given, ""};
  }
  // The offsets themselves must be sound whatever the reading (non-empty, from 0, non-decreasing).
  JaggedPositions{values, offsets, values.dim()}.validate_offsets();
  const auto offs = offsets_vector(offsets);
  const int64_t batch = static_cast<int64_t>(offs.size()) - 1;
  if (ragged_idx == 2) {
    given.validate();
    FSDP2_CHECK_VALUE(
        !rows || values.size(0) == *rows,
        "jagged positions: values have ",
        values.size(0),
        " rows but ",
        *rows,
        " position rows were expected");
    return {given, ""};
  }
  if (ragged_idx != 1) {
    given.validate();
    return {given, ""};
  }
  // Two readings of a 2-D, ragged@1 tensor; see [Note: jagged layout].
  bool coordinate_packed =
      rows.has_value() && *rows > 0 && batch > 0 && values.size(0) == batch * *rows;
  for (int64_t b = 0; coordinate_packed && b <= batch; ++b) {
    coordinate_packed = offs[b] == b * *rows;
  }
  const bool label_reset = offs.back() == values.size(1) && (!rows || values.size(0) == *rows);
  FSDP2_CHECK_VALUE(
      rows || !label_reset || offs.back() != values.size(0),
      "jagged positions: ragged_idx 1 with values ",
      detail::shape_string(values),
      " is ambiguous without the number of position rows: it is valid as packed along dim 0 and "
      "as a label-reset tensor packed along dim 1; pass rows=C");
  std::ostringstream readings;
  readings << "(a) coordinate-packed: " << batch << " samples of shape (" << (rows ? *rows : -1)
           << ", " << values.size(1) << "); (b) label-reset: " << batch << " samples of "
           << values.size(0) << " rows packed along dim 1 with offsets ending at " << offs.back();
  if (coordinate_packed && label_reset && rows) {
    // With C known both readings fit only for one sample with L == C ((C, C) values, offsets
    // [0, C]): they name the same sample, so there is nothing to choose.
    JaggedPositions fixed{values, offsets, 2};
    fixed.validate();
    return {fixed, "label-reset"};
  }
  FSDP2_CHECK_VALUE(
      !coordinate_packed || !label_reset,
      "jagged positions: ragged_idx 1 with values ",
      detail::shape_string(values),
      " is ambiguous, both readings fit: ",
      readings.str(),
      ". Build the batch with fsdp2_ext.positions.nested_from_list/nested_from_padded so the "
      "layout is explicit.");
  if (coordinate_packed) {
    const int64_t c = *rows;
    const int64_t length = values.size(1);
    at::Tensor canonical =
        values.reshape({batch, c, length}).permute({1, 0, 2}).reshape({c, batch * length});
    std::vector<int64_t> lens(batch, length);
    return {
        JaggedPositions{canonical, offsets_tensor(lens, offsets.device()), 2}, "coordinate-packed"};
  }
  if (label_reset) {
    JaggedPositions fixed{values, offsets, 2};
    fixed.validate();
    return {fixed, "label-reset"};
  }
  // A self-consistent ragged@1 tensor of position IDs without known rows stays as it is.
  given.validate();
  FSDP2_CHECK_VALUE(
      !rows,
      "jagged positions: values ",
      detail::shape_string(values),
      " with offsets ending at ",
      offs.back(),
      " and ragged_idx 1 fit neither reading: ",
      readings.str());
  return {given, ""};
}

}  // namespace fsdp2_ext
