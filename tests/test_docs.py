"""The project's documents stand alone: every path the README's Architecture section names exists, and the code cites
only documents that are in the repository (docs/architecture.md, by invariant number and section)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = [p for d in ("services", "shared", "tools", "benchmarks", "tests") for p in (ROOT / d).rglob("*.py")]
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()


def test_every_path_the_readme_architecture_section_names_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Architecture\n", 1)[1].split("\n## ", 1)[0]
    checked = 0
    for line in section.splitlines():
        directory = None
        for token in re.findall(r"`([^`\s]+)`", line):
            if re.match(r"(services|shared|tools|docs|tests|benchmarks|deploy)/", token):
                assert (ROOT / token).exists(), f"README's Architecture names {token}, which is not in the tree"
                directory = (ROOT / token).parent if token.endswith(".py") else ROOT / token
                checked += 1
            elif token.endswith(".py") and directory is not None:  # `a/b.py`, `c.py`: c.py beside b.py
                assert (directory / token).exists(), f"README's Architecture names {token} beside {directory}"
                checked += 1
    assert checked > 20  # the table was found and read


def test_the_readme_architecture_tree_is_the_tree() -> None:
    """Every folder and file the tree drawing names exists where it says (a line indented under ``shared/`` names
    what is inside shared/), and every package of shared/ and services/ is drawn."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Architecture\n", 1)[1].split("\n## ", 1)[0]
    drawing = section.split("```\n", 2)[1]
    named: set[Path] = set()
    parent = ROOT
    for line in drawing.splitlines():
        if not line.strip() or line.startswith(" " * 10):  # a continued description
            continue
        indented = line.startswith("  ")
        words = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]  # the names, before the description
        base = parent if indented else ROOT
        for name in (w.strip(",") for w in words.split()):
            path = base / name.rstrip("/")
            assert path.exists(), f"README's Architecture draws {path.relative_to(ROOT)}, which is not in the tree"
            named.add(path)
        if not indented:
            parent = ROOT / words.rstrip("/") if words.endswith("/") else ROOT
    for top in ("shared", "services"):
        for package in (ROOT / top).iterdir():
            if package.is_dir() and (package / "__init__.py").exists():
                assert package in named, f"README's Architecture does not draw {package.relative_to(ROOT)}/"


def test_the_code_cites_only_documents_in_the_repository() -> None:
    invariants = {int(n) for n in re.findall(r"^(\d+)\. \*\*", ARCHITECTURE, flags=re.MULTILINE)}
    assert invariants == set(range(1, 11))
    sections = set(re.findall(r"^#+ (.+)$", ARCHITECTURE, flags=re.MULTILINE))
    cited = 0
    for path in CODE:
        text = path.read_text()
        name = path.relative_to(ROOT)
        assert not re.search(r"DESIGN(\.md| §)|\bseed \d", text), f"{name} cites a document that is not here"
        for number in re.findall(r"docs/architecture\.md, invariant (\d+)", text):
            assert int(number) in invariants, f"{name} cites invariant {number}"
            cited += 1
        for title in re.findall(r'docs/architecture\.md, "([^"]+)"', text.replace("\n", " ")):
            assert any(s.startswith(title) for s in sections), f"{name} cites a section {title!r} that is not there"
            cited += 1
    assert cited >= 5
