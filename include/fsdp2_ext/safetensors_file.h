// A read-only, memory-mapped safetensors file: the header is parsed with nlohmann_json and every
// tensor is a zero-copy CPU view of the mapping (the page cache is shared by all local ranks, so
// each rank copying only its rows reads each byte once per host).
#pragma once

#include "fsdp2_ext/mapped_file.h"

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

namespace fsdp2_ext {

struct SafetensorsEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t begin = 0;  // byte offsets relative to the data section
  int64_t end = 0;
  bool in_place = true;  // aligned to its element size: viewed in the mapping, else copied
};

class SafetensorsFile {
 public:
  // Maps `path` read-only; throws ValueError for a malformed file, SystemError for I/O failures.
  explicit SafetensorsFile(const std::string& path);

  const std::string& path() const {
    return path_;
  }
  const std::vector<SafetensorsEntry>& entries() const {
    return entries_;
  }
  // A CPU tensor viewing the mapping (read-only memory: never write to it). It keeps the mapping
  // alive after this object is gone. A tensor not aligned to its element size (valid by the
  // format) is a private copy instead.
  at::Tensor tensor(const SafetensorsEntry& entry) const;

 private:
  std::string path_;
  std::shared_ptr<const MappedRegion> mapping_;
  int64_t data_offset_ = 0;
  std::vector<SafetensorsEntry> entries_;
};

}  // namespace fsdp2_ext
