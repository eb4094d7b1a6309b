# The pinned CuTe/CUTLASS headers of the CUDA kernels (headers only): those of PyPI's
# nvidia-cutlass, at the version requirements-cutlass.txt pins, installed in the Python that runs
# the build: pip's isolated build environment (cmake/pep517_backend.py adds the package to the
# build requirements of a CUDA build) or the venv of scripts/setup.sh. They are copied once into
# .deps/ in the source tree, so the compile commands name the same path whichever environment
# supplied them: setup.sh's and pip's builds share their objects, and ccache serves a fresh clone.
# -DFLASHMSA_CUTLASS_INCLUDE=<dir> (holding cute/tensor.hpp) uses other headers instead.
# Sets FLASHMSA_CUTE_DIR.
set(FLASHMSA_CUTLASS_INCLUDE "" CACHE PATH "CuTe/CUTLASS headers (empty: the pinned nvidia-cutlass package's)")
if(FLASHMSA_CUTLASS_INCLUDE)
  if(NOT EXISTS "${FLASHMSA_CUTLASS_INCLUDE}/cute/tensor.hpp")
    message(FATAL_ERROR "FLASHMSA_CUTLASS_INCLUDE=${FLASHMSA_CUTLASS_INCLUDE} has no cute/tensor.hpp")
  endif()
  set(FLASHMSA_CUTE_DIR "${FLASHMSA_CUTLASS_INCLUDE}")
  return()
endif()

file(STRINGS "${PROJECT_SOURCE_DIR}/requirements-cutlass.txt" _pin REGEX "^nvidia-cutlass==")
string(REPLACE "nvidia-cutlass==" "" _version "${_pin}")
set(_dest "${PROJECT_SOURCE_DIR}/.deps/cutlass")
set(FLASHMSA_CUTE_DIR "${_dest}/include")
set(_have "")
if(EXISTS "${_dest}/VERSION")
  file(READ "${_dest}/VERSION" _have)
  string(STRIP "${_have}" _have)
endif()
if(NOT _have STREQUAL _version)
  if(NOT Python3_EXECUTABLE)  # (pip's build passes its own; scripts/setup.sh its venv's)
    find_package(Python3 COMPONENTS Interpreter REQUIRED)
  endif()
  # find_spec locates the package without importing it (its Python side needs other packages)
  execute_process(
    COMMAND "${Python3_EXECUTABLE}" -c [=[
import importlib.metadata as m, importlib.util as u, os
s = u.find_spec("cutlass_library")
print(m.version("nvidia-cutlass") + ";" + os.path.join(s.submodule_search_locations[0], "source", "include"))
]=]
    RESULT_VARIABLE _rc OUTPUT_VARIABLE _found ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  set(_found_version "none")
  if(_rc EQUAL 0)
    list(GET _found 0 _found_version)
  endif()
  if(NOT _found_version STREQUAL _version)
    message(FATAL_ERROR
      "The CUDA kernels need the CuTe headers of nvidia-cutlass==${_version} (PyPI), which the Python "
      "${Python3_EXECUTABLE} does not have (found: ${_found_version}). Install them with "
      "`python3 -m pip install --no-deps -r requirements-cutlass.txt` (scripts/setup.sh does; "
      "pip install . gets them itself), or pass -DFLASHMSA_CUTLASS_INCLUDE=<dir>, or build the CPU "
      "backend alone: -DFLASHMSA_CUDA=OFF.")
  endif()
  list(GET _found 1 _include)
  message(STATUS "flashmsa: CuTe headers of nvidia-cutlass ${_version} from ${_include}")
  file(REMOVE_RECURSE "${_dest}")
  file(COPY "${_include}/" DESTINATION "${FLASHMSA_CUTE_DIR}")
  file(WRITE "${_dest}/VERSION" "${_version}")
endif()
