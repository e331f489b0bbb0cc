"""The documentation site builds in strict mode (broken links, missing API targets fail)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_mkdocs_builds_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "techniques" / "adakvq" / "index.html").exists()
    assert (tmp_path / "api" / "sweep" / "index.html").exists()
