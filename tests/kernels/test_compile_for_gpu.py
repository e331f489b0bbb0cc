"""Every Triton kernel compiles for a Hopper GPU (sm_90), checked on CPU.

The interpreter tests never lower the kernels; this runs ``compile_for_gpu.py`` in its own process
(Triton reads ``TRITON_INTERPRET`` at import, and the test session sets it) so that compiler-only
errors show up without a GPU.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("compile_for_gpu.py")


def test_every_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "_decode_attention_kernel" in result.stdout
