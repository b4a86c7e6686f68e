// How the core writes shapes and lists into messages: once, here.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

namespace fsdp2_ext::detail {

// A shape as Python writes it: (2, 3), (5,), ().
inline std::string shape_string(c10::IntArrayRef shape) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    out << (i ? ", " : "") << shape[i];
  }
  out << (shape.size() == 1 ? ",)" : ")");
  return out.str();
}

inline std::string shape_string(const at::Tensor& tensor) {
  return shape_string(tensor.sizes());
}

// The first `shown` items, comma-separated, then "... (N more)".
inline std::string list_string(const std::vector<std::string>& items, size_t shown = 5) {
  std::ostringstream out;
  for (size_t i = 0; i < std::min(items.size(), shown); ++i) {
    out << (i ? ", " : "") << items[i];
  }
  if (items.size() > shown) {
    out << ", ... (" << items.size() - shown << " more)";
  }
  return out.str();
}

}  // namespace fsdp2_ext::detail
