// Several Gloo ranks in one process, as c10d's own C++ tests run them: one thread per rank, each
// with its own ProcessGroupGloo over a shared FileStore, wrapped in a c10d::ProcessGroup as the
// Python side passes it to the core.
#pragma once

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <cstdlib>
#include <exception>
#include <string>
#include <thread>
#include <vector>

namespace fsdp2_ext::testing {

// Runs body(rank, group) on `world` ranks; each rank's exception, if any, fails the test.
template <typename Body>
void on_gloo_ranks(int world, Body body) {
  char pattern[] = "/tmp/fsdp2_ext_store_XXXXXX";
  const int fd = ::mkstemp(pattern);
  ASSERT_GE(fd, 0);
  ::close(fd);
  const std::string path = pattern;
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto store = c10::make_intrusive<c10d::FileStore>(path, world);
        auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(60));
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
        auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, options);
        auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world);
        group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, backend);
        group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
        body(rank, group);
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& thread : threads) {
    thread.join();
  }
  ::unlink(path.c_str());
  // Every rank's failure is reported; the first one fails the test.
  for (int rank = 0; rank < world; ++rank) {
    if (errors[rank]) {
      try {
        std::rethrow_exception(errors[rank]);
      } catch (const std::exception& error) {
        ADD_FAILURE() << "rank " << rank << ": " << error.what();
      }
    }
  }
}

}  // namespace fsdp2_ext::testing
