#include "bindings/registrations.h"

#include "fsdp2_ext/jagged_positions.h"

#include <pybind11/stl.h>

namespace fsdp2_ext::bindings {
namespace {

using Parts = std::tuple<at::Tensor, at::Tensor, int64_t>;

JaggedPositions from_parts(
    const at::Tensor& values, const at::Tensor& offsets, int64_t ragged_idx) {
  return JaggedPositions{values, offsets, ragged_idx};
}

Parts to_parts(const JaggedPositions& positions) {
  return {positions.values, positions.offsets, positions.ragged_idx};
}

std::vector<Parts> to_parts(const std::vector<JaggedPositions>& list) {
  std::vector<Parts> result;
  for (const auto& positions : list) {
    result.push_back(to_parts(positions));
  }
  return result;
}

}  // namespace

void register_jagged_positions(py::module_& m) {
  m.def(
      "jagged_from_list",
      [](const std::vector<at::Tensor>& samples) { return to_parts(jagged_from_list(samples)); },
      py::arg("samples"));
  m.def(
      "jagged_from_padded",
      [](const at::Tensor& padded, const at::Tensor& mask) {
        return to_parts(jagged_from_padded(padded, mask));
      },
      py::arg("padded"),
      py::arg("mask"));
  m.def(
      "jagged_validate",
      [](const at::Tensor& values, const at::Tensor& offsets, int64_t ragged_idx) {
        from_parts(values, offsets, ragged_idx).validate();
      },
      py::arg("values"),
      py::arg("offsets"),
      py::arg("ragged_idx"));
  m.def(
      "jagged_split",
      [](const at::Tensor& values, const at::Tensor& offsets, int64_t ragged_idx) {
        return from_parts(values, offsets, ragged_idx).split();
      },
      py::arg("values"),
      py::arg("offsets"),
      py::arg("ragged_idx"));
  m.def(
      "jagged_to_padded",
      [](const at::Tensor& values,
         const at::Tensor& offsets,
         int64_t ragged_idx,
         double padding_value,
         std::optional<int64_t> max_len,
         bool left_padded) {
        return from_parts(values, offsets, ragged_idx)
            .to_padded(padding_value, max_len, left_padded);
      },
      py::arg("values"),
      py::arg("offsets"),
      py::arg("ragged_idx"),
      py::arg("padding_value"),
      py::arg("max_len"),
      py::arg("left_padded"));
  m.def(
      "jagged_chunk",
      [](const at::Tensor& values, const at::Tensor& offsets, int64_t ragged_idx, int64_t chunks) {
        return to_parts(from_parts(values, offsets, ragged_idx).chunk(chunks));
      },
      py::arg("values"),
      py::arg("offsets"),
      py::arg("ragged_idx"),
      py::arg("chunks"));
  m.def(
      "jagged_index_select",
      [](const at::Tensor& values,
         const at::Tensor& offsets,
         int64_t ragged_idx,
         const std::vector<int64_t>& indices) {
        return to_parts(from_parts(values, offsets, ragged_idx).index_select(indices));
      },
      py::arg("values"),
      py::arg("offsets"),
      py::arg("ragged_idx"),
      py::arg("indices"));
  m.def(
      "jagged_concat",
      [](const std::vector<Parts>& parts) {
        std::vector<JaggedPositions> list;
        for (const auto& [values, offsets, ragged_idx] : parts) {
          list.push_back(from_parts(values, offsets, ragged_idx));
        }
        return to_parts(jagged_concat(list));
      },
      py::arg("parts"));
  m.def(
      "jagged_repair",
      [](const at::Tensor& values,
         const at::Tensor& offsets,
         int64_t ragged_idx,
         std::optional<int64_t> rows) {
        RepairResult result = repair_jagged(values, offsets, ragged_idx, rows);
        return std::make_tuple(
            result.positions.values,
            result.positions.offsets,
            result.positions.ragged_idx,
            result.action);
      },
      py::arg("values"),
      py::arg("offsets"),
      py::arg("ragged_idx"),
      py::arg("rows"));
}

}  // namespace fsdp2_ext::bindings
