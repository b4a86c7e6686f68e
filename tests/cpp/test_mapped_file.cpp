#include "fsdp2_ext/mapped_file.h"

#include "fsdp2_ext/errors.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>
#include <cstdlib>
#include <string>

namespace fsdp2_ext {
namespace {

// A file of `bytes` bytes 0, 1, 2, ... (mod 256); removed by the caller.
std::string file_of(int64_t bytes) {
  char pattern[] = "/tmp/fsdp2_ext_mapped_XXXXXX";
  const int fd = ::mkstemp(pattern);
  EXPECT_GE(fd, 0);
  for (int64_t i = 0; i < bytes; ++i) {
    const unsigned char byte = static_cast<unsigned char>(i);
    EXPECT_EQ(::write(fd, &byte, 1), 1);
  }
  ::close(fd);
  return pattern;
}

TEST(MappedRegion, ViewsShareTheMappingAndOutliveEveryOwner) {
  const std::string path = file_of(64);
  at::Tensor view;
  {
    const FileDescriptor file = FileDescriptor::open(path, O_RDONLY, 0, "test file");
    auto region = MappedRegion::map(file, 0, 64, MappedRegion::Access::kReadOnly, "test file");
    view = region->view(8, at::kByte, {2, 4}, "rows");
  }  // the descriptor and the region handle are gone; the view keeps the mapping
  EXPECT_TRUE(at::equal(view, at::arange(8, 16, at::kByte).view({2, 4})));
  ::unlink(path.c_str());
}

TEST(MappedRegion, AViewPastTheRegionOrAnOverflowingShapeIsRefused) {
  const std::string path = file_of(64);
  const FileDescriptor file = FileDescriptor::open(path, O_RDONLY, 0, "test file");
  auto region = MappedRegion::map(file, 0, 64, MappedRegion::Access::kReadOnly, "test file");
  EXPECT_THROW(region->view(60, at::kFloat, {2}, "t"), ValueError);  // 60 + 8 > 64
  EXPECT_THROW(region->view(-4, at::kByte, {2}, "t"), ValueError);
  EXPECT_THROW(region->view(0, at::kDouble, {int64_t{1} << 61}, "t"), ValueError);  // overflow
  EXPECT_THROW(region->view(0, at::kByte, {-1}, "t"), ValueError);
  try {
    region->view(56, at::kDouble, {2}, "tensor 'w'");
    FAIL() << "expected ValueError";
  } catch (const ValueError& error) {
    EXPECT_NE(std::string(error.what()).find("tensor 'w': bytes [56, 56 + 16)"), std::string::npos)
        << error.what();
  }
  ::unlink(path.c_str());
}

TEST(MappedRegion, ARegionPastTheFileOrOffThePageIsRefusedBeforeMapping) {
  const std::string path = file_of(64);
  const FileDescriptor file = FileDescriptor::open(path, O_RDONLY, 0, "test file");
  try {
    MappedRegion::map(file, 0, 1 << 16, MappedRegion::Access::kReadOnly, "shared file 'x'");
    FAIL() << "expected ValueError";  // mapping it would SIGBUS on the first page past the end
  } catch (const ValueError& error) {
    EXPECT_NE(
        std::string(error.what()).find("reach past the end of the 64-byte file"), std::string::npos)
        << error.what();
  }
  EXPECT_THROW(MappedRegion::map(file, 8, 8, MappedRegion::Access::kReadOnly, "f"), ValueError);
  ::unlink(path.c_str());
}

TEST(FileDescriptor, OpenFailuresCarryErrnoAndWhat) {
  try {
    FileDescriptor::open("/no/such/file", O_RDONLY, 0, "checkpoint '/no/such/file'");
    FAIL() << "expected SystemError";
  } catch (const SystemError& error) {
    EXPECT_EQ(error.error_number(), ENOENT);
    EXPECT_NE(
        std::string(error.what()).find("cannot open checkpoint '/no/such/file'"),
        std::string::npos);
  }
}

TEST(FileDescriptor, ClosesOnceAndMovesOwnership) {
  const std::string path = file_of(1);
  FileDescriptor first = FileDescriptor::open(path, O_RDONLY, 0, "f");
  const int fd = first.get();
  FileDescriptor second = std::move(first);
  EXPECT_FALSE(first.valid());
  EXPECT_EQ(second.get(), fd);
  second.close();
  EXPECT_FALSE(second.valid());
  EXPECT_EQ(::fcntl(fd, F_GETFD), -1);  // closed
  ::unlink(path.c_str());
}

}  // namespace
}  // namespace fsdp2_ext
