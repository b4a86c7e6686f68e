#include "fsdp2_ext/errors.h"
#include "fsdp2_ext/safetensors_file.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <unistd.h>

namespace fsdp2_ext {
namespace {

std::string write_file(const std::string& header, const std::string& data) {
  char name[] = "/tmp/fsdp2_ext_test_XXXXXX";
  const int fd = mkstemp(name);
  ::close(fd);
  std::ofstream out(name, std::ios::binary);
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
      R"({"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", data);
  at::Tensor tensor;
  {
    SafetensorsFile file(path);
    ASSERT_EQ(file.entries().size(), 1u);
    tensor = file.tensor(file.entries()[0]);
  } // the tensor keeps the mapping alive
  std::remove(path.c_str());
  EXPECT_TRUE(at::equal(tensor, at::tensor({1.5f, -2.0f})));
}

TEST(SafetensorsFile, RejectsMalformedFiles) {
  const auto bad_json = write_file("{not json", "");
  EXPECT_THROW(SafetensorsFile{bad_json}, ValueError);
  const auto bad_offsets = write_file(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}})", std::string(8, '\0'));
  EXPECT_THROW(SafetensorsFile{bad_offsets}, ValueError);
  EXPECT_THROW(SafetensorsFile{"/nonexistent/file.safetensors"}, SystemError);
  std::remove(bad_json.c_str());
  std::remove(bad_offsets.c_str());
}

} // namespace
} // namespace fsdp2_ext
