# Third-party C++ dependencies, all from Debian's packages. A missing one stops configure with the
# package to install.
function(fsdp2_require_package name debian_package)
  find_package(${name} CONFIG QUIET)
  if(NOT ${name}_FOUND)
    message(FATAL_ERROR
      "fsdp2_ext: ${name} not found. Install it with `apt-get install ${debian_package}` "
      "(or run `make deps` as root).")
  endif()
endfunction()

fsdp2_require_package(spdlog libspdlog-dev)
fsdp2_require_package(nlohmann_json nlohmann-json3-dev)
if(FSDP2_BUILD_TESTS)
  fsdp2_require_package(GTest libgtest-dev)
  # The multi-rank tests compile against torch's ProcessGroupGloo header, which includes gloo's
  # headers; the torch wheel does not ship them (the symbols are in libtorch_cpu).
  find_path(GLOO_INCLUDE_DIR gloo/algorithm.h)
  if(NOT GLOO_INCLUDE_DIR)
    message(FATAL_ERROR
      "fsdp2_ext: gloo's headers not found. Install them with `apt-get install libgloo-dev` "
      "(or run `make deps` as root).")
  endif()
endif()
