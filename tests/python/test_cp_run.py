"""`flashmsa run --cp N` (flashmsa.cp_run): the step over N gloo processes on the CPU against one process, through
the console command's entry point; its flag errors."""
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(*args, timeout=240):
    env = dict(os.environ)
    if os.environ.get("FLASHMSA_TEST_INSTALLED") != "1":
        env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + env.get("PYTHONPATH", "")
    code = "import sys; from flashmsa import _main_job; sys.argv = ['flashmsa', *sys.argv[1:]]; _main_job.main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd="/")


@pytest.mark.parametrize("world,extra,scheme", [("2", [], "heads contiguous"),
                                                ("3", [], "tokens zigzag"),
                                                ("2", ["--scheme", "tokens", "--layout", "contiguous"],
                                                 "tokens contiguous"),
                                                ("4", ["--scheme", "hybrid"], "hybrid zigzag")])
def test_cp_run_passes(world, extra, scheme):
    r = _run("run", "--cp", world, "--lengths", "300,0,129,77", "--topk", "2", *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    s, layout = scheme.split()
    assert f"scheme {s}, layout {layout}" in r.stdout and "cp check: passed" in r.stdout, r.stdout
    assert len([ln for ln in r.stdout.splitlines() if ln.strip()[:1].isdigit()]) == int(world)


def test_cp_run_bad_flags():
    r = _run("run", "--cp", "0")
    assert r.returncode == 2 and "--cp: expected 1..64 processes" in r.stderr
    r = _run("run", "--cp", "2", "--lengths", "3,-1")
    assert r.returncode == 2 and "--lengths" in r.stderr
