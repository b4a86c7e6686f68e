#include "fsdp2_ext/state_validation.h"

#include "fsdp2_ext/detail/format.h"

#include <ATen/ATen.h>

#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace fsdp2_ext {
namespace {

void append_examples(
    std::ostringstream& out,
    const char* title,
    const std::vector<std::string>& items,
    const char* fix) {
  if (items.empty()) {
    return;
  }
  out << "\n  " << items.size() << " " << title << ": " << detail::list_string(items) << "\n    -> "
      << fix;
}

}  // namespace

std::string describe_state_mismatch(
    const std::vector<TargetSpec>& targets,
    const std::vector<std::string>& names,
    const std::vector<at::Tensor>& tensors,
    std::vector<int64_t>* source_index,
    bool convert_dtype) {
  if (names.size() != tensors.size()) {
    return detail::concat("full state: ", names.size(), " names for ", tensors.size(), " tensors");
  }
  std::unordered_map<std::string, int64_t> provided;
  for (size_t i = 0; i < names.size(); ++i) {
    provided.emplace(names[i], static_cast<int64_t>(i));
  }
  std::vector<std::string> missing, shape_mismatch, dtype_mismatch, unexpected, not_on_cpu;
  std::unordered_set<std::string> claimed;
  if (source_index) {
    source_index->assign(targets.size(), -1);
  }
  for (size_t t = 0; t < targets.size(); ++t) {
    const TargetSpec& target = targets[t];
    int64_t found = -1;
    auto it = provided.find(target.fqn);
    for (size_t a = 0; it == provided.end() && a < target.aliases.size(); ++a) {
      it = provided.find(target.aliases[a]);  // a tied checkpoint may store only one alias
    }
    if (it != provided.end()) {
      found = it->second;
    }
    claimed.insert(target.fqn);
    claimed.insert(target.aliases.begin(), target.aliases.end());
    if (found < 0) {
      missing.push_back(target.fqn);
      continue;
    }
    const at::Tensor& tensor = tensors[found];
    if (!tensor.defined()) {
      missing.push_back(target.fqn + " (None)");
      continue;
    }
    if (!tensor.is_cpu()) {
      not_on_cpu.push_back(names[found] + " (" + tensor.device().str() + ")");
      continue;
    }
    if (tensor.sizes() != c10::IntArrayRef(target.shape)) {
      shape_mismatch.push_back(
          names[found] + " " + detail::shape_string(tensor.sizes()) + " vs model " +
          detail::shape_string(target.shape));
    } else if (
        tensor.scalar_type() != target.dtype &&
        !(convert_dtype && at::isFloatingType(tensor.scalar_type()) &&
          at::isFloatingType(target.dtype))) {
      dtype_mismatch.push_back(
          detail::concat(names[found], " ", tensor.scalar_type(), " vs model ", target.dtype));
    }
    if (source_index) {
      (*source_index)[t] = found;
    }
  }
  for (const auto& name : names) {
    if (claimed.count(name) == 0) {
      unexpected.push_back(name);
    }
  }
  if (missing.empty() && unexpected.empty() && shape_mismatch.empty() && dtype_mismatch.empty() &&
      not_on_cpu.empty()) {
    return "";
  }
  std::ostringstream out;
  out << "full state does not match the model (" << targets.size() << " model tensors, "
      << names.size() << " provided):";
  append_examples(
      out, "missing keys", missing, "add them to the full state, or build the model that wrote it");
  append_examples(
      out, "unexpected keys", unexpected, "drop them, or rename them to the model's FQNs");
  append_examples(
      out, "shape mismatches", shape_mismatch, "load a checkpoint of the same architecture/config");
  append_examples(
      out,
      "dtype mismatches",
      dtype_mismatch,
      "cast the full state to the model's dtype before loading");
  append_examples(
      out,
      "tensors not on the CPU",
      not_on_cpu,
      "the full state must hold real CPU tensors (a meta model's state_dict() has no values)");
  return out.str();
}

}  // namespace fsdp2_ext
