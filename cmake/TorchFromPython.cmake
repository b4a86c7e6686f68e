# Finds Torch from the torch wheel that the build's Python interpreter imports, and nothing else.
#
# [Note: one torch]
# The extension must be built against exactly the torch it will be loaded into: same headers, same
# C++ ABI flag, same pybind11 internals. So Torch_DIR is taken from the interpreter
# (torch.utils.cmake_prefix_path), any other Torch on CMAKE_PREFIX_PATH is ignored, torch is not a
# build requirement (pip's build isolation would install a second one and fail here), and the
# version is compiled into the module, which refuses to import under a different torch.
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
          "import torch, torch.utils; print(torch.utils.cmake_prefix_path); print(torch.__version__)"
  OUTPUT_VARIABLE _fsdp2_torch_info
  RESULT_VARIABLE _fsdp2_torch_rc
  ERROR_VARIABLE _fsdp2_torch_err
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _fsdp2_torch_rc EQUAL 0)
  message(FATAL_ERROR
    "fsdp2_ext: `import torch` failed in ${Python_EXECUTABLE}:\n${_fsdp2_torch_err}\n"
    "Install torch into this environment first (e.g. `pip install torch==2.13.0`), then build "
    "without build isolation: `pip install --no-build-isolation -e .`")
endif()
string(REPLACE "\n" ";" _fsdp2_torch_info "${_fsdp2_torch_info}")
list(GET _fsdp2_torch_info 0 _fsdp2_torch_prefix)
list(GET _fsdp2_torch_info 1 FSDP2_TORCH_VERSION)
set(Torch_DIR "${_fsdp2_torch_prefix}/Torch" CACHE PATH "Torch config dir of the interpreter's torch" FORCE)
find_package(Torch CONFIG REQUIRED NO_DEFAULT_PATH PATHS "${Torch_DIR}")
message(STATUS "fsdp2_ext: torch ${FSDP2_TORCH_VERSION} from ${Torch_DIR}; CXX flags: ${TORCH_CXX_FLAGS}")

# torch_python is not part of TORCH_LIBRARIES. It provides the Tensor / ProcessGroup type casters.
find_library(TORCH_PYTHON_LIBRARY torch_python HINTS "${TORCH_INSTALL_PREFIX}/lib" REQUIRED NO_DEFAULT_PATH)
add_library(torch_python_wheel INTERFACE)
target_link_libraries(torch_python_wheel INTERFACE torch "${TORCH_PYTHON_LIBRARY}")
# <pybind11/...> resolves to ${TORCH_INSTALL_PREFIX}/include/pybind11 through torch's own include
# directories: the pybind11 torch itself was built with, so the internals (and casters) are shared.
# The pip `pybind11` package is never put on the include path.
# Transitive flags torch's own extensions are built with.
target_compile_definitions(torch_python_wheel INTERFACE TORCH_EXTENSION_NAME=_fsdp2_ext TORCH_API_INCLUDE_EXTENSION_H)

execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))"
  OUTPUT_VARIABLE FSDP2_PYTHON_EXT_SUFFIX OUTPUT_STRIP_TRAILING_WHITESPACE)
