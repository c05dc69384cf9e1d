# The torch extension epx._epx_torch (python/torch_ext): epx.Buffer's hot calls on torch tensors in C++. Built
# where the interpreter has torch (EPX_BUILD_TORCH_EXT=AUTO) or always (ON); the epx package works without it,
# taking its Python path. It compiles against that torch's headers and the pybind11 torch ships (not pip's), so
# its tensors cross as torch's own casters make them; it links no EPX library (python/src/native_calls.hpp).
set(EPX_BUILD_TORCH_EXT AUTO CACHE STRING "Build epx._epx_torch: AUTO (where torch imports), ON or OFF")
if(EPX_BUILD_TORCH_EXT STREQUAL "OFF")
  return()
endif()
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
          "import os, torch; c = torch._C; print(os.path.dirname(torch.__file__)); print(int(c._GLIBCXX_USE_CXX11_ABI)); [print(getattr(c, '_PYBIND11_' + k, '-')) for k in ('COMPILER_TYPE', 'STDLIB', 'BUILD_ABI')]"
  OUTPUT_VARIABLE _epx_torch_facts OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _epx_torch_rc ERROR_QUIET)
if(NOT _epx_torch_rc EQUAL 0)
  if(EPX_BUILD_TORCH_EXT STREQUAL "ON")
    message(FATAL_ERROR "EPX_BUILD_TORCH_EXT=ON needs torch in ${Python_EXECUTABLE}")
  endif()
  message(STATUS "epx._epx_torch: not built (no torch in ${Python_EXECUTABLE}); epx takes its Python path")
  return()
endif()
string(REPLACE "\n" ";" _epx_torch_facts "${_epx_torch_facts}")
list(GET _epx_torch_facts 0 _epx_torch_dir)
list(GET _epx_torch_facts 1 _epx_torch_cxx11_abi)
list(GET _epx_torch_facts 2 _epx_torch_pybind_compiler)
list(GET _epx_torch_facts 3 _epx_torch_pybind_stdlib)
list(GET _epx_torch_facts 4 _epx_torch_pybind_abi)
set(_epx_torch_libs)
foreach(_lib c10 c10_cuda torch torch_cpu torch_python)
  find_library(_epx_torch_lib_${_lib} NAMES ${_lib} HINTS "${_epx_torch_dir}/lib" NO_DEFAULT_PATH REQUIRED)
  list(APPEND _epx_torch_libs "${_epx_torch_lib_${_lib}}")
endforeach()
message(STATUS "epx._epx_torch: against torch in ${_epx_torch_dir}")

Python_add_library(_epx_torch MODULE WITH_SOABI torch_ext/epx_torch.cpp)
# src/core/first_fit_ranges.hpp (the output window's ranges): a header of plain C++, no EPX library linked.
target_include_directories(_epx_torch PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/include
                                              ${PROJECT_SOURCE_DIR}/src)
target_include_directories(_epx_torch SYSTEM PRIVATE "${_epx_torch_dir}/include"
                           "${_epx_torch_dir}/include/torch/csrc/api/include" ${CUDAToolkit_INCLUDE_DIRS})
target_compile_definitions(_epx_torch PRIVATE _GLIBCXX_USE_CXX11_ABI=${_epx_torch_cxx11_abi})
# Older torch names the pybind11 ABI it was built with: the same here keeps one pybind11 registry with torch's.
if(NOT _epx_torch_pybind_compiler STREQUAL "-")
  target_compile_definitions(
    _epx_torch PRIVATE PYBIND11_COMPILER_TYPE="${_epx_torch_pybind_compiler}"
                       PYBIND11_STDLIB="${_epx_torch_pybind_stdlib}" PYBIND11_BUILD_ABI="${_epx_torch_pybind_abi}")
endif()
target_compile_options(_epx_torch PRIVATE ${EPX_WARNINGS})
target_compile_features(_epx_torch PRIVATE cxx_std_20)
target_link_libraries(_epx_torch PRIVATE ${_epx_torch_libs})
set_target_properties(_epx_torch PROPERTIES CXX_VISIBILITY_PRESET hidden INSTALL_RPATH "${_epx_torch_dir}/lib"
                                            BUILD_RPATH "${_epx_torch_dir}/lib")
epx_python_module(_epx_torch)
