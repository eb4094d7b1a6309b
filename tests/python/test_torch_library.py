"""The ctypes layer: library lookup, the struct layouts against the C header, views, overhead."""
import ctypes
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
ROOT = pathlib.Path(__file__).resolve().parents[2]

import flashmsa  # noqa: E402
from flashmsa import _lib as L  # noqa: E402

ABI_PROBE = r"""
#include <stddef.h>
#include <stdio.h>
#include "flashmsa/flashmsa.h"
#define SIZE(T) printf(#T " %zu\n", sizeof(T));
#define OFF(T, f) printf(#T "." #f " %zu\n", offsetof(T, f));
int main(void) {
  SIZE(flashmsa_tensor_t) SIZE(flashmsa_select_args_t) SIZE(flashmsa_fwd_args_t) SIZE(flashmsa_bwd_args_t)
  FIELDS
  return 0;
}
"""
STRUCTS = {"flashmsa_tensor_t": L.Tensor, "flashmsa_select_args_t": L.SelectArgs,
           "flashmsa_fwd_args_t": L.FwdArgs, "flashmsa_bwd_args_t": L.BwdArgs}


def test_struct_layouts_match_the_header(tmp_path):
    """Every field's offset and every struct's size, as the C compiler sees flashmsa.h."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    offs = " ".join(f"OFF({c}, {f})" for c, py in STRUCTS.items() for f, _ in py._fields_)
    (tmp_path / "abi.c").write_text(ABI_PROBE.replace("FIELDS", offs))
    subprocess.run([cc, "-I", str(ROOT / "include"), str(tmp_path / "abi.c"), "-o", str(tmp_path / "abi")], check=True)
    got = dict(line.rsplit(" ", 1) for line in subprocess.check_output([str(tmp_path / "abi")], text=True).splitlines())
    for c, py in STRUCTS.items():
        assert int(got[c]) == ctypes.sizeof(py), c
        for f, _ in py._fields_:
            assert int(got[f"{c}.{f}"]) == getattr(py, f).offset, f"{c}.{f}"


def test_library_lookup_order(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHMSA_LIBRARY", "/x/libflashmsa.so")
    assert L.library_candidates() == [pathlib.Path("/x/libflashmsa.so")]
    monkeypatch.delenv("FLASHMSA_LIBRARY")
    monkeypatch.setenv("FLASHMSA_BUILD_DIR", str(tmp_path))
    c = L.library_candidates()
    installed = pathlib.Path(L.__file__).parent / "lib" / "libflashmsa.so"  # pip install's place
    assert c[0] == tmp_path / "libflashmsa.so" and c[1] == installed
    monkeypatch.setenv("FLASHMSA_BUILD_DIR", "build-rel")
    c = L.library_candidates()
    assert pathlib.Path.cwd() / "build-rel" / "libflashmsa.so" in c
    # the repository root's build-rel/ and build/ only for the source tree's package
    in_tree = ROOT / "python" in pathlib.Path(L.__file__).resolve().parents
    assert (ROOT / "build-rel" / "libflashmsa.so" in c) == in_tree
    assert (ROOT / "build" / "libflashmsa.so" in c) == in_tree


def test_installed_package_is_under_test():
    """With FLASHMSA_TEST_INSTALLED=1 (CI after pip install .): the package and the library come
    from the installation, not from the source tree."""
    if os.environ.get("FLASHMSA_TEST_INSTALLED") != "1":
        pytest.skip("testing the source tree's package (FLASHMSA_TEST_INSTALLED is not 1)")
    pkg = pathlib.Path(flashmsa.__file__).resolve().parent
    assert ROOT / "python" not in pkg.parents, f"flashmsa imported from the source tree: {pkg}"
    assert L.library_path().resolve() == pkg / "lib" / "libflashmsa.so"
    assert (pkg / "bin" / "flashmsa").is_file()


def test_loaded_library():
    assert flashmsa.library_path().name == "libflashmsa.so"
    assert flashmsa.version() == "0.1.0"
    assert flashmsa.cuda_available() in (True, False)
    assert flashmsa.BLOCK_SIZE == 128 and flashmsa.MAX_TOPK == 64


def test_views():
    x = torch.zeros(3, 5, 2, 8, dtype=torch.bfloat16)[:, 1:4]
    v = L.view(x)
    assert (v.ndim, v.dtype, v.device_type) == (4, L.DTYPE_BF16, L.DEVICE_CPU)
    assert list(v.shape)[:4] == [3, 3, 2, 8] and list(v.strides)[:4] == [80, 16, 8, 1]
    assert v.data == x.data_ptr()
    absent = L.view(None)
    assert absent.data is None and absent.ndim == 0
    kl = L.view(torch.zeros((), dtype=torch.float32))
    assert kl.ndim == 0 and kl.data
    with pytest.raises(TypeError, match="dtype"):
        L.view(torch.zeros(2, dtype=torch.int64))


def test_import_without_library(tmp_path):
    """`import flashmsa` works without the library (the reference needs none); the first call
    that needs it says where it looked."""
    code = ("import sys; sys.path.insert(0, %r); import flashmsa, torch\n"
            "x = torch.randn(1, 130, 2, 8)\n"
            "out, kl = flashmsa.reference.msa_attention(x, x[:, :, :1], x[:, :, :1], x, x[:, :, :1], 2)\n"
            "try:\n    flashmsa.msa_attention(x, x[:, :, :1], x[:, :, :1], x, x[:, :, :1], 2)\n"
            "except OSError as e:\n    print('ERR', e)\n") % str(pathlib.Path(flashmsa.__file__).parents[1])
    env = {**os.environ, "FLASHMSA_LIBRARY": str(tmp_path / "nope.so")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "ERR" in r.stdout and "nope.so" in r.stdout and "FLASHMSA_LIBRARY" in r.stdout, r.stdout + r.stderr
