"""What the deployment files may refer to, read from the code itself: CLI commands and options, settings, queues,
API paths. Shared by the compose and Kubernetes tests, so both catch the same drift the same way.

Nothing here starts a service: the API's paths come from ``create_app()`` without running its lifespan.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any
from unittest import mock

import typer

REPO_ROOT = Path(__file__).resolve().parents[2]

# ---- the `vidq` CLI -------------------------------------------------------------------------------------------------


# Typed as Any: typer >= 0.2x builds its commands on a vendored copy of click, not on the `click` package, so
# isinstance checks against click's classes fail; commands and options are read through click's attributes.
ClickCommand = Any


@cache
def cli_root() -> ClickCommand:
    from tools.cli import app

    command = typer.main.get_command(app)
    assert hasattr(command, "commands"), "tools.cli.app should be a group of sub-commands"
    return command


def _walk_commands(group: ClickCommand, prefix: str = "") -> Iterator[tuple[str, ClickCommand]]:
    for name, command in group.commands.items():
        full = f"{prefix}{name}"
        yield full, command
        if hasattr(command, "commands"):
            yield from _walk_commands(command, f"{full} ")


def cli_commands() -> set[str]:
    """Every `vidq` sub-command; a nested one as "group sub" (besides its group's own name)."""
    return {name for name, _ in _walk_commands(cli_root())}


def cli_command(name: str) -> ClickCommand | None:
    return dict(_walk_commands(cli_root())).get(name)


def _options(command: ClickCommand) -> list[Any]:
    return [param for param in command.params if getattr(param, "param_type_name", "") == "option"]


def cli_options(command: ClickCommand) -> set[str]:
    """Every spelling of every option of a command (``--migrate`` and ``--no-migrate``, ``-h`` …), and --help."""
    names = {"--help"}
    for param in _options(command):
        names.update(param.opts)
        names.update(param.secondary_opts)
    return names


def cli_args_problems(args: Sequence[str]) -> list[str]:
    """Why ``vidq *args`` would not parse (empty list: it would). ``args`` excludes the program name.

    The sub-command must exist and every option must be one of its own; an option that takes a value must be given
    one. Values themselves are not checked (they may be ${…} placeholders)."""
    if not args:
        return ["no sub-command"]
    name = args[0]
    command = cli_command(name)
    if command is None:
        return [f"`vidq {name}` is not a command (have: {sorted(cli_commands())})"]
    options = {opt: param for param in _options(command) for opt in param.opts}
    flags = {opt for param in _options(command) for opt in param.secondary_opts}
    problems: list[str] = []
    rest = list(args[1:])
    while rest:
        token = rest.pop(0)
        if not token.startswith("-"):
            problems.append(f"`vidq {name}` takes no argument {token!r}")
            continue
        opt, has_value, _ = token.partition("=")
        if opt == "--help" or opt in flags:
            continue
        param = options.get(opt)
        if param is None:
            problems.append(f"`vidq {name}` has no option {opt} (has: {sorted(cli_options(command))})")
        elif param.is_flag or has_value:
            continue
        elif rest and not rest[0].startswith("--"):
            rest.pop(0)  # its value
        else:
            problems.append(f"`vidq {name} {opt}` needs a value")
    return problems


def worker_roles() -> dict[str, list[str]]:
    from services.worker.main import Role

    return {role.value: role.queues() for role in Role}


# ---- settings ---------------------------------------------------------------------------------------------------


def _env_prefix() -> str:
    from shared.infra.config import Settings

    return str(Settings.model_config.get("env_prefix", ""))


def settings_env_names() -> set[str]:
    """The environment variable of every Settings field: VIDQ_ + the field name in upper case."""
    from shared.infra.config import Settings

    prefix = _env_prefix()
    return {f"{prefix}{name}".upper() for name in Settings.model_fields}


def setting_field(env_name: str) -> str:
    """VIDQ_TASK_TIME_LIMIT_S -> task_time_limit_s."""
    return env_name.removeprefix(_env_prefix()).lower()


def settings_from_env(env: Mapping[str, str]) -> Any:
    """Settings exactly as a process would build them from ``env`` alone (no .env file, nothing else set)."""
    from shared.infra.config import Settings

    with mock.patch.dict(os.environ, dict(env), clear=True):
        return Settings(_env_file=None)  # type: ignore[call-arg]


# ---- queues and the API -------------------------------------------------------------------------------------------


def queue_names() -> set[str]:
    from shared.queues import Queue

    return {q.value for q in Queue}


QUEUE_NAME = re.compile(r"(?<![\w.-])(?:video\.[a-z][a-z0-9_]*(?:\.[a-z][a-z0-9-]*)?|vidq\.[a-z][a-z0-9_]*)(?![\w./-])")
"""What looks like a queue name in a deployment file (video.high, video.low.canary, vidq.webhooks …; not a label key
such as vidq.dev/pool)."""


def known_queue(name: str) -> bool:
    """A queue vidq uses: a fixed one, or a video queue of any worker pool (video.high.canary)."""
    from shared.queues import parse_video_queue

    return name in queue_names() or parse_video_queue(name) is not None


def _route_paths(routes: Iterable[Any]) -> Iterator[str]:
    for route in routes:
        # FastAPI >= 0.16x keeps included routers as lazy nodes; older ones flatten them into plain routes.
        if hasattr(route, "effective_candidates"):
            yield from _route_paths(route.effective_candidates())
            continue
        path = getattr(route, "path", None)
        if isinstance(path, str) and path:
            yield path


@cache
def _api_paths() -> frozenset[str]:
    from services.api.app import create_app

    app = create_app()
    return frozenset(_route_paths(app.routes)) | frozenset(app.openapi().get("paths", {}))


def api_paths() -> set[str]:
    """Every path the API serves (from ``create_app().routes``; the lifespan does not run)."""
    return set(_api_paths())


# ---- Dockerfiles --------------------------------------------------------------------------------------------------

DOCKERFILE_INSTRUCTIONS = {
    "ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL", "MAINTAINER",
    "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR",
}  # fmt: skip


@dataclass
class Instruction:
    keyword: str
    value: str
    line: int


@dataclass
class Stage:
    base: str  # as written (may hold ${ARG})
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def env(self) -> dict[str, str]:
        """The variables its ENV instructions set (``ENV A=1 B=2``), later ones winning."""
        env: dict[str, str] = {}
        for instruction in self.all("ENV"):
            for word in shlex.split(instruction.value):
                name, _, value = word.partition("=")
                env[name] = value
        return env

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage | None:
        return next((s for s in self.stages if s.name == name), None)

    def resolved_base(self, stage: Stage) -> str:
        """The FROM image with the global ARG defaults substituted."""
        return re.sub(r"\$\{?(\w+)\}?", lambda m: self.global_args.get(m.group(1), m.group(0)), stage.base)


def parse_dockerfile(path: Path) -> Dockerfile:
    """Parse with dockerfile-parse, then split into stages. Raises ValueError for what Docker would refuse."""
    from dockerfile_parse import DockerfileParser

    parser = DockerfileParser(path=str(path), cache_content=True)
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for item in parser.structure:
        keyword, value, line = str(item["instruction"]).upper(), str(item["value"]), int(item["startline"]) + 1
        if keyword == "COMMENT":
            continue
        if keyword not in DOCKERFILE_INSTRUCTIONS:
            raise ValueError(f"{path.name}:{line}: unknown instruction {keyword}")
        if keyword == "FROM":
            words = value.split()
            words = [w for w in words if not w.startswith("--platform")]
            if len(words) == 3 and words[1].upper() == "AS":
                stages.append(Stage(base=words[0], name=words[2]))
            elif len(words) == 1:
                stages.append(Stage(base=words[0], name=None))
            else:
                raise ValueError(f"{path.name}:{line}: malformed FROM {value!r}")
            continue
        if not stages:
            if keyword != "ARG":
                raise ValueError(f"{path.name}:{line}: {keyword} before the first FROM")
            arg_name, _, default = value.partition("=")
            global_args[arg_name.strip()] = default.strip().strip('"')
            continue
        if keyword in {"CMD", "ENTRYPOINT", "SHELL"} and value.lstrip().startswith("["):
            exec_form(value, where=f"{path.name}:{line}")
        stages[-1].instructions.append(Instruction(keyword, value, line))
    if not stages:
        raise ValueError(f"{path.name}: no FROM")
    names = [s.name for s in stages if s.name]
    if len(names) != len(set(names)):
        raise ValueError(f"{path.name}: duplicate stage names {names}")
    for index, stage in enumerate(stages):
        earlier = {s.name for s in stages[:index]}
        for copy in stage.all("COPY"):
            found = re.search(r"--from=(\S+)", copy.value)
            source = found.group(1) if found else None
            # A stage name, a stage index, or an image (anything with ':' or '/'): only names are checked.
            if source and not source.isdigit() and not {":", "/"} & set(source) and source not in earlier:
                raise ValueError(f"{path.name}:{copy.line}: COPY --from={source}: no such earlier stage")
    return Dockerfile(path=path, global_args=global_args, stages=stages)


def exec_form(value: str, *, where: str) -> list[str]:
    """A JSON exec form (["vidq", "api"]); ValueError unless it is a non-empty list of strings."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: exec form is not valid JSON: {value!r}") from exc
    if not isinstance(parsed, list) or not parsed or not all(isinstance(p, str) for p in parsed):
        raise ValueError(f"{where}: exec form must be a non-empty list of strings: {value!r}")
    return parsed


def command_words(value: str, *, where: str) -> list[str]:
    """CMD/ENTRYPOINT/HEALTHCHECK CMD as words: the exec form as is, the shell form split like sh would."""
    value = value.strip()
    return exec_form(value, where=where) if value.startswith("[") else shlex.split(value)


def healthcheck_command(value: str, *, where: str) -> list[str] | None:
    """The command of a HEALTHCHECK instruction (options stripped); None for HEALTHCHECK NONE."""
    rest = value.strip()
    while rest.startswith("--"):
        _, _, rest = rest.partition(" ")
        rest = rest.strip()
    keyword, _, command = rest.partition(" ")
    if keyword.upper() == "NONE":
        return None
    if keyword.upper() != "CMD" or not command.strip():
        raise ValueError(f"{where}: HEALTHCHECK must be NONE or CMD …: {value!r}")
    return command_words(command, where=where)


def is_root_user(user: str) -> bool:
    name = user.strip().split(":")[0]
    return name in {"root", "0", ""}


URL_PATH = re.compile(r"https?://[^/'\"\s]+(/[^'\"\s?#]*)")


def urls_paths(text: str) -> list[str]:
    """The paths of the http(s) URLs in a command (a python -c urllib health check …)."""
    return URL_PATH.findall(text)
