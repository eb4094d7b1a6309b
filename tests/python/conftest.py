import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The package under test: the source tree's (python/, put first on the path) or, with
# FLASHMSA_TEST_INSTALLED=1, the one installed into the running Python (pip install .: CI tests
# that one, from outside the source tree).
INSTALLED = os.environ.get("FLASHMSA_TEST_INSTALLED") == "1"
if not INSTALLED:
    sys.path.insert(0, str(ROOT / "python"))


@pytest.fixture(scope="session")
def build_dir():
    """The folder of the main job program `flashmsa`: the installed package's bin/ (installed
    mode), else the CMake build ($FLASHMSA_BUILD_DIR, default build/)."""
    if INSTALLED:
        import flashmsa

        d = pathlib.Path(flashmsa.__file__).resolve().parent / "bin"
    else:
        d = pathlib.Path(os.environ.get("FLASHMSA_BUILD_DIR", ROOT / "build"))
        if not d.is_absolute():
            d = ROOT / d
    assert (d / "flashmsa").exists(), f"build the project first: {d}/flashmsa is missing"
    return d
