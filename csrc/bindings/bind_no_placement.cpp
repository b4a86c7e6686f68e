#include "bindings/registrations.h"

#include "fsdp2_ext/no_placement.h"

#include <pybind11/stl.h>

namespace fsdp2_ext::bindings {

void register_no_placement(py::module_& m) {
  py::class_<NoPlacementDeclaration>(
      m, "NoPlacementDeclaration", "A module class's _no_placement_params, where it sits.")
      .def(
          py::init([](std::string module_path,
                      std::string class_name,
                      std::vector<std::string> suffixes) {
            return NoPlacementDeclaration{
                std::move(module_path), std::move(class_name), std::move(suffixes)};
          }),
          py::arg("module_path"),
          py::arg("class_name"),
          py::arg("suffixes"))
      .def_readonly("module_path", &NoPlacementDeclaration::module_path)
      .def_readonly("class_name", &NoPlacementDeclaration::class_name)
      .def_readonly("suffixes", &NoPlacementDeclaration::suffixes);
  py::class_<ParameterRecord>(m, "ParameterRecord")
      .def(
          py::init([](std::string fqn, bool requires_grad) {
            return ParameterRecord{std::move(fqn), requires_grad};
          }),
          py::arg("fqn"),
          py::arg("requires_grad"))
      .def_readonly("fqn", &ParameterRecord::fqn)
      .def_readonly("requires_grad", &ParameterRecord::requires_grad);
  py::class_<NoPlacementMatch>(m, "NoPlacementMatch")
      .def_readonly("parameter_index", &NoPlacementMatch::parameter_index)
      .def_readonly("suffix", &NoPlacementMatch::suffix);
  m.def(
      "match_no_placement_params",
      &match_no_placement_params,
      py::arg("declarations"),
      py::arg("parameters"),
      "See [Note: no-placement matching]; ValueError for trainable or unmatched entries.");
  m.def("fqn_has_suffix", &fqn_has_suffix, py::arg("fqn"), py::arg("suffix"));
}

}  // namespace fsdp2_ext::bindings
