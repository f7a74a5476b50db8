"""The documentation holds together: the README is a front door (its two commands at the top,
the seed answer on the first screen, short), every relative link of the README and docs/
resolves (the #anchors to a heading of their file), every chapter in docs/ is reachable from
the README, and every ``*.md`` file the docs and the code's comments name is in the repository.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MARKDOWN = [README, ROOT / "tests" / "README.md", *DOCS]
SEED = "## Which loop, and which learning rate?"
# Where a *.md name is code's or docs' prose: the package, its C++, tests, benchmarks (not the
# results they wrote), scripts and the entry points.
SOURCES = sorted(
    {
        p
        for pattern in ("fused_accum/**/*", "csrc/**/*", "tests/**/*", "benchmarks/**/*", "scripts/*")
        for p in ROOT.glob(pattern)
        if p.is_file()
        and p.suffix in (".py", ".sh", ".cpp", ".h", ".cu", ".cuh", ".txt", ".md")
        and "results" not in p.relative_to(ROOT).parts
        and p.name != "test_docs.py"  # (its own test names files that are missing on purpose)
    }
    | {ROOT / name for name in ("run", ".ci/run", "setup.py", "pyproject.toml", "CMakeLists.txt")}
)
# Names of files the code writes, not files of the repository: benchmarks/device_check.sh's report.
WRITTEN = {"summary.md"}

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MD_NAME = re.compile(r"(?<![\w$/.{-])([\w./-]*[\w-]\.md)\b")


def slug(heading: str) -> str:
    """A heading's anchor, as GitHub makes it: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"`|\*\*", "", heading.strip().lstrip("#").strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: pathlib.Path) -> set:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # (a '#' in a code block is no heading)
    return {slug(line) for line in text.splitlines() if line.startswith("#")}


def links(path: pathlib.Path) -> list:
    """The relative links of a Markdown file (outside its code blocks), as written."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def broken_links(path: pathlib.Path, root: pathlib.Path = ROOT) -> list:
    broken = []
    for target in links(path):
        name, _, anchor = target.partition("#")
        linked = (path.parent / name).resolve() if name else path
        if not linked.exists():
            broken.append(f"{path.relative_to(root)}: ({target}): no file {name}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{path.relative_to(root)}: ({target}): no heading #{anchor} in {linked.relative_to(root)}")
    return broken


def missing_md_files(paths: list, root: pathlib.Path = ROOT) -> list:
    """The ``*.md`` names in ``paths`` that are no file (from the root, the naming file's
    folder, or docs/), as "path: name"."""
    missing = []
    for path in paths:
        for name in MD_NAME.findall(path.read_text(errors="replace")):
            if name.startswith("-") or pathlib.PurePath(name).name in WRITTEN:
                continue
            if not any(p.exists() for p in (root / name, path.parent / name, root / "docs" / name)):
                missing.append(f"{path.relative_to(root)}: {name}")
    return missing


def test_the_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 350, f"README.md is {len(lines)} lines: move a chapter to docs/"
    assert SEED in lines, f"the seed answer's heading ({SEED!r}) is gone"
    assert lines.index(SEED) + 1 <= 100, f"the seed answer starts at line {lines.index(SEED) + 1}"
    # The two commands, first: the first code block is exactly them.
    first = README.read_text().split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split("#")[0].strip() for line in first] == ["./run demo", "./run test"]
    assert README.read_text().index("```bash") < README.read_text().index("\n## ")


def test_ci_runs_the_readmes_test_command():
    commands = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("./run")]
    assert commands == ["./run test"]


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


def test_a_broken_link_or_anchor_is_named(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A `code` heading, with words\n")
    page.write_text(
        "# Page\n\n[ok](other.md#a-code-heading-with-words) [here](#page) [gone](gone.md) "
        "[no anchor](other.md#nowhere)\n\n```\n[in code](ignored.md)\n```\n"
    )
    assert broken_links(page, tmp_path) == [
        "page.md: (gone.md): no file gone.md",
        "page.md: (other.md#nowhere): no heading #nowhere in other.md",
    ]


def test_a_missing_md_file_is_named(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "walk.md").write_text("# Walk\n")
    code = tmp_path / "code.py"
    code.write_text("# see docs/walk.md, walk.md and DESIGN.md; $OUT/summary.md is written\n")
    assert missing_md_files([code], tmp_path) == ["code.py: DESIGN.md"]


def test_every_chapter_is_reachable_from_the_readme():
    seen, todo = set(), [README.resolve()]
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != ".md" or not page.exists():
            continue
        seen.add(page)
        todo += [(page.parent / t.partition("#")[0]).resolve() for t in links(page) if t.partition("#")[0]]
    unreachable = [str(p.relative_to(ROOT)) for p in DOCS if p.resolve() not in seen]
    assert unreachable == []


def test_every_md_file_named_in_docs_and_code_is_in_the_repository():
    assert missing_md_files(MARKDOWN + SOURCES) == []
