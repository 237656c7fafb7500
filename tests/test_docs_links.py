"""Every cross-reference in the README and docs/ lands on something that exists: a markdown link's file and its
``#anchor`` (GitHub's heading slugs), and a plain ``docs/X.md, "Heading"`` reference in the docs, the code's
docstrings and comments, and the tests. A section moved to another page, or renamed, without its references
fails here, naming each stale one."""

from __future__ import annotations

import re
from pathlib import Path

from tests.pipeline_helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SOURCES = [p for d in ("rcr", "pipeline", "jobs", "infra", "embedded", "benchmarks", "tests")
           for p in sorted((REPO / d).rglob("*")) if p.suffix in (".py", ".sh", ".yaml") and p.is_file()
           and p != Path(__file__).resolve()]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# docs/X.md, "Heading" or docs/X.md "Heading" (a quoted heading, maybe its first words, maybe over a line break)
NAMED = re.compile(r"docs/(\w+\.md),?\s+\"([^\"]+)\"")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '# comment' in a code block is no heading
    return [m.group(1) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)]


def test_every_markdown_link_lands_on_a_file_and_heading():
    stale = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"\w+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                stale.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in {slug(h) for h in headings(dest)}:
                stale.append(f"{page.relative_to(REPO)}: {target} (no such heading in {dest.name})")
    assert not stale, "\n".join(stale)


def test_every_named_section_reference_names_a_heading_of_that_page():
    stale = []
    for src in PAGES + SOURCES:
        text = " ".join(src.read_text(errors="replace").split())  # a reference may break over lines
        text = re.sub(r"\s*#\s*", " ", text) if src.suffix in (".py", ".sh", ".yaml") else text  # comment marks
        for page, name in NAMED.findall(text):
            dest = REPO / "docs" / page
            if not dest.exists():
                stale.append(f"{src.relative_to(REPO)}: docs/{page} (no such page)")
            elif not any(h.lower().startswith(name.lower()) for h in headings(dest)):
                stale.append(f'{src.relative_to(REPO)}: docs/{page}, "{name}" (no such heading)')
    assert not stale, "\n".join(stale)
