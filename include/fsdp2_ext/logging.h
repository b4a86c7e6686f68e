// The project's one logger: rank-prefixed, level from FSDP2_EXT_LOG_LEVEL
// (trace|debug|info|warn|error|off, default info). Only std::string crosses this header;
// see [Note: one fmt per translation unit] in CMakeLists.txt.
#pragma once

#include <functional>
#include <string>

namespace fsdp2_ext::log {

enum class Level { kTrace = 0, kDebug, kInfo, kWarn, kError, kOff };

// Sets the rank shown in every line ("[fsdp2_ext rank 3]"); -1 hides it.
void set_rank(int rank);
void set_level(Level level);
Level level();
bool enabled(Level level);
void message(Level level, const std::string& text);

// Where enabled messages go instead of spdlog's stderr sink (the Python module forwards them to
// logging.getLogger("fsdp2_ext")); an empty function restores the sink.
void set_forwarder(std::function<void(Level, const std::string&)> forwarder);

inline void debug(const std::string& text) {
  message(Level::kDebug, text);
}
inline void info(const std::string& text) {
  message(Level::kInfo, text);
}
inline void warn(const std::string& text) {
  message(Level::kWarn, text);
}
inline void error(const std::string& text) {
  message(Level::kError, text);
}

}  // namespace fsdp2_ext::log
