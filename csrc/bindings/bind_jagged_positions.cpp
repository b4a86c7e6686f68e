#include "bindings/registrations.h"

#include "fsdp2_ext/jagged_positions.h"

#include <pybind11/stl.h>

namespace fsdp2_ext::bindings {

void register_jagged_positions(py::module_& m) {
  py::class_<JaggedPositions>(
      m,
      "JaggedPositions",
      "The parts of a jagged position-ID tensor: values, int64 offsets (B + 1) and ragged_idx "
      "([Note: jagged layout]).")
      .def(
          py::init([](at::Tensor values, at::Tensor offsets, int64_t ragged_idx) {
            return JaggedPositions{std::move(values), std::move(offsets), ragged_idx};
          }),
          py::arg("values"),
          py::arg("offsets"),
          py::arg("ragged_idx"))
      .def_readonly("values", &JaggedPositions::values)
      .def_readonly("offsets", &JaggedPositions::offsets)
      .def_readonly("ragged_idx", &JaggedPositions::ragged_idx)
      .def_static("from_list", &jagged_from_list, py::arg("samples"))
      .def_static("from_padded", &jagged_from_padded, py::arg("padded"), py::arg("mask"))
      .def_static("concat", &jagged_concat, py::arg("parts"))
      .def("validate", &JaggedPositions::validate)
      .def("split", &JaggedPositions::split)
      .def(
          "to_padded",
          &JaggedPositions::to_padded,
          py::arg("padding_value"),
          py::arg("max_len"),
          py::arg("left_padded"))
      .def("chunk", &JaggedPositions::chunk, py::arg("chunks"))
      .def("index_select", &JaggedPositions::index_select, py::arg("indices"));
  py::class_<RepairResult>(m, "JaggedRepair")
      .def_readonly("positions", &RepairResult::positions)
      .def_readonly(
          "action", &RepairResult::action, "'' (canonical), 'coordinate-packed' or 'label-reset'");
  m.def(
      "repair_jagged",
      &repair_jagged,
      py::arg("values"),
      py::arg("offsets"),
      py::arg("ragged_idx"),
      py::arg("rows"));
}

}  // namespace fsdp2_ext::bindings
