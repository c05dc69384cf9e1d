# epx_python_wheel_dir(<out-var> <module>): the folder of an installed Python package such as nvidia.nccl,
# or empty. NVIDIA ships NCCL and NVSHMEM as wheels with include/ and lib/ inside.
find_package(Python3 COMPONENTS Interpreter QUIET)
function(epx_python_wheel_dir out module)
  set(${out} "" PARENT_SCOPE)
  if(Python3_Interpreter_FOUND)
    execute_process(COMMAND ${Python3_EXECUTABLE} -c "import ${module} as m; print(list(m.__path__)[0])"
                    OUTPUT_VARIABLE _dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _rc)
    if(_rc EQUAL 0)
      set(${out} "${_dir}" PARENT_SCOPE)
    endif()
  endif()
endfunction()
