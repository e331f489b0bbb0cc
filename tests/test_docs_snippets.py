"""Every ```python block of README.md and docs/**/*.md runs as written.

The blocks of one page run in order in one namespace, like a doctest file, in a fresh temporary
working directory (so a block may write ``runs/``, ``lightning_logs/``, ...) that holds a copy of
``cli_configs/`` (blocks may use the repository's configs by relative path, as a reader in a
clone would). Each page is one test, named after the page; a failing block is reported with its
line number, and the traceback shows the markdown lines themselves.

A page runs in this process, with ``__name__ == "__main__"``. A page with an
``if __name__ == "__main__":`` block (a multi-process Trainer, which Lightning starts by re-running
the script) is a script: here it runs in this process with another ``__name__`` (imports and
definitions run, the guarded part does not), and ``test_script_pages_run`` (marked ``slow``: two
processes that each import torch and Lightning take 20-30 s) runs the whole page as a script in a
subprocess, the page's blocks each at its own line number in a file ``snippets_<page>.py``.

Fences follow CommonMark: a fence closes only with the same character repeated at least as often,
so a ```python block nested in a ````markdown block (the technique page template) is part of that
block, not a snippet. The language is the first word of the info string (``python`` or ``py``).

**Fragments.** Keep them very rare: prefer a complete, tiny example. A block that deliberately
does not run carries a marker on the line right before its opening fence (blank lines between
are allowed)::

    <!-- snippet: not run (the reason, in a few words) -->
    ```python
    ...
    ```

and the same page and reason are listed in ``FRAGMENTS`` below, e.g.
``("docs/techniques/x.md", "the reason, in a few words")``; the test fails when the markers and
the list disagree, and when a ``<!-- snippet: ... -->`` comment is malformed or not followed by a
python block.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# (page relative to the repository root, reason as written in the marker) of every fragment.
FRAGMENTS: set[tuple[str, str]] = set()

PYTHON_LANGUAGES = {"python", "py"}
SUBPROCESS_TIMEOUT_S = 300

_FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_MARKER = re.compile(r"^\s*<!--\s*snippet:\s*not run\s*\((?P<reason>.*\S.*)\)\s*-->\s*$")
_MARKER_LIKE = re.compile(r"<!--\s*snippet\b")
_MAIN_GUARD = re.compile(r"^\s*if\s+__name__\s*==\s*['\"]__main__['\"]\s*:", re.MULTILINE)


@dataclass(frozen=True)
class Block:
    """One fenced python block: ``line`` is the 1-based line of its first code line."""

    line: int
    source: str
    fragment: str | None  # the marker's reason, or None for a block that runs


def parse_blocks(text: str) -> list[Block]:
    """The python blocks of a markdown text, in order, with their fragment markers.

    Raises:
        ValueError: On a malformed ``<!-- snippet: ... -->`` comment, a marker that is not followed
            by a python block, or an unclosed fence.
    """
    lines = text.splitlines()
    blocks: list[Block] = []
    pending: tuple[int, str] | None = None  # (line, reason) of a marker waiting for its fence
    i = 0
    while i < len(lines):
        line = lines[i]
        opening = _FENCE_OPEN.match(line)
        if opening and not (opening["fence"][0] == "`" and "`" in opening["info"]):
            indent, fence = opening["indent"], opening["fence"]
            words = opening["info"].split()
            language = words[0].lower() if words else ""
            body: list[str] = []
            j = i + 1
            closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
            while j < len(lines) and not closing.match(lines[j]):
                body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
                j += 1
            if j == len(lines):
                raise ValueError(f"line {i + 1}: fence {fence!r} is never closed")
            if language in PYTHON_LANGUAGES:
                reason = pending[1] if pending else None
                blocks.append(Block(i + 2, textwrap.dedent("\n".join(body)) + "\n", reason))
            elif pending:
                raise ValueError(
                    f"line {pending[0]}: snippet marker is followed by a {language or 'plain'} "
                    "block, not a python block"
                )
            pending = None
            i = j + 1
            continue
        if _MARKER_LIKE.search(line):
            marker = _MARKER.match(line)
            if not marker:
                raise ValueError(
                    f"line {i + 1}: malformed snippet marker {line.strip()!r}; "
                    "write <!-- snippet: not run (reason) -->"
                )
            if pending:
                raise ValueError(f"line {pending[0]}: snippet marker without a python block")
            pending = (i + 1, marker["reason"].strip())
        elif line.strip() and pending:
            raise ValueError(f"line {pending[0]}: snippet marker is not right before a fence")
        i += 1
    if pending:
        raise ValueError(f"line {pending[0]}: snippet marker without a python block")
    return blocks


def _pages() -> list[str]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [str(page.relative_to(ROOT)) for page in pages]


def _page_blocks(page: str) -> list[Block]:
    try:
        return parse_blocks((ROOT / page).read_text(encoding="utf-8"))
    except ValueError as error:
        raise AssertionError(f"{page}: {error}") from None


def _has_code(page: str) -> bool:
    try:
        return bool(parse_blocks((ROOT / page).read_text(encoding="utf-8")))
    except ValueError:
        return True  # its test reports the error, rather than collection failing


PAGES_WITH_CODE = [page for page in _pages() if _has_code(page)]


def _padded(blocks: list[Block]) -> str:
    """The blocks' code, each at its own line number of the page, blank lines elsewhere."""
    out: list[str] = []
    for block in blocks:
        code = block.source.splitlines()
        out.extend([""] * (block.line - 1 - len(out)))
        out.extend(code)
    return "\n".join(out) + "\n"


def test_fragment_markers_match_allow_list() -> None:
    marked = {
        (page, block.fragment)
        for page in _pages()
        for block in _page_blocks(page)
        if block.fragment is not None
    }
    assert marked == FRAGMENTS, (
        f"marked in the docs but not in FRAGMENTS: {sorted(marked - FRAGMENTS)}; "
        f"in FRAGMENTS but not marked: {sorted(FRAGMENTS - marked)}"
    )


def test_parse_blocks() -> None:
    text = textwrap.dedent(
        """\
        # Page

        ```python
        a = 1
        ```

        ````markdown
        ```python
        not a snippet
        ```
        ````

        <!-- snippet: not run (needs a GPU) -->

        ```py title="x.py"
        b = a
        ```

        !!! note
            ```python
            if a:
                c = 2
            ```
        """
    )
    blocks = parse_blocks(text)
    assert [(b.line, b.source, b.fragment) for b in blocks] == [
        (4, "a = 1\n", None),
        (16, "b = a\n", "needs a GPU"),
        (21, "if a:\n    c = 2\n", None),
    ]
    assert _padded(blocks).splitlines()[15] == "b = a"
    for bad in (
        "<!-- snippet: not run -->\n```python\nx\n```\n",  # no reason
        "<!-- snippet: not run (r) -->\ntext\n```python\nx\n```\n",  # not right before the fence
        "<!-- snippet: not run (r) -->\n```bash\nx\n```\n",  # not a python block
        "```python\nx\n",  # unclosed
    ):
        with pytest.raises(ValueError):
            parse_blocks(bad)


@pytest.fixture
def snippet_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh working directory with a copy of ``cli_configs/``, and one torch thread.

    The snippets' models are tiny: one thread is about as fast as two on an idle machine, and
    several times faster on a busy one (where two threads spin waiting for each other). The
    environment (``seed_everything`` sets ``PL_GLOBAL_SEED``) and the random generators are
    restored afterwards, so the snippets leave no trace on the tests that run after them.
    """
    shutil.copytree(ROOT / "cli_configs", tmp_path / "cli_configs")
    monkeypatch.chdir(tmp_path)
    threads, environ = torch.get_num_threads(), dict(os.environ)
    rng_states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    torch.set_num_threads(1)
    try:
        yield tmp_path
    finally:
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(environ)
        random.setstate(rng_states[0])
        np.random.set_state(rng_states[1])
        torch.set_rng_state(rng_states[2])


def _run_in_subprocess(page: str, blocks: list[Block], workdir: Path) -> None:
    script = workdir / f"snippets_{Path(page).stem}.py"  # not a module name a block imports
    script.write_text(_padded(blocks), encoding="utf-8")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, script.name],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    if done.returncode:
        where = [f"line {b.line}" for b in blocks if b.fragment is None]
        output = (done.stdout + done.stderr)[-6000:].replace(str(script), page)
        pytest.fail(
            f"{page} (blocks at {', '.join(where)}, run as a script) exited with "
            f"{done.returncode}:\n{output}",
            pytrace=False,
        )


def _run_in_process(page: str, blocks: list[Block], name: str = "__main__") -> None:
    namespace: dict[str, object] = {"__name__": name}
    for block in blocks:
        if block.fragment is not None:
            continue
        # Padding puts each line at its line number in the page, and the filename is the page, so
        # a traceback shows the markdown lines themselves.
        code = compile("\n" * (block.line - 1) + block.source, str(ROOT / page), "exec")
        try:
            exec(code, namespace)
        except Exception as error:  # any error of a snippet is the failure reported
            failure = error
        else:
            continue
        # Leave out this function's frame: the traceback starts in the page.
        lines = traceback.format_exception(type(failure), failure, failure.__traceback__.tb_next)
        pytest.fail(
            f"{page}: the block at line {block.line} failed:\n{''.join(lines)}", pytrace=False
        )


def _runnable(page: str) -> list[Block]:
    blocks = [block for block in _page_blocks(page) if block.fragment is None]
    if not blocks:
        pytest.skip("every block is a marked fragment")
    return blocks


def _is_script(page: str) -> bool:
    try:
        blocks = parse_blocks((ROOT / page).read_text(encoding="utf-8"))
    except ValueError:
        return False  # test_snippets_run reports the error
    return any(_MAIN_GUARD.search(b.source) for b in blocks if b.fragment is None)


@pytest.mark.parametrize("page", PAGES_WITH_CODE)
def test_snippets_run(page: str, snippet_dir: Path) -> None:
    name = "__docs_snippet__" if _is_script(page) else "__main__"
    _run_in_process(page, _runnable(page), name)


@pytest.mark.slow
@pytest.mark.parametrize("page", [page for page in PAGES_WITH_CODE if _is_script(page)])
def test_script_pages_run(page: str, snippet_dir: Path) -> None:
    _run_in_subprocess(page, _runnable(page), snippet_dir)
