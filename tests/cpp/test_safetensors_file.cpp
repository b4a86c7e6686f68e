#include "fsdp2_ext/errors.h"
#include "fsdp2_ext/safetensors_file.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <unistd.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>

namespace fsdp2_ext {
namespace {

// The header is padded with spaces to a multiple of 8 bytes, as safetensors writers do, so the
// data section (and every tensor in it) starts aligned.
std::string write_file(std::string header, const std::string& data) {
  char name[] = "/tmp/fsdp2_ext_test_XXXXXX";
  const int fd = mkstemp(name);
  ::close(fd);
  std::ofstream out(name, std::ios::binary);
  header.append((8 - header.size() % 8) % 8, ' ');
  uint64_t size = header.size();
  for (int i = 0; i < 8; ++i) {
    out.put(static_cast<char>((size >> (8 * i)) & 0xff));
  }
  out << header << data;
  return name;
}

TEST(SafetensorsFile, MapsTensorsWithoutCopying) {
  std::string data(8, '\0');
  const float values[2] = {1.5f, -2.0f};
  std::memcpy(data.data(), values, 8);
  const auto path = write_file(
      R"({"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
      data);
  at::Tensor tensor;
  {
    SafetensorsFile file(path);
    ASSERT_EQ(file.entries().size(), 1u);
    tensor = file.tensor(file.entries()[0]);
  }  // the tensor keeps the mapping alive
  std::remove(path.c_str());
  EXPECT_TRUE(at::equal(tensor, at::tensor({1.5f, -2.0f})));
}

TEST(SafetensorsFile, RejectsMalformedFiles) {
  const auto bad_json = write_file("{not json", "");
  EXPECT_THROW(SafetensorsFile{bad_json}, ValueError);
  const auto bad_offsets =
      write_file(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}})", std::string(8, '\0'));
  EXPECT_THROW(SafetensorsFile{bad_offsets}, ValueError);
  // Signed-overflow sizes (UBSan caught them): 2^61 doubles, and offsets past int64.
  const auto huge =
      write_file(R"({"w":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}})", "");
  EXPECT_THROW(SafetensorsFile{huge}, ValueError);
  const auto wrapped = write_file(
      R"({"w":{"dtype":"U8","shape":[4611686018427387904],"data_offsets":[4611686018427387904,9223372036854775808]}})",
      "");
  EXPECT_THROW(SafetensorsFile{wrapped}, ValueError);
  std::remove(huge.c_str());
  std::remove(wrapped.c_str());
  EXPECT_THROW(SafetensorsFile{"/nonexistent/file.safetensors"}, SystemError);
  std::remove(bad_json.c_str());
  std::remove(bad_offsets.c_str());
}

TEST(SafetensorsFile, CopiesATensorNotAlignedToItsElementSize) {
  std::string data(9, '\0');
  const float values[2] = {1.5f, -2.0f};
  std::memcpy(data.data() + 1, values, 8);
  const auto path = write_file(
      R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
      R"("w":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}})",
      data);
  SafetensorsFile file(path);
  std::remove(path.c_str());
  const auto& entry = file.entries()[0].name == "w" ? file.entries()[0] : file.entries()[1];
  EXPECT_FALSE(entry.in_place);
  const at::Tensor tensor = file.tensor(entry);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(tensor.data_ptr()) % sizeof(float), 0u);
  EXPECT_TRUE(at::equal(tensor, at::tensor({1.5f, -2.0f})));
}

TEST(SafetensorsFile, RefusesAHeaderNestedDeeperThanTheFormatAllows) {
  const std::string deep =
      R"({"__metadata__":)" + std::string(100000, '[') + std::string(100000, ']') + "}";
  const auto path = write_file(deep, "");
  try {
    SafetensorsFile file(path);
    FAIL() << "expected ValueError";
  } catch (const ValueError& error) {
    EXPECT_NE(std::string(error.what()).find("deeper than 128 levels"), std::string::npos);
  }
  std::remove(path.c_str());
  // Brackets inside strings are text, not nesting.
  const auto quoted =
      write_file(R"({"__metadata__":{"k":")" + std::string(200, '[') + R"("}})", "");
  EXPECT_NO_THROW(SafetensorsFile{quoted});
  std::remove(quoted.c_str());
}

}  // namespace
}  // namespace fsdp2_ext
