"""Reads README.md's code blocks, runs them as one shell-like session and compares what they print with the output
the README shows. The rules are stated in tests/integration/test_readme.py, which drives this module."""

from __future__ import annotations

import ast
import json
import os
import re
import secrets
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from markdown_it import MarkdownIt

RUN_LANGUAGES = ("bash", "python")
OUTPUT_PREFIX = "# →"
ELLIPSIS = "…"


@dataclass(frozen=True)
class Shown:
    """Output the README shows: the ``# →`` lines from README line ``first`` to ``last``."""

    first: int
    last: int
    text: str


@dataclass(frozen=True)
class Piece:
    """README lines ``start``..``end`` of one block, run as one program (a block is one piece unless a background
    command splits it). ``shown`` are the output groups inside, in order."""

    start: int
    end: int
    shown: list[Shown]


@dataclass(frozen=True)
class Block:
    language: str
    first_line: int  # README line of the first line inside the fence
    content: str

    @property
    def lines(self) -> list[str]:
        return self.content.splitlines()

    @property
    def last_line(self) -> int:
        return self.first_line + max(0, len(self.lines) - 1)

    def line(self, number: int) -> str:
        return self.lines[number - self.first_line]

    def where(self) -> str:
        return f"README.md:{self.first_line} (```{self.language} block, lines {self.first_line}-{self.last_line})"


def fenced_blocks(markdown: str) -> list[Block]:
    """Every fenced block, with the README line its content starts on (markdown-it: fences in lists too)."""
    blocks = []
    for token in MarkdownIt("commonmark").parse(markdown):
        if token.type == "fence" and token.map is not None:
            blocks.append(Block(token.info.strip().split(" ")[0], token.map[0] + 2, token.content))
    return blocks


def inline_code(markdown: str) -> list[str]:
    """The text of every inline code span (`like this`)."""
    spans = []
    for token in MarkdownIt("commonmark").parse(markdown):
        for child in token.children or ():
            if child.type == "code_inline":
                spans.append(child.content)
    return spans


def command_of(line: str) -> str:
    return line.strip().split("#", 1)[0].strip()


def split_pieces(block: Block, *, background: Mapping[str, str]) -> list[Piece | tuple[int, str]]:
    """The block as pieces of code, and (line, command) for each line whose command starts with a key of
    ``background`` (run in the background, between the pieces around it)."""
    items: list[Piece | tuple[int, str]] = []
    start, shown, group = block.first_line, [], []
    for number, line in enumerate(block.lines, start=block.first_line):
        stripped = line.strip()
        if stripped.startswith(OUTPUT_PREFIX):
            if block.language == "python" and line != stripped:
                raise ValueError(f"README.md:{number}: `# →` lines of a python block must not be indented")
            group.append((number, stripped[len(OUTPUT_PREFIX) :].removeprefix(" ")))
            continue
        if group:
            shown.append(Shown(group[0][0], group[-1][0], "\n".join(text for _, text in group)))
            group = []
        if block.language == "bash" and any(command_of(line).startswith(key) for key in background):
            if number > start:
                items.append(Piece(start, number - 1, shown))
            items.append((number, command_of(line)))
            start, shown = number + 1, []
    if group:
        shown.append(Shown(group[0][0], group[-1][0], "\n".join(text for _, text in group)))
    if block.last_line >= start:
        items.append(Piece(start, block.last_line, shown))
    return items


# --- comparing output --------------------------------------------------------------------------------------------

_ANY = "\ue000any"  # a private-use character: no README text contains it


def _line_pattern(expected: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in expected.split(ELLIPSIS)), re.DOTALL)


def shown_json(text: str) -> Any | None:
    """The shown output as JSON with placeholders (see test_readme.py), or None when it is text (it does not start
    with ``{`` or ``[``). Shown JSON that does not parse is an error in the README."""
    if not text.lstrip().startswith(("{", "[")):
        return None
    s = re.sub(r"\{\s*…\s*\}|\[\s*…\s*\]", f'"{_ANY}"', text)
    s = re.sub(r",\s*…\s*(?=[}\]])", "", s)
    s = re.sub(r"(?<=[:\[,])(\s*)…(?=\s*[,}\]])", rf'\1"{_ANY}"', s)
    try:
        return json.loads(s)
    except ValueError as exc:
        raise ValueError(f"output shown as JSON does not parse ({exc}): {text}") from None


def json_mismatches(expected: Any, actual: Any, path: str = "$") -> list[str]:
    if isinstance(expected, str) and expected in (_ANY, ELLIPSIS):
        return []
    if isinstance(expected, str) and ELLIPSIS in expected:
        ok = isinstance(actual, str) and _line_pattern(expected).fullmatch(actual) is not None
        return [] if ok else [f"{path}: {actual!r} does not match {expected!r}"]
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return [f"{path}: expected an object, got {actual!r}"]
        out = []
        for key, value in expected.items():
            if key not in actual:
                out.append(f"{path}: no key {key!r} (keys: {sorted(actual)})")
            else:
                out.extend(json_mismatches(value, actual[key], f"{path}.{key}"))
        return out
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return [f"{path}: expected a list of {len(expected)}, got {actual!r}"]
        return [
            m
            for i, (e, a) in enumerate(zip(expected, actual, strict=True))
            for m in json_mismatches(e, a, f"{path}[{i}]")
        ]
    numbers = (int, float)
    same_kind = (
        type(expected) is type(actual)
        if isinstance(expected, bool) or isinstance(actual, bool) or not isinstance(expected, numbers)
        else isinstance(actual, numbers)
    )
    if not same_kind:
        return [f"{path}: expected {expected!r}, got {actual!r}"]
    return [] if expected == actual else [f"{path}: expected {expected!r}, got {actual!r}"]


def _clean_lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def text_matches(expected: list[str], actual: list[str]) -> bool:
    """Line by line; ``…`` in a line matches any characters, a line that is only ``…`` any number of lines."""
    if not expected:
        return not actual
    head, rest = expected[0], expected[1:]
    if head.strip() == ELLIPSIS:
        return any(text_matches(rest, actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and _line_pattern(head).fullmatch(actual[0]) is not None and text_matches(rest, actual[1:])


def output_mismatch(shown: str, actual: str) -> str | None:
    """None when ``actual`` (a command's stdout) matches what the README shows, else why not."""
    expected_json = shown_json(shown)
    if expected_json is not None:
        try:
            value = json.loads(actual)
        except ValueError:
            return "the README shows JSON; the command did not print one JSON value"
        problems = json_mismatches(expected_json, value)
        return "; ".join(problems) if problems else None
    if text_matches(_clean_lines(shown), _clean_lines(actual)):
        return None
    return "the lines differ"


# --- running ----------------------------------------------------------------------------------------------------


class BlockFailed(AssertionError):
    pass


@dataclass
class Session:
    """A shell-like session: variables (exported or not), the environment and the working directory carry from one
    bash block to the next; python blocks see the environment and the directory."""

    cwd: Path
    env: dict[str, str]
    work: Path  # where the session keeps its own files (state between blocks, logs)
    python: str  # the interpreter python blocks run with
    timeout_s: float = 300.0
    background: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _count: int = 0

    def __post_init__(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self._state = self.work / "shell-vars.sh"
        self._state.write_text("")
        # The variables a bash has of its own: never carried (some are read-only).
        self._baseline = self.work / "baseline-vars"
        out = subprocess.run(["bash", "-c", "compgen -v"], env=self.env, capture_output=True, text=True, check=True)
        self._baseline.write_text(out.stdout)

    def _next(self) -> int:
        self._count += 1
        return self._count

    def run_piece(self, block: Block, piece: Piece) -> None:
        n = self._next()
        token = secrets.token_hex(6)
        bash = block.language == "bash"
        path = self.work / f"piece-{n}.{'sh' if bash else 'py'}"
        # The code sits at its README line numbers, so errors and tracebacks name README lines.
        code = "\n".join([*[""] * (piece.start - 1), *(block.line(i) for i in range(piece.start, piece.end + 1))])
        if bash:
            path.write_text(self._bash_program(code, piece, token, n))
            argv = ["bash", str(path)]
        else:
            path.write_text(code + "\n")
            argv = [self.python, "-c", _PYTHON_DRIVER, str(path), token]
        try:
            result = subprocess.run(
                argv, cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=self.timeout_s
            )
        except subprocess.TimeoutExpired as exc:
            what = f"did not finish within {self.timeout_s:.0f} s"
            stdout = _unmarked(_text(exc.stdout), token)
            raise BlockFailed(_report(block, piece, what, stdout, _text(exc.stderr))) from None
        if result.returncode != 0:
            failed = re.findall(r"^@@readme-err (\d+)@@$", result.stderr, re.MULTILINE)
            what = f"exited with status {result.returncode}"
            if failed:
                what += f"; the command that failed is on README.md:{failed[-1]}: {block.line(int(failed[-1])).strip()}"
            stderr = re.sub(r"^@@readme-err \d+@@\n", "", result.stderr, flags=re.MULTILINE)
            raise BlockFailed(_report(block, piece, what, _unmarked(result.stdout, token), stderr))
        if bash:
            self._load_state(n)
        printed = _printed_by_line(result.stdout, token)
        starts = command_starts(block, piece)
        for shown in piece.shown:
            above = [line for line in starts if line < shown.first]
            if not above:
                raise ValueError(f"README.md:{shown.first}: `# →` lines with no command above them")
            actual = "".join(text for line, text in printed if above[-1] <= line < shown.first)
            problem = output_mismatch(shown.text, actual)
            if problem is not None:
                raise BlockFailed(
                    f"README.md:{shown.first}: the output shown does not match what README.md:{above[-1]} printed"
                    f" ({problem})\n--- shown ---\n{shown.text}\n--- printed ---\n{actual}\n"
                    f"--- stderr ---\n{_tail(result.stderr)}"
                )

    def _bash_program(self, code: str, piece: Piece, token: str, n: int) -> str:
        mark = f'printf "\\n@@readme-{token} %s@@\\n" "$LINENO"'
        prelude = (
            f"set -euo pipefail; source {_q(self._state)}; trap 'echo \"@@readme-err $LINENO@@\" >&2' ERR; "
            f"trap '{mark}' DEBUG"
        )
        vars_out, env_out, cwd_out = (self.work / f"{name}-{n}" for name in ("vars", "env", "cwd"))
        lines = code.split("\n")
        lines[piece.start - 2] = prelude  # a blank line above the code
        return "\n".join(
            [
                *lines,
                "trap - DEBUG ERR; set +euo pipefail",
                f"declare -p $(compgen -v | grep -vxF -f {_q(self._baseline)}) > {_q(vars_out)} 2>/dev/null",
                f"env -0 > {_q(env_out)}",
                f"pwd > {_q(cwd_out)}",
                "",
            ]
        )

    def _load_state(self, n: int) -> None:
        vars_out, env_out, cwd_out = (self.work / f"{name}-{n}" for name in ("vars", "env", "cwd"))
        self._state.write_text(vars_out.read_text())
        env = {}
        for item in env_out.read_bytes().split(b"\0"):
            key, sep, value = item.decode().partition("=")
            if sep and key.isidentifier():
                env[key] = value
        self.env = env
        self.cwd = Path(cwd_out.read_text().strip())

    def start_background(self, block: Block, line: int, command: str, *, ready_path: str, timeout_s: float) -> None:
        """Run ``command`` (a foreground server in the README) in the background; wait for ``ready_path``."""
        n = self._next()
        log = self.work / f"background-{n}.log"
        script = f"set -euo pipefail\nsource {_q(self._state)}\nexec {command}\n"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                ["bash", "-c", script],
                cwd=self.cwd,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.background.append(proc)
        ready = self.cwd / ready_path
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                if proc.poll() is not None:
                    why = f"exited with status {proc.returncode}"
                else:
                    why = f"wrote no {ready_path} within {timeout_s:.0f} s"
                output = _tail(log.read_text(errors="replace"))
                raise BlockFailed(
                    f"README.md:{line}: `{command}` (run in the background) {why}\n--- output ---\n{output}"
                )
            time.sleep(0.5)

    def stop_background(self, *, grace_s: float) -> list[str]:
        """SIGINT (what Ctrl-C sends) to each background command's group, SIGKILL after ``grace_s``; returns what
        had to be killed."""
        killed = []
        for proc in self.background:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
                    killed.append(str(proc.args))
        return killed


# Runs a python block one top-level statement at a time (README line numbers kept), printing a marker with the
# statement's line before each, so that what each statement printed is known.
_PYTHON_DRIVER = """
import ast, sys
path, token = sys.argv[1], sys.argv[2]
sys.argv = [path]
tree = ast.parse(open(path).read(), "README.md")
scope = {"__name__": "__main__"}
for statement in tree.body:
    print(f"\\n@@readme-{token} {statement.lineno}@@", flush=True)
    exec(compile(ast.Module([statement], []), "README.md", "exec"), scope)
    sys.stdout.flush()
"""


def command_starts(block: Block, piece: Piece) -> list[int]:
    """README lines where a command starts: a top-level statement (python); in bash, a line that is not a
    continuation (of a line ending in a backslash, or of an open quote), not blank and not only a comment."""
    if block.language == "python":
        source = "\n".join(block.line(i) if i >= piece.start else "" for i in range(1, piece.end + 1))
        return [node.lineno for node in ast.parse(source).body]
    starts = []
    single = double = continued = False
    for number in range(piece.start, piece.end + 1):
        line = block.line(number)
        if not (single or double or continued) and line.strip() and not line.strip().startswith("#"):
            starts.append(number)
        escaped, previous = False, " "
        for char in line:
            if escaped:
                escaped = False
            elif char == "\\" and not single:
                escaped = True
            elif char == "'" and not double:
                single = not single
            elif char == '"' and not single:
                double = not double
            elif char == "#" and not (single or double) and previous.isspace():
                break
            previous = char
        continued = escaped and not (single or double)
    return starts


def _printed_by_line(stdout: str, token: str) -> list[tuple[int, str]]:
    """stdout cut at the markers printed before each command: (README line of the command, what it printed)."""
    parts = re.split(rf"\n@@readme-{token} (\d+)@@\n", stdout)
    return [(int(parts[i]), parts[i + 1]) for i in range(1, len(parts) - 1, 2)]


def _unmarked(stdout: str, token: str) -> str:
    return "".join(text for _, text in _printed_by_line(stdout, token))


def _q(path: Path) -> str:
    return "'" + str(path).replace("'", "'\\''") + "'"


def _text(value: str | bytes | None) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def _tail(text: str, chars: int = 4000) -> str:
    return text if len(text) <= chars else "…" + text[-chars:]


def _report(block: Block, piece: Piece, what: str, stdout: str, stderr: str) -> str:
    code = "\n".join(f"{n:4} {block.line(n)}" for n in range(piece.start, piece.end + 1))
    return (
        f"{block.where()}: lines {piece.start}-{piece.end} {what}\n--- code ---\n{code}\n"
        f"--- stdout ---\n{_tail(stdout)}\n--- stderr ---\n{_tail(stderr)}"
    )
