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
endif()
