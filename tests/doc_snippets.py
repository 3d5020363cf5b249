"""The commands that README.md and docs/ show in fenced shell blocks, as the tests run them.

A doc command is one logical shell line of a ```bash / ```sh / ``` block: continuation lines
(trailing backslash) joined, comment-only lines dropped. Tests run these lines, not copies of
them, so a doc example that stops working fails a test.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.paths import REPO_ROOT

SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```(\S*)\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    commands: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO_ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def shell_lines(text: str) -> list[str]:
    """Logical lines of a shell block: continuations joined, comment-only and blank lines dropped."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1].rstrip() + " "
            continue
        line = (pending + raw.strip()).strip()
        pending = ""
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def blocks(path: Path) -> list[Block]:
    """Every fenced shell block of one Markdown file."""
    found: list[Block] = []
    lang: str | None = None
    start = 0
    body: list[str] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        fence = FENCE.match(line.strip())
        if fence is None:
            if lang is not None:
                body.append(line)
            continue
        if lang is None:
            lang, start, body = fence.group(1), n, []
        else:
            if lang in SHELL_LANGS:
                found.append(Block(path, start, lang, tuple(shell_lines("\n".join(body)))))
            lang = None
    return found


def all_blocks() -> list[Block]:
    return [block for path in doc_files() for block in blocks(path)]


def commands_starting(word: str) -> list[tuple[str, str]]:
    """(where, command) of every doc command whose first word is `word`."""
    return [
        (block.where, command)
        for block in all_blocks()
        for command in block.commands
        if command.split(maxsplit=1)[0] == word
    ]


def block_with(path: Path, first_command: str) -> Block:
    """The one shell block of `path` whose first command starts with `first_command`."""
    matches = [b for b in blocks(path) if b.commands and b.commands[0].startswith(first_command)]
    assert len(matches) == 1, f"{path.name}: {len(matches)} blocks start with {first_command!r}"
    return matches[0]


def strip_comment(command: str) -> str:
    """The command without a trailing `# comment` (outside quotes)."""
    quote = ""
    for i, char in enumerate(command):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or command[i - 1].isspace()):
            return command[:i].rstrip()
    return command


def compose_commands() -> list[list[str]]:
    """The README's Docker Compose commands, as `docker compose` arguments (the block that starts
    with `docker compose up`): what an operator types, and what the docker test runs."""
    block = block_with(COMPOSE_DOC, "docker compose up")
    commands = []
    for command in block.commands:
        words = shlex.split(strip_comment(command))
        assert words[:2] == ["docker", "compose"], f"{block.where}: {command}"
        commands.append(words[2:])
    return commands


# Where the operator's commands live: the compose commands in the README (its deploy section), the
# services by hand and the REST examples in docs/api.md.
COMPOSE_DOC = REPO_ROOT / "README.md"
REST_DOC = REPO_ROOT / "docs" / "api.md"


def rest_script(sections: str = "TRW") -> str:
    """docs/api.md's REST block as one script, from the sections (T= trainer, R= registry, W=
    worker) asked for. Before the registry's lines it waits until the run has the version their
    plan names (a compose demo gets there on its own within minutes)."""
    block = block_with(REST_DOC, "T=http://127.0.0.1:8000")
    assert [c[:2] for c in block.commands if re.match(r"^[TRW]=", c)] == ["T=", "R=", "W="]
    needed = max(int(v) for v in re.findall(r"to=(\d+)", "\n".join(block.commands)))
    lines: list[str] = []
    section = ""
    for command in block.commands:
        if re.match(r"^[TRW]=", command):
            section = command[0]
            if section == "R" and section in sections:
                lines.append(f'for _ in $(seq 900); do [ "$(command curl -s "$T/v1/status" | jq .version)" '
                             f"-ge {needed} ] && break; sleep 1; done")
        if section in sections:
            lines.append(command)
    return "\n".join(lines)


def write_uploads(folder: Path) -> None:
    """The files the examples upload (`--file gsm8k.jsonl`, `@train.jsonl`), in GSM8K's shape."""
    rows = [{"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b} #### {a + b}"}
            for a, b in ((2, 3), (10, 32), (7, 8))]
    text = "".join(json.dumps(row) + "\n" for row in rows)
    for name in ("gsm8k.jsonl", "train.jsonl"):
        (folder / name).write_text(text)


def run_shell(script: str, urls: dict[str, str], env: dict[str, str], cwd: Path,
              timeout: float = 1200) -> subprocess.CompletedProcess[str]:
    """Run doc lines in bash with the docs' addresses (`urls`: doc address → live one) replaced,
    the venv's `sparsecast` on PATH and `curl` failing on an HTTP error instead of printing it."""
    for doc_url, live in urls.items():
        script = script.replace(doc_url, live)
    full_env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **env}
    preamble = 'set -euo pipefail\ncurl() { command curl -fsS --max-time 120 "$@"; echo; }\n'
    return subprocess.run(["bash", "-c", preamble + script], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)
