"""examples/quickstart.py, the README's call: forward, loss, backward, kl read after the backward;
on the CPU, and on the GPU (bf16) where the CUDA backend sees one."""
import pytest

from file_module import load

torch = pytest.importorskip("torch")


def test_quickstart_cpu():
    r = load("examples/quickstart.py", "quickstart").main(["--cpu"])
    assert r["device"] == "cpu" and r["kl"] > 0


def test_quickstart_gpu():
    import flashmsa

    if not (torch.cuda.is_available() and flashmsa.cuda_available()):
        pytest.skip("no GPU for flashmsa's CUDA backend")
    r = load("examples/quickstart.py", "quickstart").main([])
    assert r["device"] == "cuda" and r["kl"] > 0
