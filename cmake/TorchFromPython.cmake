# Torch from the torch wheel that the build's Python interpreter imports, and nothing else.
#
# [Note: one torch]
# The extension must be built against exactly the torch it will be loaded into: same headers, same
# C++ ABI flag, same pybind11 internals. So everything is taken from the interpreter's torch
# (its include and library paths, as torch.utils.cpp_extension gives them to its own extensions),
# any other Torch on CMAKE_PREFIX_PATH is ignored, torch is not a build requirement (pip's build
# isolation would install a second one and fail here), and the version is compiled into the
# module, which refuses to import under a different torch.
#
# [Note: no CUDA toolkit needed]
# The core and the module include no CUDA header and call no CUDA function: CUDA tensors reach
# them through ATen's device-generic API, which lives in libtorch_cpu/libc10. torch's own CMake
# package cannot be used for a CUDA build without a toolkit: its Caffe2Config.cmake includes
# public/cuda.cmake unconditionally for such a build and stops ("Your installed Caffe2 version
# uses CUDA but I cannot find the CUDA libraries"), and the torch_cuda target names CUDA::*
# targets. A GPU host's pip/uv environment has the CUDA runtime wheels and often no toolkit. So
# the `torch` target here is made as torch.utils.cpp_extension.CppExtension makes its link line:
# torch's include directories, c10 + torch + torch_cpu from torch/lib, the wheel's
# _GLIBCXX_USE_CXX11_ABI. One code path for CPU and CUDA builds of every torch in the range.
#
# [Note: the C++ standard torch requires]
# torch <= 2.13 builds with C++17; torch >= 2.14 requires C++20 (ATen/ATen.h: "#error C++20 or
# later compatible compiler is required"; 2.14.1's CMake package does not raise the standard for
# its users, 2.15's does). The standard is read from that header, so a torch that requires C++20
# gets it whatever its version string says.
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c [=[
import os, torch, torch.utils.cpp_extension as ext
print(torch.__version__)
print(os.path.dirname(torch.__file__))
print("|".join(ext.include_paths()))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(torch.version.cuda or "")
]=]
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
list(GET _fsdp2_torch_info 0 FSDP2_TORCH_VERSION)
list(GET _fsdp2_torch_info 1 TORCH_INSTALL_PREFIX)
list(GET _fsdp2_torch_info 2 _fsdp2_torch_includes)
list(GET _fsdp2_torch_info 3 _fsdp2_torch_abi)
list(LENGTH _fsdp2_torch_info _fsdp2_torch_fields)
set(_fsdp2_torch_cuda "")
if(_fsdp2_torch_fields GREATER 4)
  list(GET _fsdp2_torch_info 4 _fsdp2_torch_cuda)
endif()
string(REPLACE "|" ";" _fsdp2_torch_includes "${_fsdp2_torch_includes}")

file(STRINGS "${TORCH_INSTALL_PREFIX}/include/ATen/ATen.h" _fsdp2_needs_cxx20 REGEX "C\\+\\+20 or later")
if(_fsdp2_needs_cxx20)
  set(CMAKE_CXX_STANDARD 20)
else()
  set(CMAKE_CXX_STANDARD 17)
endif()

add_library(torch INTERFACE)
target_include_directories(torch SYSTEM INTERFACE ${_fsdp2_torch_includes})
foreach(_fsdp2_lib c10 torch torch_cpu)
  find_library(FSDP2_TORCH_LIB_${_fsdp2_lib} ${_fsdp2_lib}
    PATHS "${TORCH_INSTALL_PREFIX}/lib" NO_DEFAULT_PATH REQUIRED)
  target_link_libraries(torch INTERFACE "${FSDP2_TORCH_LIB_${_fsdp2_lib}}")
endforeach()
target_compile_definitions(torch INTERFACE _GLIBCXX_USE_CXX11_ABI=${_fsdp2_torch_abi})
if(_fsdp2_torch_cuda)
  set(_fsdp2_torch_kind "CUDA ${_fsdp2_torch_cuda} build, no CUDA toolkit used")
else()
  set(_fsdp2_torch_kind "CPU build")
endif()
message(STATUS "fsdp2_ext: torch ${FSDP2_TORCH_VERSION} (${_fsdp2_torch_kind}) from "
  "${TORCH_INSTALL_PREFIX}; C++${CMAKE_CXX_STANDARD}, _GLIBCXX_USE_CXX11_ABI=${_fsdp2_torch_abi}")

# torch_python provides the Tensor / ProcessGroup type casters.
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
