"""The README cannot drift: its commands run against a real stack, and what it shows them print is what they print.

Rules (README.md has a short contributor note that points here):

1. Which blocks run. Every ```bash and ```python fenced block runs, in README order, unless it contains one of the
   substrings listed in NOT_RUN (each with its reason; the test fails if an entry matches no block, so the list
   cannot rot). Other fences (```text, ```json, a bare ``` for diagrams …) never run. ```sh, ```shell, ```console,
   ```py and the like are refused: a runnable-looking block is either run or listed in NOT_RUN.
2. One session. The blocks run as one shell-like session in a fresh directory: a ```bash block is one bash
   script under `set -euo pipefail` (any failing command fails the block); its variables (exported or not),
   environment and working directory carry into the next blocks. A ```python block is one program (the session's
   environment and directory, run statement by statement in one namespace, `__name__ == "__main__"`); it carries
   nothing to the next block. stdin is empty. Errors and tracebacks name README line numbers.
3. Foreground servers. A bash line whose command starts with a key of BACKGROUND (`vidq up`) runs in the
   background; the session goes on once the file named there exists (`.vidq/env`, written when the stack is up),
   and stops it at the end with SIGINT, as Ctrl-C would: it must exit within 90 s and leave no process behind.
   The README's `source .venv/bin/activate` activates a shim venv whose `vidq` and `python` run this checkout.
   There is one stack: a block that would start another (`VAR=x vidq up`, `vidq demo`) belongs in NOT_RUN.
4. Shown output. Lines starting with `# →` (at the start of the line in python blocks) show what the command right
   above them printed to stdout: in bash the last command that starts above (a pipeline, `a && b`, and lines
   joined by a trailing backslash or an open quote are one command; put a loop on one line), in python the last
   top-level statement. What other commands print is not compared, nor is stderr (progress bars, logs).
   - If the shown text starts with `{` or `[` it is JSON: the printed stdout must be one JSON value, compared on
     the keys shown (objects may have more keys, lists must have the shown length); `"…"` or a bare `…` as a value
     matches any value, `{…}` / `[…]` any object / list, a trailing `, …` just says there are more keys, and `…`
     inside a string matches any characters (`"vidq_…"`). Everything else is compared exactly (numbers too, and a
     bool is not a number). Shown JSON that does not parse fails the test.
   - Otherwise it is text, compared line by line with trailing spaces and leading/trailing blank lines ignored:
     `…` in a line matches any characters within that line, a line that is only `…` matches any number of lines.
   Show only what is the same on every run: ids, times, URLs, seeds become `…`.
5. Time. Each block has BLOCK_TIMEOUT_S; generate with small settings (tiny-wan at 256×256, 8 steps and less) so
   the whole README runs in a few minutes on two CPU cores.

The session's environment isolates it from other stacks on the machine (see `_session_env`): its own database,
broker key prefix, ports and liveness files. Nothing else about the commands is changed.

Static checks (no stack) also hold the prose to the code: every `VIDQ_…` name is a setting, a CLI option's
variable or a variable a test reads (`os.environ.get("VIDQ_…")`); every repository path and `python -m` module
(or installed module) exists; every `vidq …` command with its `--flags` (inline or in a block) exists; every
`vidq_…` metric is defined in the code, every `vidq-…` Kubernetes object in deploy/ and every compose service
named in docker-compose.yml.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.helpers import free_port
from tests.integration.readme_runner import (
    RUN_LANGUAGES,
    Block,
    BlockFailed,
    Piece,
    Session,
    fenced_blocks,
    inline_code,
    output_mismatch,
    split_pieces,
)

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

NOT_RUN = {
    "make demo": "the fresh-machine set-up (creates .venv, runs a whole stack of its own); `make test` would recurse",
    "docker compose": "no container engine on test machines; tests/deploy validates docker-compose.yml",
    "kubectl": "needs a Kubernetes cluster; tests/deploy validates deploy/k8s",
    "tests/integration/test_console.py": "a test module with its own stack and a browser: the README test must not "
    "recurse into the suite",
    "jaegertracing/jaeger": "a container engine and a collector; tests/integration/test_traces.py checks the export "
    "with a real OTLP/HTTP receiver",
}
BACKGROUND = {"vidq up": ".vidq/env"}
LOOKALIKE_LANGUAGES = {"sh", "shell", "console", "zsh", "py", "python3", "pycon", "shell-session", "bash-session"}
BLOCK_TIMEOUT_S = 240.0
STACK_START_TIMEOUT_S = 300.0


def readme_blocks() -> list[Block]:
    return fenced_blocks(README.read_text())


def runs(block: Block) -> bool:
    return block.language in RUN_LANGUAGES and not any(key in block.content for key in NOT_RUN)


def test_every_not_run_entry_matches_a_block_and_no_block_hides_behind_a_lookalike_fence() -> None:
    blocks = readme_blocks()
    for key, reason in NOT_RUN.items():
        assert any(key in b.content for b in blocks if b.language in RUN_LANGUAGES), f"NOT_RUN {key!r} ({reason})"
    lookalikes = [b.where() for b in blocks if b.language in LOOKALIKE_LANGUAGES]
    assert not lookalikes, f"use ```bash or ```python (listed in NOT_RUN if it cannot run here): {lookalikes}"
    assert any(runs(b) for b in blocks)


def test_every_vidq_setting_named_exists() -> None:
    from shared.infra.config import Settings

    text = README.read_text()
    known = {f"VIDQ_{name.upper()}" for name in Settings.model_fields} | _cli_envvars() | _test_knobs()
    named = set(re.findall(r"VIDQ_[A-Z0-9_]*[A-Z0-9]\b(?!_\*)", text))
    prefixes = set(re.findall(r"(VIDQ_[A-Z0-9_]+_)\*", text))
    assert named - known == set(), "README names settings that do not exist"
    assert {p for p in prefixes if not any(k.startswith(p) for k in known)} == set()


def test_every_path_and_module_named_exists() -> None:
    text = README.read_text()
    spans = inline_code(text) + [b.content for b in readme_blocks()]
    tops = ("shared/", "services/", "tools/", "tests/", "benchmarks/", "deploy/", "docker/", "migrations/")
    paths = {
        token.rstrip(".,;:)")
        for span in spans
        for token in re.findall(r"[\w./-]+", span)
        if token.startswith(tops) and "…" not in token
    }
    paths |= {p for p in ("docker-compose.yml", ".env.example", "Makefile", "pyproject.toml") if f"`{p}`" in text}
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    modules = set(re.findall(r"python -m\s+([\w.]+)", text))
    missing += sorted(m for m in modules if not _module_exists(m))
    assert not missing, f"README names paths or modules that do not exist: {missing}"


def test_every_metric_compose_service_and_k8s_object_named_exists() -> None:
    import yaml

    text = README.read_text()
    code = "\n".join(p.read_text() for top in ("shared", "services", "tools") for p in (ROOT / top).rglob("*.py"))
    metrics = set(re.findall(r"`(vidq_[a-z0-9_]+)(?:\{[^`]*\})?`", text))
    # prometheus_client adds _total to a Counter's name
    missing = [m for m in metrics if f'"{m}"' not in code and f'"{m.removesuffix("_total")}"' not in code]
    manifests = "\n".join(p.read_text() for p in (ROOT / "deploy").rglob("*.yaml"))
    objects = set(re.findall(r"(?:deployment/|`)(vidq-[a-z0-9-]+)", text))
    missing += [o for o in objects if not re.search(rf"^\s*name: {o}$", manifests, re.MULTILINE)]
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    named = set(re.findall(r"compose(?:'s)? (?:service )?`([a-z0-9-]+)`", text))
    named |= {"redis-cache"} if "`redis-cache`" in text else set()
    missing += [f"compose service {s}" for s in named if s not in services]
    assert metrics and objects and named
    assert not missing, f"README names what the code, deploy/ or docker-compose.yml do not have: {sorted(missing)}"


def test_every_vidq_command_and_flag_named_exists() -> None:
    import typer.main

    from tools.cli import app

    root = typer.main.get_command(app)
    text = README.read_text()
    candidates = [s for s in inline_code(text) if s.startswith("vidq ")]
    at_command = r"(?:^\s*|\bexec \S+ |[;&|(]\s*)(vidq [^#\n|&;)]*)"  # `vidq` where a shell runs it
    candidates += [m for b in readme_blocks() if b.language == "bash" for m in re.findall(at_command, b.content, re.M)]
    problems = []
    for usage in candidates:
        words = usage.split()[1:]
        command = root
        while hasattr(command, "commands") and words and words[0] in command.commands:
            command = command.commands[words.pop(0)]
        if hasattr(command, "commands"):
            problems.append(f"{usage!r}: no such command")
            continue
        options = {opt for p in command.params for opt in (*p.opts, *getattr(p, "secondary_opts", []))}
        for flag in re.findall(r"--[a-z][a-z0-9-]*", " ".join(words)):
            if flag not in options:
                problems.append(f"{usage!r}: `vidq {command.name}` has no {flag}")
    assert candidates
    assert not problems, problems


def test_shown_output_placeholders_match_what_they_say_and_nothing_else() -> None:
    shown = '{"id": "…", "key": "vidq_…", "score": {"value": 0.32}, "links": {…}, "n": …, …}'
    printed = '{"id": 7, "key": "vidq_abc", "score": {"value": 0.32, "extra": 1}, "links": {"a": "b"}, "n": null}'
    assert output_mismatch(shown, printed) is None
    assert output_mismatch(shown, printed.replace("0.32", "0.54")) == "$.score.value: expected 0.32, got 0.54"
    assert output_mismatch(shown, printed.replace("vidq_abc", "sk_abc")) is not None
    assert output_mismatch(shown, printed.replace('"n": null', '"m": null')) is not None  # a shown key is missing
    assert output_mismatch('{"data": […]}', '{"data": [1, 2]}') is None
    assert output_mismatch("[1, 2]", "[1, 2, 3]") is not None
    assert output_mismatch('{"a": true}', '{"a": 1}') is not None
    assert output_mismatch('{"a": 1}', "not json") is not None
    assert output_mismatch("alive\nalive", "alive\nalive\n\n") is None
    assert output_mismatch("alive\nalive", "alive\ndead") is not None
    assert output_mismatch("…\nevent: job\ndata: {…}", "event: a\ndata: 1\n\nevent: job\ndata: {x}") is None
    assert output_mismatch("…\nevent: job", "event: job\ndata: 1") is not None  # `…` lines, not trailing text
    assert output_mismatch("….mp4", "a.mp4\nb.mp4") is not None  # `…` within a line stays within it


def test_a_failing_block_names_its_readme_line_and_shows_its_output(tmp_path: Path) -> None:
    code = 'X=1\necho "out $X"\nls \\\n  /no/such/dir 2>/dev/null || false\necho never\n'
    block = Block("bash", 10, code)
    session = Session(cwd=tmp_path, env=dict(os.environ), work=tmp_path / "s", python=sys.executable)
    (piece,) = split_pieces(block, background=BACKGROUND)
    assert isinstance(piece, Piece)
    with pytest.raises(BlockFailed) as failed:
        session.run_piece(block, piece)
    message = str(failed.value)
    assert message.startswith("README.md:10 (```bash block, lines 10-14)")
    # bash's line of a command continued with a backslash is the line its last part is on
    assert "the command that failed is on README.md:13: /no/such/dir 2>/dev/null || false" in message
    assert "--- stdout ---\nout 1\n\n--- stderr ---\n" in message  # echo never ran


def test_shown_output_is_what_the_command_right_above_printed(tmp_path: Path) -> None:
    session = Session(cwd=tmp_path, env=dict(os.environ), work=tmp_path / "s", python=sys.executable)
    bash = Block(
        "bash", 5, "echo noise\nprintf 'a\\n' \\\n  | tr a b\n# → b\nN=2\necho \"n=$N\"; echo x\n# → n=2\n# → x\n"
    )
    python = Block("python", 20, "import os\nprint('noise')\nfor i in range(2):\n    print(i)\n# → 0\n# → 1\n")
    for block in (bash, python):
        (piece,) = split_pieces(block, background=BACKGROUND)
        assert isinstance(piece, Piece)
        session.run_piece(block, piece)  # raises BlockFailed on a mismatch
    wrong = Block("python", 30, "print('noise')\nprint(1)\n# → noise\n")
    (piece,) = split_pieces(wrong, background=BACKGROUND)
    assert isinstance(piece, Piece)
    with pytest.raises(BlockFailed, match=r"^README.md:32: the output shown does not match what README.md:31 printed"):
        session.run_piece(wrong, piece)


# --- the README, run ---------------------------------------------------------------------------------------------


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    token = uuid.uuid4().hex[:10]
    home = tmp_path / "readme"
    home.mkdir()
    _shim_venv(home / ".venv")
    env, cleanup = _session_env(tmp_path, token)
    s = Session(cwd=home, env=env, work=tmp_path / "session", python=sys.executable, timeout_s=BLOCK_TIMEOUT_S)
    try:
        yield s
    finally:
        killed = s.stop_background(grace_s=90)
        leftovers = _kill_leftovers(token)
        cleanup()
    assert not killed, f"did not stop on SIGINT (Ctrl-C) within 90 s: {killed}"
    assert not leftovers, f"processes left running after the stack stopped (killed now): {leftovers}"


def test_readme_runs_and_shows_what_it_prints(session: Session) -> None:
    ran = 0
    for block in readme_blocks():
        if not runs(block):
            continue
        for item in split_pieces(block, background=BACKGROUND):
            if isinstance(item, Piece):
                session.run_piece(block, item)
            else:
                line, command = item
                key = next(k for k in BACKGROUND if command.startswith(k))
                session.start_background(
                    block, line, command, ready_path=BACKGROUND[key], timeout_s=STACK_START_TIMEOUT_S
                )
        ran += 1
    assert ran >= 3 and session.background, "the README's stack block did not run"


def _shim_venv(venv: Path) -> None:
    """`.venv/bin/activate` puts `vidq` and `python` of this checkout on PATH, as `make demo`'s venv would."""
    bin_dir = venv / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    vidq = bin_dir / "vidq"
    vidq.write_text(f'#!/bin/sh\nexec {sys.executable} -m tools.cli "$@"\n')
    vidq.chmod(0o755)
    (bin_dir / "activate").write_text(f'VIRTUAL_ENV={venv}\nexport VIRTUAL_ENV\nPATH="{bin_dir}:$PATH"\nexport PATH\n')


def _session_env(tmp_path: Path, token: str) -> tuple[dict[str, str], Callable[[], None]]:
    """The caller's environment without any VIDQ_ setting, plus what keeps this stack apart from others on the
    machine: a database of its own (dropped after), a broker key prefix (its keys deleted after), free ports, its
    own worker liveness file, and a short worker shutdown grace."""
    from tests.conftest import _delete_broker_keys, _drop_database
    from tools.devstack import ensure_database

    pg = os.environ.get("VIDQ_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    redis_url = os.environ.get("VIDQ_TEST_REDIS", "redis://127.0.0.1:6379/13")
    db_name = f"vidq_readme_{token}"
    database_url = pg.rsplit("/", 1)[0] + f"/{db_name}"
    ensure_database(database_url)
    prefix = f"vidq-readme-{token}:"
    api_port, flower_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIDQ_")}
    env.update(
        {
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "VIDQ_README_RUN": token,  # how leftovers are found (_kill_leftovers)
            "VIDQ_DATABASE_URL": database_url,
            "VIDQ_DB_POOL_SIZE": "4",  # Postgres' connections are shared with other suites
            "VIDQ_BROKER_URL": redis_url,
            "VIDQ_BROKER_KEY_PREFIX": prefix,
            "VIDQ_API_PORT": str(api_port),
            "VIDQ_FLOWER_PORT": str(flower_port),
            "VIDQ_WORKER_METRICS_PORT": "0",
            "VIDQ_PREWARMER_METRICS_PORT": "0",
            "VIDQ_WORKER_SHUTDOWN_GRACE_S": "30",
        }
    )

    def cleanup() -> None:
        from shared.infra.db import dispose_engines

        dispose_engines()
        _drop_database(pg, db_name)
        _delete_broker_keys(redis_url, prefix)

    return env, cleanup


def _kill_leftovers(token: str) -> list[str]:
    """SIGKILL, by pid, any process still carrying this session's VIDQ_README_RUN (what `vidq up` started)."""
    needle = f"VIDQ_README_RUN={token}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0"):
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{proc.name} {cmdline[:120]}")
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue
    return found


def _cli_envvars() -> set[str]:
    import typer.main

    from tools.cli import app

    names: set[str] = set()

    def walk(command: object) -> None:
        for param in getattr(command, "params", []):
            envvar = param.envvar
            names.update([envvar] if isinstance(envvar, str) else list(envvar or []))
        for sub in getattr(command, "commands", {}).values():
            walk(sub)

    walk(typer.main.get_command(app))
    return names


def _test_knobs() -> set[str]:
    """VIDQ_ variables a test reads itself (``os.environ.get("VIDQ_…")``), such as where to save a screenshot."""
    reads = r"""os\.environ(?:\.get\(|\[)\s*["'](VIDQ_[A-Z0-9_]+)["']"""
    return {name for p in (ROOT / "tests").rglob("*.py") for name in re.findall(reads, p.read_text())}


def _module_exists(module: str) -> bool:
    """A module of this repository (its file), or an installed one (``python -m pytest``)."""
    path = ROOT / module.replace(".", "/")
    if (ROOT / module.split(".")[0]).is_dir():
        return path.with_suffix(".py").exists() or (path / "__init__.py").exists()
    import importlib.util

    return importlib.util.find_spec(module.split(".")[0]) is not None
