#include "fsdp2_ext/host_shared_tensor.h"

#include "fsdp2_ext/errors.h"
#include "fsdp2_ext/logging.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <cerrno>

namespace fsdp2_ext {
namespace {

// Entry offsets are multiples of 64 KiB: page-aligned for mmap on 4 KiB and 64 KiB page kernels.
constexpr int64_t kAlignment = int64_t{1} << 16;

int64_t align_up(int64_t value) {
  return (value + kAlignment - 1) / kAlignment * kAlignment;
}

struct MappedRegion {
  void* address = MAP_FAILED;
  size_t size = 0;
  ~MappedRegion() {
    if (address != MAP_FAILED && size > 0) {
      munmap(address, size);
    }
  }
};

// Network and distributed filesystems (statfs f_type): mapping a file there is neither node-local
// nor coherent across hosts.
const char* network_filesystem(long type) {
  switch (static_cast<unsigned long>(type)) {
    case 0x6969:
      return "NFS";
    case 0xFF534D42:
      return "CIFS";
    case 0xFE534D42:
      return "SMB2";
    case 0x517B:
      return "SMB";
    case 0x01021997:
      return "9p";
    case 0x0BD00BD0:
      return "Lustre";
    case 0x47504653:
      return "GPFS";
    case 0x00C36400:
      return "CephFS";
    case 0x65735546:
      return "FUSE";
    case 0x013111A8:
      return "IBRIX";
    case 0x19830326:
      return "FhGFS/BeeGFS";
    default:
      return nullptr;
  }
}

std::string dtype_name(at::ScalarType dtype) {
  return c10::toString(dtype);
}

at::ScalarType dtype_from_name(const std::string& name) {
  for (int i = 0; i < static_cast<int>(at::ScalarType::NumOptions); ++i) {
    const auto type = static_cast<at::ScalarType>(i);
    if (name == c10::toString(type)) {
      return type;
    }
  }
  throw ValueError("shared manifest: unknown dtype '" + name + "'");
}

}  // namespace

std::string SharedManifest::to_json() const {
  nlohmann::json manifest;
  manifest["path"] = path;
  manifest["file_bytes"] = file_bytes;
  manifest["entries"] = nlohmann::json::array();
  for (const auto& entry : entries) {
    manifest["entries"].push_back(
        {{"fqn", entry.fqn},
         {"dtype", dtype_name(entry.dtype)},
         {"shape", entry.shape},
         {"offset", entry.offset},
         {"bytes", entry.bytes}});
  }
  return manifest.dump();
}

SharedManifest SharedManifest::from_json(const std::string& text) {
  try {
    const auto json = nlohmann::json::parse(text);
    SharedManifest manifest;
    manifest.path = json.at("path").get<std::string>();
    manifest.file_bytes = json.at("file_bytes").get<int64_t>();
    for (const auto& item : json.at("entries")) {
      manifest.entries.push_back(SharedEntry{
          item.at("fqn").get<std::string>(),
          dtype_from_name(item.at("dtype").get<std::string>()),
          item.at("shape").get<std::vector<int64_t>>(),
          item.at("offset").get<int64_t>(),
          item.at("bytes").get<int64_t>()});
    }
    return manifest;
  } catch (const nlohmann::json::exception& error) {
    throw ValueError(std::string("shared manifest is malformed: ") + error.what());
  }
}

SharedManifest plan_shared_file(
    const std::string& path,
    const std::vector<std::string>& fqns,
    const std::vector<at::Tensor>& likes) {
  if (fqns.size() != likes.size()) {
    throw ValueError(
        "plan_shared_file: " + std::to_string(fqns.size()) + " FQNs for " +
        std::to_string(likes.size()) + " tensors");
  }
  SharedManifest manifest;
  manifest.path = path;
  int64_t offset = 0;
  for (size_t i = 0; i < fqns.size(); ++i) {
    const int64_t bytes = likes[i].numel() * static_cast<int64_t>(likes[i].element_size());
    manifest.entries.push_back(
        SharedEntry{fqns[i], likes[i].scalar_type(), likes[i].sizes().vec(), offset, bytes});
    offset = align_up(offset + bytes);
  }
  manifest.file_bytes = std::max<int64_t>(offset, kAlignment);
  return manifest;
}

std::string check_shared_directory(const std::string& directory, int64_t bytes, std::string* note) {
  const std::string what = "VERL_NO_PLACEMENT_MMAP_DIR='" + directory + "'";
  struct stat info {};
  if (::stat(directory.c_str(), &info) != 0) {
    return what + " does not exist (" + std::strerror(errno) +
           "); create it on node-local disk, same path on every rank of the host";
  }
  if (!S_ISDIR(info.st_mode)) {
    return what + " is not a directory; point it at a directory on node-local disk";
  }
  if (::access(directory.c_str(), W_OK | X_OK) != 0) {
    return what + " is not writable by this process (" + std::strerror(errno) +
           "); fix its permissions or choose another directory";
  }
  struct statfs filesystem {};
  if (::statfs(directory.c_str(), &filesystem) == 0) {
    if (const char* name = network_filesystem(filesystem.f_type)) {
      return what + " is on a network filesystem (" + name +
             "); host-shared tables need node-local disk";
    }
    if (note && static_cast<unsigned long>(filesystem.f_type) == 0x01021994UL) {
      *note =
          what + " is tmpfs: the shared copy lives in RAM (still one per host, not one per rank)";
    }
  }
  struct statvfs space {};
  if (::statvfs(directory.c_str(), &space) == 0) {
    const long double available = static_cast<long double>(space.f_bavail) * space.f_frsize;
    if (available < static_cast<long double>(bytes)) {
      return what + " has " + std::to_string(static_cast<int64_t>(available)) +
             " bytes free but the tables need " + std::to_string(bytes) +
             "; free space or choose a larger node-local disk";
    }
  }
  return "";
}

int create_shared_file(const SharedManifest& manifest) {
  const int fd = ::open(manifest.path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    throw SystemError("cannot create shared table file '" + manifest.path + "'", errno);
  }
  const int error = ::posix_fallocate(fd, 0, manifest.file_bytes);
  if (error != 0) {
    ::close(fd);
    ::unlink(manifest.path.c_str());
    throw SystemError(
        "cannot reserve " + std::to_string(manifest.file_bytes) + " bytes for '" + manifest.path +
            "'",
        error);
  }
  return fd;
}

void write_shared_entry(int fd, const SharedEntry& entry, const at::Tensor& tensor) {
  const at::Tensor source = tensor.contiguous();
  if (source.numel() * static_cast<int64_t>(source.element_size()) != entry.bytes ||
      !source.is_cpu()) {
    throw ValueError(
        "write_shared_entry: '" + entry.fqn + "' must be a CPU tensor of " +
        std::to_string(entry.bytes) + " bytes");
  }
  const char* data = static_cast<const char*>(source.data_ptr());
  int64_t done = 0;
  while (done < entry.bytes) {
    const ssize_t written =
        ::pwrite(fd, data + done, static_cast<size_t>(entry.bytes - done), entry.offset + done);
    if (written < 0) {
      if (errno == EINTR) {
        continue;
      }
      throw SystemError("cannot write '" + entry.fqn + "' to the shared table file", errno);
    }
    done += written;
  }
}

at::Tensor map_entry_writable(int fd, const SharedEntry& entry) {
  auto region = std::make_shared<MappedRegion>();
  region->size = static_cast<size_t>(std::max<int64_t>(entry.bytes, 1));
  region->address =
      ::mmap(nullptr, region->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, entry.offset);
  if (region->address == MAP_FAILED) {
    throw SystemError("cannot map '" + entry.fqn + "' for writing", errno);
  }
  return at::from_blob(
      region->address,
      {entry.bytes},
      [region](void*) mutable { region.reset(); },
      at::TensorOptions().dtype(at::kByte));
}

std::vector<at::Tensor> map_shared_file(const SharedManifest& manifest) {
  const int fd = ::open(manifest.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw SystemError(
        "cannot open shared table file '" + manifest.path +
            "' (is the directory node-local and at the same path for every rank of this host?)",
        errno);
  }
  auto region = std::make_shared<MappedRegion>();
  region->size = static_cast<size_t>(manifest.file_bytes);
  region->address = ::mmap(nullptr, region->size, PROT_READ, MAP_SHARED, fd, 0);
  const int error = errno;
  ::close(fd);
  if (region->address == MAP_FAILED) {
    throw SystemError("cannot map shared table file '" + manifest.path + "'", error);
  }
  std::vector<at::Tensor> tensors;
  for (const auto& entry : manifest.entries) {
    tensors.push_back(at::from_blob(
        static_cast<char*>(region->address) + entry.offset,
        entry.shape,
        [region](void*) mutable { region.reset(); },
        at::TensorOptions().dtype(entry.dtype)));
  }
  return tensors;
}

void close_descriptor(int fd) {
  if (fd >= 0) {
    ::close(fd);
  }
}

void unlink_shared_file(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    throw SystemError("cannot unlink shared table file '" + path + "'", errno);
  }
}

}  // namespace fsdp2_ext
