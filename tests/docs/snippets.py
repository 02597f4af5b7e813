"""The code blocks of README.rst and docs/**/*.rst, as the docs tests run them.

A block is ``.. code-block:: LANG`` (with an optional ``:caption: FILE``: the block is that file's
content) and its indented body. An rst comment right before it, ``.. snippet: KEY[=VALUE]``, says how
it is tested: ``ranks=2`` (also run at 2 ranks), ``ci`` (an install or test command that .ci/run runs
itself), ``tested-by=FILE`` (a test of its own runs it), ``not-run=REASON`` (it cannot run here).
"""

from __future__ import annotations

import re
import shlex
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Block:
    """One code block: where it is, its language, its text, its caption and its ``snippet`` marks."""

    path: Path
    line: int
    lang: str
    text: str
    caption: str | None = None
    marks: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def sources() -> list[Path]:
    """README.rst and every page of docs/ (not the build's output)."""
    return [ROOT / "README.rst", *sorted(p for p in (ROOT / "docs").rglob("*.rst") if "_build" not in p.parts)]


def blocks(path: Path) -> list[Block]:
    """Every ``.. code-block::`` of ``path``, in order."""
    lines = path.read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)\.\. code-block:: *(\S+)\s*$", line)
        if not m:
            continue
        indent = len(m.group(1))
        j, caption = i + 1, None
        while j < len(lines) and re.match(r"^\s+:\w+:", lines[j]):
            opt = re.match(r"^\s+:caption: *(.+)$", lines[j])
            caption = opt.group(1).strip() if opt else caption
            j += 1
        body = []
        for k in range(j, len(lines)):
            text = lines[k]
            if text.strip() and len(text) - len(text.lstrip()) <= indent:
                break
            body.append(text)
        marks = {}
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        while k >= 0 and (mk := re.match(r"^\s*\.\. snippet: *([\w-]+)(?:=(.*))?$", lines[k])):
            marks[mk.group(1)] = (mk.group(2) or "").strip()
            k -= 1
            while k >= 0 and not lines[k].strip():
                k -= 1
        found.append(Block(path, i + 1, m.group(2), textwrap.dedent("\n".join(body)).strip() + "\n", caption, marks))
    return found


def all_blocks() -> list[Block]:
    return [b for p in sources() for b in blocks(p)]


def commands(block: Block) -> list[list[str]]:
    """A bash block's commands: each line (comments dropped), split at ``&&``, each as argv."""
    out = []
    for line in block.text.splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        for part in line.split("&&"):
            out.append(shlex.split(part))
    return out


def ci_commands() -> list[str]:
    """The install and test commands .ci/run runs (its ``cmd=`` and ``ompi_cmd=`` lines, and pip lines)."""
    text = (ROOT / ".ci" / "run").read_text()
    found = re.findall(r'^\w*cmd="(.*)"$', text, re.M)
    found += [m.strip() for m in re.findall(r"^\s*(pip install .*)$", text, re.M)]
    return found
