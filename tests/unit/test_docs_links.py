"""Every relative link and repository path that README.md and docs/ name exists, and every
`#anchor` of a link to a Markdown file is one of that file's headings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.doc_snippets import doc_files
from tests.paths import REPO_ROOT

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A path in backticks or plain text that starts at one of the repository's top-level folders.
TOP = "|".join(re.escape(p.name) for p in REPO_ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")
               and p.name not in {"data", "sparsecast.egg-info"}) + r"|\.ci"
REPO_PATH = re.compile(rf"(?<![\w./<-])((?:{TOP})/[\w./*<>{{}}$-]*[\w/*>}}])")
# Patterns and placeholders, and the operator's own *.local.env files (never committed).
PLACEHOLDER = re.compile(r"[<>*{}$]|NAME|\.\.\.|\.local\.")


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {github_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def prose(path: Path) -> str:
    """The file without its fenced blocks (examples there may name files the reader creates)."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in LINK.findall(prose(doc)):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not this repository's
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {path.name}")
    assert not broken, broken


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_repository_paths_exist(doc: Path) -> None:
    missing = sorted({
        path for path in REPO_PATH.findall(prose(doc))
        if not PLACEHOLDER.search(path) and not (REPO_ROOT / path).exists()
    })
    assert not missing, missing


def test_the_checks_catch_a_broken_link(tmp_path: Path) -> None:
    assert github_slug("Docker Compose (`compose.yaml`)") == "docker-compose-composeyaml"
    assert github_slug("Faults: riding them out, and what each loss costs") == (
        "faults-riding-them-out-and-what-each-loss-costs")
    assert REPO_PATH.findall("see `services/trainer/nope.py` and docs/deploy.md, not x/docs/a") == [
        "services/trainer/nope.py", "docs/deploy.md"]


def test_nothing_cites_a_file_outside_the_repository() -> None:
    """Sources are papers and public code (arXiv ids, public repositories), never a notes file a
    reader does not have (a private REFERENCE file once was)."""
    import subprocess

    private = "REFERENCE" + ".md", "REFERENCE" + " §"  # spelt apart: this file would match itself
    files = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    texts = {".py", ".md", ".yaml", ".yml", ".toml", ".cuda", ".cpu", ""}  # "": Makefile, Dockerfile
    paths = [REPO_ROOT / name for name in files if (REPO_ROOT / name).suffix in texts]
    citing = sorted(str(path.relative_to(REPO_ROOT)) for path in paths if path.is_file()
                    and any(p in path.read_text(errors="replace") for p in private))
    assert not citing, citing
