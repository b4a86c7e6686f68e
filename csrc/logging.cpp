// spdlog lives in this translation unit only: see [Note: one fmt per translation unit].
#include "fsdp2_ext/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace fsdp2_ext::log {
namespace {

Level level_from_environment() {
  const char* value = std::getenv("FSDP2_EXT_LOG_LEVEL");
  if (value == nullptr || *value == '\0') {
    return Level::kInfo;
  }
  static const std::pair<const char*, Level> kNames[] = {
      {"trace", Level::kTrace},
      {"debug", Level::kDebug},
      {"info", Level::kInfo},
      {"warn", Level::kWarn},
      {"warning", Level::kWarn},
      {"error", Level::kError},
      {"off", Level::kOff}};
  for (const auto& [name, level] : kNames) {
    if (strcasecmp(value, name) == 0) {
      return level;
    }
  }
  return Level::kInfo;
}

std::atomic<int> g_level{static_cast<int>(level_from_environment())};
std::atomic<int> g_rank{-1};
std::mutex g_forwarder_mutex;
std::shared_ptr<const std::function<void(Level, const std::string&)>> g_forwarder;

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> instance = [] {
    auto created = spdlog::stderr_color_mt("fsdp2_ext");
    created->set_level(spdlog::level::trace);  // filtering happens in message()
    created->set_pattern("%v");
    return created;
  }();
  return *instance;
}

spdlog::level::level_enum to_spdlog(Level level) {
  switch (level) {
    case Level::kTrace:
      return spdlog::level::trace;
    case Level::kDebug:
      return spdlog::level::debug;
    case Level::kInfo:
      return spdlog::level::info;
    case Level::kWarn:
      return spdlog::level::warn;
    case Level::kError:
      return spdlog::level::err;
    case Level::kOff:
      break;
  }
  return spdlog::level::off;
}

}  // namespace

void set_rank(int rank) {
  g_rank.store(rank);
}

void set_level(Level level) {
  g_level.store(static_cast<int>(level));
}

Level level() {
  return static_cast<Level>(g_level.load());
}

bool enabled(Level level) {
  return level != Level::kOff && static_cast<int>(level) >= g_level.load();
}

void set_forwarder(std::function<void(Level, const std::string&)> forwarder) {
  std::lock_guard<std::mutex> lock(g_forwarder_mutex);
  g_forwarder = forwarder ? std::make_shared<const std::function<void(Level, const std::string&)>>(
                                std::move(forwarder))
                          : nullptr;
}

void message(Level level, const std::string& text) {
  if (!enabled(level)) {
    return;
  }
  std::shared_ptr<const std::function<void(Level, const std::string&)>> forwarder;
  {
    std::lock_guard<std::mutex> lock(g_forwarder_mutex);
    forwarder = g_forwarder;
  }
  if (forwarder) {
    (*forwarder)(level, text);
    return;
  }
  const int rank = g_rank.load();
  const char* name = spdlog::level::to_short_c_str(to_spdlog(level));
  if (rank >= 0) {
    logger().log(to_spdlog(level), "[fsdp2_ext {} rank {}] {}", name, rank, text);
  } else {
    logger().log(to_spdlog(level), "[fsdp2_ext {}] {}", name, text);
  }
}

}  // namespace fsdp2_ext::log
