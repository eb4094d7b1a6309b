"""The build backend of `pip install .` (pyproject.toml): scikit-build-core, plus one decision
taken before pip sets up the build environment: is the CUDA backend built?

- FLASHMSA_CUDA (from `-C cmake.define.FLASHMSA_CUDA=...`, else the environment variable, else
  AUTO): OFF builds the CPU backend alone; ON requires nvcc; AUTO builds the CUDA kernels when
  nvcc is found ($CUDACXX, nvcc on PATH, or /usr/local/cuda/bin/nvcc).
- A CUDA build gets the pinned CuTe headers as a build requirement (requirements-cutlass.txt:
  PyPI's nvidia-cutlass, installed by pip into the isolated build environment; cmake/cutlass.cmake
  finds them there). A CPU build needs nothing but scikit-build-core.
- The decision reaches CMake as FLASHMSA_CUDA=ON/OFF and CUDACXX, so CMake builds what the
  requirements were chosen for.

`python3 cmake/pep517_backend.py` prints the decision (ON <nvcc> or OFF): scripts/setup.sh
configures its CMake build with it, so both builds make the same choice.
"""
import os
import pathlib
import shutil
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_KEY = "cmake.define.FLASHMSA_CUDA"


def _setting(config_settings):
    value = (config_settings or {}).get(_KEY) or os.environ.get("FLASHMSA_CUDA") or "AUTO"
    if isinstance(value, list):  # (-C given several times: the last one counts)
        value = value[-1]
    value = value.upper()
    if value not in ("ON", "OFF", "AUTO"):
        raise ValueError(f"flashmsa: FLASHMSA_CUDA={value}: expected ON, OFF or AUTO")
    return value


def find_nvcc():
    for nvcc in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if nvcc and os.access(nvcc, os.X_OK):
            return nvcc
    return None


def cuda_compiler(config_settings=None):
    """The nvcc of a CUDA build, or None for a CPU-only build."""
    setting = _setting(config_settings)
    if setting == "OFF":
        return None
    nvcc = find_nvcc()
    if nvcc is None and setting == "ON":
        raise RuntimeError("flashmsa: FLASHMSA_CUDA=ON but no nvcc (set CUDACXX or put nvcc on PATH)")
    return nvcc


def _cutlass_requirement():
    lines = (_ROOT / "requirements-cutlass.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _settings(config_settings):
    """config_settings with the decision in it (and CUDACXX set for CMake's first configure)."""
    settings = dict(config_settings or {})
    nvcc = cuda_compiler(config_settings)
    settings[_KEY] = "ON" if nvcc else "OFF"
    if nvcc:
        os.environ["CUDACXX"] = nvcc  # the compiler the decision found (a CUDACXX it rejected is not kept)
    return settings


def _skbuild():
    from scikit_build_core import build  # imported late: `python3 cmake/pep517_backend.py` needs none

    return build


# ---- the PEP 517 / 660 hooks ----------------------------------------------------------------
def get_requires_for_build_wheel(config_settings=None):
    extra = _cutlass_requirement() if cuda_compiler(config_settings) else []
    return _skbuild().get_requires_for_build_wheel(config_settings) + extra


def get_requires_for_build_editable(config_settings=None):
    extra = _cutlass_requirement() if cuda_compiler(config_settings) else []
    return _skbuild().get_requires_for_build_editable(config_settings) + extra


def get_requires_for_build_sdist(config_settings=None):
    return _skbuild().get_requires_for_build_sdist(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _skbuild().prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _skbuild().prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _skbuild().build_wheel(wheel_directory, _settings(config_settings), metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _skbuild().build_editable(wheel_directory, _settings(config_settings), metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    return _skbuild().build_sdist(sdist_directory, config_settings)


if __name__ == "__main__":
    nvcc = cuda_compiler()
    print(f"ON {nvcc}" if nvcc else "OFF")
    sys.exit(0)
