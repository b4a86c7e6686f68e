#include "fsdp2_ext/mapped_file.h"

#include "fsdp2_ext/errors.h"

#include <ATen/ATen.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <cerrno>

namespace fsdp2_ext {

FileDescriptor& FileDescriptor::operator=(FileDescriptor&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = other.release();
  }
  return *this;
}

FileDescriptor FileDescriptor::open(
    const std::string& path, int flags, mode_t mode, const std::string& what) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  if (fd < 0) {
    FSDP2_THROW_ERRNO(errno, "cannot open ", what);
  }
  return FileDescriptor(fd);
}

struct stat FileDescriptor::status(const std::string& what) const {
  struct stat info {};
  if (::fstat(fd_, &info) != 0) {
    FSDP2_THROW_ERRNO(errno, "cannot stat ", what);
  }
  return info;
}

void FileDescriptor::close() noexcept {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

namespace {

// [offset, offset + bytes) within [0, limit), with checked arithmetic; else a ValueError naming
// `what` and the `limit_name` it would reach past.
void check_range(
    int64_t offset,
    int64_t bytes,
    int64_t limit,
    const std::string& what,
    const std::string& limit_name) {
  int64_t end = 0;
  FSDP2_CHECK_VALUE(
      offset >= 0 && bytes >= 0 && !__builtin_add_overflow(offset, bytes, &end) && end <= limit,
      what,
      ": bytes [",
      offset,
      ", ",
      offset,
      " + ",
      bytes,
      ") reach past ",
      limit_name);
}

}  // namespace

std::shared_ptr<MappedRegion> MappedRegion::map(
    const FileDescriptor& file,
    int64_t offset,
    int64_t bytes,
    Access access,
    const std::string& what) {
  // A region past the end of the file would map, then raise SIGBUS on first touch.
  const int64_t file_size = static_cast<int64_t>(file.status(what).st_size);
  check_range(
      offset,
      bytes,
      file_size,
      "cannot map " + what,
      "the end of the " + std::to_string(file_size) + "-byte file (truncated?)");
  static const int64_t page = ::sysconf(_SC_PAGESIZE);
  FSDP2_CHECK_VALUE(
      offset % page == 0,
      "cannot map ",
      what,
      ": offset ",
      offset,
      " is not a multiple of the ",
      page,
      "-byte page size");
  const size_t mapped = static_cast<size_t>(std::max<int64_t>(bytes, 1));  // mmap refuses 0
  const int protection = access == Access::kReadOnly ? PROT_READ : PROT_READ | PROT_WRITE;
  void* address = ::mmap(nullptr, mapped, protection, MAP_SHARED, file.get(), offset);
  if (address == MAP_FAILED) {
    FSDP2_THROW_ERRNO(errno, "cannot map ", what);
  }
  return std::shared_ptr<MappedRegion>(new MappedRegion(address, bytes, mapped));
}

MappedRegion::~MappedRegion() {
  ::munmap(address_, mapped_);
}

int64_t checked_nbytes(c10::IntArrayRef shape, at::ScalarType dtype, const std::string& what) {
  int64_t bytes = static_cast<int64_t>(c10::elementSize(dtype));
  for (const int64_t dim : shape) {
    FSDP2_CHECK_VALUE(dim >= 0, what, ": negative dimension in shape ", shape);
    FSDP2_CHECK_VALUE(
        !__builtin_mul_overflow(bytes, dim, &bytes),
        what,
        ": shape ",
        shape,
        " overflows 64-bit byte counts");
  }
  return bytes;
}

at::Tensor MappedRegion::view(
    int64_t offset, at::ScalarType dtype, c10::IntArrayRef shape, const std::string& what) const {
  const int64_t bytes = checked_nbytes(shape, dtype, what);
  check_range(offset, bytes, size_, what, "the mapped " + std::to_string(size_) + " bytes");
  auto keep_alive = shared_from_this();
  return at::from_blob(
      static_cast<char*>(address_) + offset,
      shape,
      [keep_alive](void*) mutable { keep_alive.reset(); },
      at::TensorOptions().dtype(dtype).device(at::kCPU));
}

}  // namespace fsdp2_ext
