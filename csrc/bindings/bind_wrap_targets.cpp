#include "bindings/registrations.h"

#include "fsdp2_ext/alias_map.h"
#include "fsdp2_ext/wrap_targets.h"

#include <pybind11/stl.h>

namespace fsdp2_ext::bindings {
namespace {

using ModuleTuple = std::tuple<std::string, std::string, bool, bool>;

std::vector<ModuleRecord> to_records(const std::vector<ModuleTuple>& modules) {
  std::vector<ModuleRecord> records;
  records.reserve(modules.size());
  for (const auto& [path, class_name, is_embedding, has_weight] : modules) {
    records.push_back(ModuleRecord{path, class_name, is_embedding, has_weight});
  }
  return records;
}

}  // namespace

void register_wrap_targets(py::module_& m) {
  m.def(
      "select_wrap_targets",
      [](const std::vector<ModuleTuple>& modules,
         const std::unordered_set<std::string>& layer_class_names,
         bool tie_word_embeddings) {
        const WrapSelection selection =
            select_wrap_targets(to_records(modules), layer_class_names, tie_word_embeddings);
        py::list selected, skipped;
        for (const auto& decision : selection.selected) {
          selected.append(py::make_tuple(decision.index, to_string(decision.reason)));
        }
        for (const auto& decision : selection.skipped) {
          skipped.append(
              py::make_tuple(decision.index, to_string(decision.reason), decision.covered_by));
        }
        return py::make_tuple(selected, skipped);
      },
      py::arg("modules"),
      py::arg("layer_class_names"),
      py::arg("tie_word_embeddings"),
      "modules: [(path, class_name, is_embedding, has_weight)] in named_modules() order. Returns "
      "(selected [(index, reason)], skipped [(index, reason, covered_by)]); outermost wins.");
  m.def(
      "select_wrap_targets_naive",
      [](const std::vector<ModuleTuple>& modules,
         const std::unordered_set<std::string>& layer_class_names,
         bool tie_word_embeddings) {
        return select_wrap_targets_naive(
            to_records(modules), layer_class_names, tie_word_embeddings);
      },
      py::arg("modules"),
      py::arg("layer_class_names"),
      py::arg("tie_word_embeddings"),
      "VERL's selection without the ancestor check (negative control).");
  m.def(
      "group_by_identity",
      &group_by_identity,
      py::arg("names"),
      py::arg("tensors"),
      "Groups names by tensor identity, in first-appearance order; names[0] is canonical.");
}

}  // namespace fsdp2_ext::bindings
