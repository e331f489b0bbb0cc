"""The catalogue agrees with the abstracts, the docs pages, the README table and the mkdocs nav."""

import re
from pathlib import Path

import pytest
import yaml

from ada_modules.catalog import STATUSES, TECHNIQUES, Technique, by_slug

ROOT = Path(__file__).resolve().parents[1]
# CI clones the repository with the shared folder beside it: <parent>/shared and <parent>/<repo>.
ABSTRACTS = ROOT.parent / "shared" / "seeds" / "abstracts.md"
SLUGS = [t.slug for t in TECHNIQUES]


def test_seventeen_unique_slugs_and_names():
    assert len(TECHNIQUES) == 17
    assert len(set(SLUGS)) == 17
    assert len({t.name for t in TECHNIQUES}) == 17
    for t in TECHNIQUES:
        assert t.status in STATUSES
        assert t.kind and t.summary


@pytest.mark.skipif(not ABSTRACTS.is_file(), reason=f"{ABSTRACTS} not present")
def test_slugs_match_abstracts():
    text = ABSTRACTS.read_text(encoding="utf-8")
    slugs = re.findall(r"^slug: `([^`]+)`", text, flags=re.MULTILINE)
    assert sorted(slugs) == sorted(SLUGS)


def test_by_slug():
    assert by_slug("adera").name == "AdERA"
    with pytest.raises(KeyError, match="unknown technique 'nope'"):
        by_slug("nope")


def test_bad_status_is_rejected():
    with pytest.raises(ValueError, match="status"):
        Technique("X", "x", "Optimizer", "x", status="done")


@pytest.mark.parametrize("slug", SLUGS)
def test_docs_page_exists(slug):
    page = ROOT / "docs" / "techniques" / f"{slug}.md"
    assert page.is_file()
    t = by_slug(slug)
    text = page.read_text(encoding="utf-8")
    assert text.startswith(f"# {t.name}")
    if t.issue is not None:
        assert f"issue {t.issue}" in text


def test_readme_table_has_a_row_per_technique():
    rows = [
        line
        for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("|")
    ]
    for t in TECHNIQUES:
        matching = [r for r in rows if f"(docs/techniques/{t.slug}.md)" in r]
        assert len(matching) == 1, f"README needs exactly one table row for {t.slug}"
        cells = [c.strip() for c in matching[0].strip("|").split("|")]
        assert cells[0] == t.name
        assert cells[1] == f"`{t.slug}`"
        assert cells[2] == t.kind
        assert cells[3].startswith(t.status)


def _nav_pages(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, list):
        for item in node:
            yield from _nav_pages(item)
    elif isinstance(node, dict):
        for value in node.values():
            yield from _nav_pages(value)


def test_mkdocs_nav_lists_every_technique():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    pages = set(_nav_pages(config["nav"]))
    for slug in SLUGS:
        assert f"techniques/{slug}.md" in pages
    for page in pages:
        if page.endswith(".md"):
            assert (ROOT / "docs" / page).is_file(), f"nav lists missing page {page}"
