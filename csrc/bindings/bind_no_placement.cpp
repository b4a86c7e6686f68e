#include "bindings/registrations.h"

#include "fsdp2_ext/no_placement.h"

#include <pybind11/stl.h>

namespace fsdp2_ext::bindings {

void register_no_placement(py::module_& m) {
  m.def(
      "match_no_placement_params",
      [](const std::vector<std::tuple<std::string, std::string, std::vector<std::string>>>&
             declarations,
         const std::vector<std::tuple<std::string, bool>>& parameters) {
        std::vector<NoPlacementDeclaration> decls;
        for (const auto& [path, class_name, suffixes] : declarations) {
          decls.push_back(NoPlacementDeclaration{path, class_name, suffixes});
        }
        std::vector<ParameterRecord> params;
        for (const auto& [fqn, requires_grad] : parameters) {
          params.push_back(ParameterRecord{fqn, requires_grad});
        }
        std::vector<std::tuple<int64_t, std::string>> result;
        for (const auto& match : match_no_placement_params(decls, params)) {
          result.emplace_back(match.parameter_index, match.suffix);
        }
        return result;
      },
      py::arg("declarations"),
      py::arg("parameters"),
      "declarations: [(module_path, class_name, suffixes)]; parameters: [(fqn, requires_grad)]. "
      "Returns [(parameter_index, suffix)]; raises ValueError for trainable or unmatched entries.");
  m.def("fqn_has_suffix", &fqn_has_suffix, py::arg("fqn"), py::arg("suffix"));
}

}  // namespace fsdp2_ext::bindings
