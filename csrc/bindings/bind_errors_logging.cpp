#include "bindings/registrations.h"

#include "fsdp2_ext/errors.h"
#include "fsdp2_ext/logging.h"

#include <cstring>

namespace fsdp2_ext::bindings {
namespace {

// A message may quote bytes read from a file (a safetensors key, a header fragment) that are not
// UTF-8: decode with backslash escapes so the message itself reaches Python.
py::object message(const std::exception& error) {
  const char* text = error.what();
  PyObject* decoded =
      PyUnicode_DecodeUTF8(text, static_cast<Py_ssize_t>(std::strlen(text)), "backslashreplace");
  if (decoded == nullptr) {
    PyErr_Clear();
    return py::str("(undecodable error message)");
  }
  return py::reinterpret_steal<py::object>(decoded);
}

}  // namespace

void register_errors_logging(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) {
        std::rethrow_exception(error);
      }
    } catch (const ValueError& e) {
      PyErr_SetObject(PyExc_ValueError, message(e).ptr());
    } catch (const SystemError& e) {
      PyErr_SetObject(PyExc_OSError, py::make_tuple(e.error_number(), message(e)).ptr());
    } catch (const RuntimeError& e) {
      PyErr_SetObject(PyExc_RuntimeError, message(e).ptr());
    }
  });

  py::enum_<log::Level>(m, "LogLevel")
      .value("TRACE", log::Level::kTrace)
      .value("DEBUG", log::Level::kDebug)
      .value("INFO", log::Level::kInfo)
      .value("WARN", log::Level::kWarn)
      .value("ERROR", log::Level::kError)
      .value("OFF", log::Level::kOff);
  m.def(
      "log",
      &log::message,
      py::arg("level"),
      py::arg("text"),
      "Writes one line through the project's spdlog logger.");
  m.def("log_enabled", &log::enabled, py::arg("level"));
  m.def("set_log_rank", &log::set_rank, py::arg("rank"));
  m.def("set_log_level", &log::set_level, py::arg("level"));
  m.def("log_level", &log::level);
  m.def(
      "set_log_forwarder",
      [](py::object function) {
        if (function.is_none()) {
          log::set_forwarder(nullptr);
          return;
        }
        // A strong reference that outlives the module: released only by the next call.
        auto target =
            std::shared_ptr<py::object>(new py::object(std::move(function)), [](py::object* held) {
              py::gil_scoped_acquire gil;
              delete held;
            });
        log::set_forwarder([target](log::Level level, const std::string& text) {
          if (!Py_IsInitialized()) {
            return;
          }
          py::gil_scoped_acquire gil;
          try {
            (*target)(static_cast<int>(level), text);
          } catch (py::error_already_set& error) {
            error.discard_as_unraisable("fsdp2_ext log forwarding");
          }
        });
      },
      py::arg("function"),
      "Sends every enabled C++ log message to function(level: int, text: str); None: back to "
      "stderr.");
}

}  // namespace fsdp2_ext::bindings
