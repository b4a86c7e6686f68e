#include "fsdp2_ext/safetensors_file.h"

#include "fsdp2_ext/errors.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace fsdp2_ext {

struct SafetensorsFile::Mapping {
  void* address = MAP_FAILED;
  size_t size = 0;
  ~Mapping() {
    if (address != MAP_FAILED && size > 0) {
      munmap(address, size);
    }
  }
};

namespace {

at::ScalarType safetensors_dtype(const std::string& name, const std::string& tensor, const std::string& path) {
  static const std::pair<const char*, at::ScalarType> kTypes[] = {
      {"BF16", at::kBFloat16}, {"F16", at::kHalf},   {"F32", at::kFloat},  {"F64", at::kDouble},
      {"I64", at::kLong},      {"I32", at::kInt},    {"I16", at::kShort},  {"I8", at::kChar},
      {"U8", at::kByte},       {"BOOL", at::kBool},  {"F8_E4M3", at::kFloat8_e4m3fn},
      {"F8_E5M2", at::kFloat8_e5m2}};
  for (const auto& [key, type] : kTypes) {
    if (name == key) {
      return type;
    }
  }
  throw ValueError(path + ": tensor '" + tensor + "' has unsupported dtype '" + name + "'");
}

} // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path), mapping_(std::make_shared<Mapping>()) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw SystemError("cannot open safetensors file '" + path + "'", errno);
  }
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    const int error = errno;
    ::close(fd);
    throw SystemError("cannot stat '" + path + "'", error);
  }
  mapping_->size = static_cast<size_t>(info.st_size);
  if (mapping_->size < 8) {
    ::close(fd);
    throw ValueError(path + ": not a safetensors file (" + std::to_string(mapping_->size) + " bytes)");
  }
  mapping_->address = ::mmap(nullptr, mapping_->size, PROT_READ, MAP_SHARED, fd, 0);
  const int map_error = errno;
  ::close(fd); // the mapping stays valid
  if (mapping_->address == MAP_FAILED) {
    throw SystemError("cannot map '" + path + "'", map_error);
  }
  const auto* bytes = static_cast<const unsigned char*>(mapping_->address);
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) {
    header_size = (header_size << 8) | bytes[i]; // little-endian u64
  }
  if (header_size > mapping_->size - 8) {
    throw ValueError(path + ": header size " + std::to_string(header_size) + " exceeds the file");
  }
  data_offset_ = static_cast<int64_t>(8 + header_size);
  const int64_t data_size = static_cast<int64_t>(mapping_->size) - data_offset_;
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes + 8, bytes + 8 + header_size);
  } catch (const nlohmann::json::exception& error) {
    throw ValueError(path + ": malformed safetensors header: " + error.what());
  }
  if (!header.is_object()) {
    throw ValueError(path + ": safetensors header is not a JSON object");
  }
  for (const auto& [name, spec] : header.items()) {
    if (name == "__metadata__") {
      continue;
    }
    try {
      SafetensorsEntry entry;
      entry.name = name;
      entry.dtype = safetensors_dtype(spec.at("dtype").get<std::string>(), name, path);
      entry.shape = spec.at("shape").get<std::vector<int64_t>>();
      const auto offsets = spec.at("data_offsets").get<std::vector<int64_t>>();
      if (offsets.size() != 2) {
        throw ValueError(path + ": tensor '" + name + "' needs two data_offsets");
      }
      entry.begin = offsets[0];
      entry.end = offsets[1];
      int64_t numel = 1;
      for (int64_t dim : entry.shape) {
        if (dim < 0 || (dim > 0 && numel > (int64_t{1} << 62) / dim)) {
          throw ValueError(path + ": tensor '" + name + "' has an invalid shape");
        }
        numel *= dim;
      }
      if (entry.begin < 0 || entry.end > data_size ||
          entry.end - entry.begin != numel * static_cast<int64_t>(c10::elementSize(entry.dtype))) {
        throw ValueError(
            path + ": tensor '" + name + "' has data_offsets [" + std::to_string(entry.begin) + ", " +
            std::to_string(entry.end) + ") that do not fit its shape and dtype or the file");
      }
      entries_.push_back(std::move(entry));
    } catch (const nlohmann::json::exception& error) {
      throw ValueError(path + ": tensor '" + name + "' has a malformed entry: " + error.what());
    }
  }
}

at::Tensor SafetensorsFile::tensor(const SafetensorsEntry& entry) const {
  auto* data = static_cast<char*>(mapping_->address) + data_offset_ + entry.begin;
  auto keep_alive = mapping_;
  return at::from_blob(
      data, entry.shape, [keep_alive](void*) mutable { keep_alive.reset(); },
      at::TensorOptions().dtype(entry.dtype).device(at::kCPU));
}

} // namespace fsdp2_ext
