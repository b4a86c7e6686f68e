#include "fsdp2_ext/safetensors_file.h"

#include "fsdp2_ext/errors.h"
#include "fsdp2_ext/logging.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <tuple>

namespace fsdp2_ext {

namespace {

at::ScalarType safetensors_dtype(
    const std::string& name, const std::string& tensor, const std::string& path) {
  static const std::pair<const char*, at::ScalarType> kTypes[] = {
      {"BF16", at::kBFloat16},
      {"F16", at::kHalf},
      {"F32", at::kFloat},
      {"F64", at::kDouble},
      {"I64", at::kLong},
      {"I32", at::kInt},
      {"I16", at::kShort},
      {"I8", at::kChar},
      {"U8", at::kByte},
      {"BOOL", at::kBool},
      {"F8_E4M3", at::kFloat8_e4m3fn},
      {"F8_E5M2", at::kFloat8_e5m2}};
  for (const auto& [key, type] : kTypes) {
    if (name == key) {
      return type;
    }
  }
  FSDP2_THROW(ValueError, path, ": tensor '", tensor, "' has unsupported dtype '", name, "'");
}

}  // namespace

namespace {

constexpr uint64_t kMaxHeaderBytes =
    100'000'000;  // the format's limit (safetensors' MAX_HEADER_SIZE)
// Deepest nesting of arrays and objects a header may have: serde_json's recursion limit, which
// safetensors' own parser applies. nlohmann's parser recurses per level: a header nested a
// million deep (a small file) would overflow the stack before it could refuse.
constexpr int kMaxHeaderDepth = 128;

// Refuses a header nested deeper than kMaxHeaderDepth, scanning it once without recursion.
void check_header_depth(
    const unsigned char* begin, const unsigned char* end, const std::string& path) {
  int depth = 0;
  bool in_string = false;
  for (const unsigned char* c = begin; c < end; ++c) {
    if (in_string) {
      if (*c == '\\') {
        ++c;  // the escaped character cannot end the string
      } else if (*c == '"') {
        in_string = false;
      }
    } else if (*c == '"') {
      in_string = true;
    } else if (*c == '[' || *c == '{') {
      FSDP2_CHECK_VALUE(
          ++depth <= kMaxHeaderDepth,
          path,
          ": the safetensors header nests arrays or objects deeper than ",
          kMaxHeaderDepth,
          " levels (safetensors' own limit); the file is malformed");
    } else if (*c == ']' || *c == '}') {
      --depth;
    }
  }
}

// A non-negative JSON integer as int64 (floats, negatives and values past int64 are refused).
int64_t header_integer(const nlohmann::json& value, const std::string& what) {
  if (value.is_number_unsigned() && value.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX)) {
    return static_cast<int64_t>(value.get<uint64_t>());
  }
  if (value.is_number_integer() && value.get<int64_t>() >= 0) {
    return value.get<int64_t>();
  }
  FSDP2_THROW(ValueError, what, " must be a non-negative 64-bit integer, got ", value.dump());
}

std::vector<int64_t> header_integers(const nlohmann::json& value, const std::string& what) {
  FSDP2_CHECK_VALUE(value.is_array(), what, " must be a list of integers, got ", value.dump());
  std::vector<int64_t> out;
  for (const auto& item : value) {
    out.push_back(header_integer(item, what));
  }
  return out;
}

// Parses the header, refusing duplicate keys in any object (nlohmann would keep the last one).
nlohmann::json parse_header(
    const unsigned char* begin, const unsigned char* end, const std::string& path) {
  std::vector<std::set<std::string>> keys;
  std::string duplicate;
  auto on_event = [&](int /*depth*/, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start) {
      keys.emplace_back();
    } else if (event == Event::object_end && !keys.empty()) {
      keys.pop_back();
    } else if (event == Event::key && !keys.empty()) {
      duplicate = parsed.get<std::string>();
      FSDP2_CHECK_VALUE(
          keys.back().insert(duplicate).second,
          path,
          ": the safetensors header has the key '",
          duplicate,
          "' twice");
    }
    return true;
  };
  check_header_depth(begin, end, path);
  try {
    return nlohmann::json::parse(begin, end, on_event);
  } catch (const nlohmann::json::exception& error) {
    FSDP2_THROW(ValueError, path, ": malformed safetensors header: ", error.what());
  }
}

void check_metadata(const nlohmann::json& metadata, const std::string& path) {
  FSDP2_CHECK_VALUE(
      metadata.is_object(),
      path,
      ": __metadata__ must be a map of strings to strings, got ",
      metadata.dump());
  for (const auto& [key, value] : metadata.items()) {
    FSDP2_CHECK_VALUE(
        value.is_string(),
        path,
        ": __metadata__['",
        key,
        "'] must be a string, got ",
        value.dump());
  }
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const std::string what = "safetensors file '" + path + "'";
  // O_NONBLOCK: opening a FIFO for reading must not wait for a writer (it is refused below).
  FileDescriptor file = FileDescriptor::open(path, O_RDONLY | O_NONBLOCK, 0, what);
  const struct stat info = file.status(what);
  FSDP2_CHECK_VALUE(
      S_ISREG(info.st_mode),
      path,
      ": not a regular file (a safetensors checkpoint must be a plain file)");
  const int64_t file_size = static_cast<int64_t>(info.st_size);
  FSDP2_CHECK_VALUE(file_size >= 8, path, ": not a safetensors file (", file_size, " bytes)");
  mapping_ = MappedRegion::map(file, 0, file_size, MappedRegion::Access::kReadOnly, what);
  const unsigned char* bytes = mapping_->bytes();
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) {
    header_size = (header_size << 8) | bytes[i];  // little-endian u64
  }
  FSDP2_CHECK_VALUE(
      header_size <= static_cast<uint64_t>(file_size - 8) && header_size <= kMaxHeaderBytes,
      path,
      ": header size ",
      header_size,
      " exceeds the file (",
      file_size,
      " bytes) or the format's limit of ",
      kMaxHeaderBytes);
  data_offset_ = static_cast<int64_t>(8 + header_size);
  const int64_t data_size = file_size - data_offset_;
  const nlohmann::json header = parse_header(bytes + 8, bytes + 8 + header_size, path);
  std::string misaligned;  // the first tensor that cannot be viewed in place, for the log
  FSDP2_CHECK_VALUE(header.is_object(), path, ": safetensors header is not a JSON object");
  for (const auto& [name, spec] : header.items()) {
    if (name == "__metadata__") {
      check_metadata(spec, path);
      continue;
    }
    const std::string what = path + ": tensor '" + name + "'";
    FSDP2_CHECK_VALUE(
        spec.is_object() && spec.contains("dtype") && spec.contains("shape") &&
            spec.contains("data_offsets"),
        what,
        " needs an object with dtype, shape and data_offsets, got ",
        spec.dump());
    FSDP2_CHECK_VALUE(
        spec["dtype"].is_string(), what, ": dtype must be a string, got ", spec["dtype"].dump());
    SafetensorsEntry entry;
    entry.name = name;
    entry.dtype = safetensors_dtype(spec["dtype"].get<std::string>(), name, path);
    entry.shape = header_integers(spec["shape"], what + ": shape");
    const auto offsets = header_integers(spec["data_offsets"], what + ": data_offsets");
    FSDP2_CHECK_VALUE(
        offsets.size() == 2 && offsets[0] <= offsets[1],
        what,
        ": data_offsets must be [begin, end] with begin <= end, got ",
        spec["data_offsets"].dump());
    entry.begin = offsets[0];
    entry.end = offsets[1];
    const int64_t nbytes = checked_nbytes(entry.shape, entry.dtype, what);
    FSDP2_CHECK_VALUE(
        entry.end <= data_size && entry.end - entry.begin == nbytes,
        what,
        " has data_offsets [",
        entry.begin,
        ", ",
        entry.end,
        ") but its shape and dtype need ",
        nbytes,
        " bytes and the data section holds ",
        data_size);
    // Valid by the format, which does not require alignment (Transformers' writer pads, other
    // writers need not): such a tensor is copied out of the mapping, never viewed in place.
    entry.in_place =
        (data_offset_ + entry.begin) % static_cast<int64_t>(c10::elementSize(entry.dtype)) == 0;
    if (!entry.in_place && misaligned.empty()) {
      misaligned = "tensor '" + name + "' starts at file offset " +
                   std::to_string(data_offset_ + entry.begin) +
                   ", not a multiple of its element size " +
                   std::to_string(c10::elementSize(entry.dtype));
    }
    entries_.push_back(std::move(entry));
  }
  // The data section is exactly the tensors, back to back: no overlap, no hole, nothing after.
  std::vector<const SafetensorsEntry*> by_offset;
  for (const auto& entry : entries_) {
    by_offset.push_back(&entry);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](const auto* a, const auto* b) {
    return std::tie(a->begin, a->end) < std::tie(b->begin, b->end);
  });
  if (!misaligned.empty()) {
    const auto copied = std::count_if(
        entries_.begin(), entries_.end(), [](const auto& entry) { return !entry.in_place; });
    log::info(
        path + ": " + std::to_string(copied) + " tensors are not aligned to their element size (" +
        misaligned + "); they are copied out of the mapping instead of viewed in place");
  }
  int64_t expected = 0;
  for (const auto* entry : by_offset) {
    FSDP2_CHECK_VALUE(
        entry->begin == expected,
        path,
        ": tensor '",
        entry->name,
        "' starts at data offset ",
        entry->begin,
        " but ",
        expected,
        " was expected (",
        (entry->begin < expected ? "it overlaps another tensor" : "a hole precedes it"),
        ")");
    expected = entry->end;
  }
  FSDP2_CHECK_VALUE(
      expected == data_size,
      path,
      ": the tensors cover ",
      expected,
      " bytes of a ",
      data_size,
      "-byte data section (trailing bytes)");
}

at::Tensor SafetensorsFile::tensor(const SafetensorsEntry& entry) const {
  if (!entry.in_place) {
    at::Tensor copy = at::empty(entry.shape, at::TensorOptions().dtype(entry.dtype));
    std::memcpy(copy.data_ptr(), mapping_->bytes() + data_offset_ + entry.begin, copy.nbytes());
    return copy;
  }
  return mapping_->view(
      data_offset_ + entry.begin,
      entry.dtype,
      entry.shape,
      path_ + ": tensor '" + entry.name + "'");
}

}  // namespace fsdp2_ext
