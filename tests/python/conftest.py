import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def build_dir():
    d = pathlib.Path(os.environ.get("FLASHMSA_BUILD_DIR", ROOT / "build"))
    if not d.is_absolute():
        d = ROOT / d
    assert (d / "flashmsa").exists(), f"build the project first: {d}/flashmsa is missing"
    return d
