#include "bindings/registrations.h"

#include "fsdp2_ext/alias_map.h"
#include "fsdp2_ext/wrap_targets.h"

#include <pybind11/stl.h>

namespace fsdp2_ext::bindings {
void register_wrap_targets(py::module_& m) {
  py::enum_<WrapReason>(m, "WrapReason", "Why a module is a wrap candidate.")
      .value("LAYER_CLASS", WrapReason::kLayerClass)
      .value("EMBEDDING", WrapReason::kEmbedding)
      .value("EMBEDDING_NAME", WrapReason::kEmbeddingName);
  py::class_<ModuleRecord>(m, "ModuleRecord", "One entry of named_modules() (pre-order).")
      .def(
          py::init([](std::string path,
                      std::string class_name,
                      bool is_embedding,
                      bool has_weight) {
            return ModuleRecord{std::move(path), std::move(class_name), is_embedding, has_weight};
          }),
          py::arg("path"),
          py::arg("class_name"),
          py::arg("is_embedding"),
          py::arg("has_weight"))
      .def_readonly("path", &ModuleRecord::path)
      .def_readonly("class_name", &ModuleRecord::class_name)
      .def_readonly("is_embedding", &ModuleRecord::is_embedding)
      .def_readonly("has_weight", &ModuleRecord::has_weight);
  py::class_<WrapDecision>(m, "WrapDecision")
      .def_readonly("index", &WrapDecision::index, "into the module records")
      .def_readonly("reason", &WrapDecision::reason)
      .def_property_readonly(
          "why",
          [](const WrapDecision& decision) { return std::string(to_string(decision.reason)); },
          "the reason in words")
      .def_readonly(
          "covered_by", &WrapDecision::covered_by, "skipped: the selected ancestor's path");
  py::class_<WrapSelection>(m, "WrapSelection")
      .def_readonly("selected", &WrapSelection::selected)
      .def_readonly("skipped", &WrapSelection::skipped);
  m.def(
      "select_wrap_targets",
      &select_wrap_targets,
      py::arg("modules"),
      py::arg("layer_class_names"),
      py::arg("tie_word_embeddings"),
      "The wrap units among `modules` (named_modules() order); outermost wins, see "
      "[Note: non-overlapping wrap targets].");
  m.def(
      "group_by_identity",
      &group_by_identity,
      py::arg("names"),
      py::arg("tensors"),
      "Groups names by tensor identity, in first-appearance order; names[0] is canonical.");
}

}  // namespace fsdp2_ext::bindings
