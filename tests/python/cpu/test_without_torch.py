"""The package where torch is not installed (simulated in a child process: sys.modules["torch"] = None makes
`import torch` fail as it does without torch): torch-facing calls raise EpxError saying what is missing and
how to install it, and python -m epx_tools.bench says why it measured nothing and exits non-zero."""

import os
import subprocess
import sys

import pytest

NO_TORCH = "import sys; sys.modules['torch'] = None\n"


def _run(code, *args):
    env = dict(os.environ, EPX_NO_TORCH_PRELOAD="1")
    return subprocess.run([sys.executable, "-c", NO_TORCH + code, *args], env=env, capture_output=True, text=True,
                          timeout=120)


def test_buffer_without_torch_raises_epx_error_naming_the_remedy():
    # The CUDA check comes first (a build without CUDA is not mended by installing torch): skip it here, so a
    # CPU build reaches the torch import as a CUDA build would.
    code = """
import epx, epx.buffer
epx.buffer._require_cuda_runtime = lambda: None
try:
    epx.Buffer(None)
except epx.EpxError as error:
    print("EpxError:", error)
    print("cause:", type(error.__cause__).__name__)
"""
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert "EpxError: torch is not installed: epx's torch layer (epx.Buffer" in result.stdout
    assert "pip install torch" in result.stdout and "pytorch.org/get-started" in result.stdout
    assert "cause: ModuleNotFoundError" in result.stdout


def test_torch_helper_without_torch():
    result = _run("import epx._util as u\ntry:\n    u.torch()\nexcept u.EpxError as e:\n    print(e)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("torch is not installed: epx's torch layer")


def test_a_missing_dependency_of_torch_keeps_its_own_error(monkeypatch):
    # torch installed but broken (one of its imports missing): that module's name, not "torch is not installed".
    import builtins

    import epx._util as util

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "torch":
            raise ModuleNotFoundError("No module named 'numpy'", name="numpy")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(util, "_torch_module", None)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ModuleNotFoundError, match="numpy"):
        util.torch()


@pytest.mark.parametrize("with_cuda", [False, True])
def test_bench_without_torch_says_why_and_exits_1(with_cuda):
    code = f"""
import runpy, sys, epx
epx.WITH_CUDA = {with_cuda}  # a CUDA build reaches the torch check
sys.argv = ["epx_tools.bench", "--json"]
runpy.run_module("epx_tools.bench", run_name="__main__")
"""
    result = _run(code)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stdout == ""  # nothing measured, nothing on stdout (not even with --json)
    assert "nothing measured" in result.stderr
    if with_cuda:
        assert "torch is not installed" in result.stderr and "pip install torch" in result.stderr
    else:
        assert "epx was built without CUDA" in result.stderr
