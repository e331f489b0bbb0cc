"""Importing ada_modules stays cheap, and the kernels package works where triton is absent.

Each check runs in a fresh interpreter, because this test process has imported everything already.
"""

import json
import subprocess
import sys
import textwrap

HEAVY_MODULES = ("transformers", "triton", "diffusers")


def _run(code: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_is_lean_and_does_not_initialise_cuda():
    result = _run(
        f"""
        import json, sys
        import ada_modules
        heavy = [name for name in {HEAVY_MODULES!r} if name in sys.modules]
        import torch
        import ada_modules.kernels
        print(json.dumps({{"heavy": heavy, "cuda": torch.cuda.is_initialized()}}))
        """
    )
    assert result == {"heavy": [], "cuda": False}


def test_kernels_run_their_reference_without_triton():
    result = _run(
        """
        import json, sys
        sys.modules["triton"] = None  # what `import triton` meets on macOS or Windows
        import torch
        from ada_modules.kernels import quantize_int8_absmax, resolve_impl, triton_available
        q, scale = quantize_int8_absmax(torch.tensor([[1.0, -2.0]]))
        try:
            resolve_impl("triton", q)
            error = None
        except RuntimeError as exc:
            error = str(exc)
        print(json.dumps({"available": triton_available(), "q": q.tolist(), "error": error}))
        """
    )
    assert result["available"] is False
    assert result["q"] == [[64, -127]]
    assert "triton" in result["error"]
