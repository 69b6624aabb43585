"""The fenced code blocks of a Markdown page, as the docs tests and `.ci/docs_as_reader.py`
read them (standard library only: the CI script runs it outside the project's venv).

A block may say it cannot run with `<!-- not-runnable: why -->` on the line before its fence;
a `# name.py` line (or `# folder/name.py`, `# ./name.py`) inside a Python block sends the lines
after it to that file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from . import ROOT

FENCE = re.compile(r"^```(\S*)(?:\s.*)?$")
SKIP = re.compile(r"^<!-- not-runnable: (.+?) -->\s*$")
FILE_LINE = re.compile(r"^# ((?:\./|\w+/)?\w+\.py)\b")
#: Fences this reader would not see (indented, or of tildes): refused rather than skipped.
UNREAD_FENCE = re.compile(r"^(\s+```|~~~)")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    skip_reason: str | None

    @property
    def where(self) -> str:
        name = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path.name
        return f"{name}:{self.line}"


def blocks_of(path: Path, *, section: str | None = None) -> list[Block]:
    """The fenced blocks of the page at `path`, in order; with `section` (a heading line such
    as "## Quick start"), only those between it and the next heading of its level.

    ValueError when `section` is not on the page or a block is not closed.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    first, last = 0, len(lines)
    if section is not None:
        if section not in lines:
            raise ValueError(f"{path} has no {section!r} heading")
        first = lines.index(section) + 1
        level = section.split(" ", 1)[0] + " "
        last = next((n for n in range(first, last) if lines[n].startswith(level)), last)
    blocks: list[Block] = []
    start, language, body = 0, None, []
    for number in range(first, last):
        line = lines[number]
        if language is None:
            if UNREAD_FENCE.match(line):
                raise ValueError(
                    f"{path.name}:{number + 1}: fence blocks with ``` at the line start"
                )
            match = FENCE.match(line)
            if match:
                start, language, body = number + 1, match.group(1) or "text", []
        elif line.strip() == "```":
            skip = SKIP.match(lines[start - 2]) if start >= 2 else None
            code = "\n".join(body) + "\n"
            blocks.append(Block(path, start, language, code, skip.group(1) if skip else None))
            language = None
        else:
            body.append(line)
    if language is not None:
        raise ValueError(f"{path.name}:{start}: a ``` block is not closed")
    return blocks


def split_files(code: str) -> list[tuple[str | None, str]]:
    """A Python block split at its `# name.py` lines: (file name or None, code) parts."""
    parts: list[tuple[str | None, list[str]]] = [(None, [])]
    for line in code.splitlines():
        match = FILE_LINE.match(line)
        if match:
            parts.append((match.group(1), []))
        else:
            parts[-1][1].append(line)
    return [(name, "\n".join(body) + "\n") for name, body in parts if "".join(body).strip()]
