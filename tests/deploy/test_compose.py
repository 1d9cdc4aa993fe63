"""docker-compose.yml, .env.example and docker/*.Dockerfile: valid, and consistent with the code they run.

No Docker engine here: the compose file is checked against the compose-spec JSON schema (vendored), the Dockerfiles
are parsed, and every name the deployment uses (CLI commands and options, VIDQ_* settings, queues, API paths) is
checked against the code, so a rename in the code fails here instead of in a container.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft7Validator

from tests.deploy.consistency import (
    QUEUE_NAME,
    REPO_ROOT,
    Dockerfile,
    api_paths,
    cli_args_problems,
    cli_commands,
    command_words,
    healthcheck_command,
    is_root_user,
    known_queue,
    parse_dockerfile,
    queue_names,
    setting_field,
    settings_env_names,
    settings_from_env,
    urls_paths,
    worker_roles,
)

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
ENV_EXAMPLE = REPO_ROOT / ".env.example"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"
DOCKER_DIR = REPO_ROOT / "docker"
DOCKERFILES = sorted(DOCKER_DIR.glob("*.Dockerfile"))
SCHEMAS = Path(__file__).resolve().parent / "schemas"

VIDQ_NAME = re.compile(r"\bVIDQ_[A-Z0-9_]+\b(?!\*)")  # VIDQ_S3_* in prose is a family, not a name
# Stands in for the secrets .env.example leaves empty (compose refuses to start without them).
FILLED_SECRET = "Test-secret-0123456789abcdef"

# ---- reading the files ----------------------------------------------------------------------------------------------


@cache
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict)
    return data


def services() -> dict[str, dict[str, Any]]:
    return dict(compose()["services"])


@dataclass(frozen=True)
class EnvLine:
    name: str
    value: str
    active: bool  # False: a `# NAME=default` line
    comment: str  # the comment line right above it
    line: int


ASSIGNMENT = re.compile(r"^(#\s*)?([A-Z][A-Z0-9_]*)=(.*)$")


@cache
def env_example() -> tuple[EnvLine, ...]:
    lines = ENV_EXAMPLE.read_text().splitlines()
    found: list[EnvLine] = []
    for index, text in enumerate(lines):
        match = ASSIGNMENT.match(text)
        if not match:
            continue
        above = lines[index - 1] if index else ""
        comment = above if above.startswith("#") and not ASSIGNMENT.match(above) else ""
        found.append(EnvLine(match.group(2), match.group(3), match.group(1) is None, comment, index + 1))
    return tuple(found)


def dotenv() -> dict[str, str]:
    """What `cp .env.example .env` gives compose, the required secrets filled in."""
    return {e.name: e.value or FILLED_SECRET for e in env_example() if e.active}


# Compose interpolation: $$ is a literal $, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}.
INTERPOLATION = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_]\w*)(?P<op>:?[-?+])?(?P<arg>[^}]*)\}|\$(?P<bare>[A-Za-z_]\w*)")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("name") or match.group("bare")
        op, arg = match.group("op") or "", match.group("arg") or ""
        value = env.get(name)
        unset = value is None or (op.startswith(":") and value == "")
        if op.endswith("-"):
            return arg if unset else str(value)
        if op.endswith("?"):
            if unset:
                raise AssertionError(f"compose refuses to start: {name} is required ({arg})")
            return str(value)
        if op.endswith("+"):
            return "" if unset else arg
        return "" if value is None else value

    return INTERPOLATION.sub(one, text)


def referenced_variables(text: str) -> set[str]:
    return {m.group("name") or m.group("bare") for m in INTERPOLATION.finditer(text) if m.group(0) != "$$"}


def strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, Mapping):
        for key, value in node.items():
            yield str(key)
            yield from strings(value)
    elif isinstance(node, list):
        for item in node:
            yield from strings(item)


def as_list(command: Any) -> list[str]:
    if command is None:
        return []
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


@cache
def dockerfile(path: Path) -> Dockerfile:
    return parse_dockerfile(path)


def image_stage(service: Mapping[str, Any]) -> tuple[Dockerfile, str] | None:
    """The Dockerfile and stage a service is built from (None: a third-party image)."""
    build = service.get("build")
    if not isinstance(build, Mapping):
        return None
    parsed = dockerfile((REPO_ROOT / build.get("context", ".") / build["dockerfile"]).resolve())
    target = build.get("target") or parsed.stages[-1].name
    return parsed, str(target)


def vidq_services() -> dict[str, dict[str, Any]]:
    """Services running a vidq image (ENTRYPOINT ["vidq"]): their command is a vidq sub-command."""
    return {name: svc for name, svc in services().items() if image_stage(svc) is not None}


def image_env(service: Mapping[str, Any]) -> dict[str, str]:
    found = image_stage(service)
    if found is None:
        return {}
    parsed, target = found
    stage = parsed.stage(target)
    assert stage is not None
    return stage.env()


def effective_env(service: Mapping[str, Any]) -> dict[str, str]:
    """A vidq container's environment: image ENV < env_file (.env) < environment:, interpolated like compose."""
    env = dict(image_env(service))
    if service.get("env_file"):
        env.update(dotenv())
    env.update({k: interpolate(v, dotenv()) for k, v in environment(service).items()})
    return {k: v for k, v in env.items() if k.startswith("VIDQ_")}


DURATION = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")
UNIT_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def duration_s(text: str | int | float) -> float:
    """A compose duration ('35m', '1m30s', '500ms') in seconds."""
    if isinstance(text, int | float):
        return float(text)
    parts = DURATION.findall(text)
    assert parts and "".join(n + u for n, u in parts) == text.replace(" ", ""), f"not a duration: {text!r}"
    return sum(float(n) * UNIT_S[u] for n, u in parts)


def runs_video_worker(service: Mapping[str, Any]) -> bool:
    args = as_list(service.get("command"))
    if not args or args[0] != "worker":
        return False
    role = next((a.split("=", 1)[1] for a in args if a.startswith("--role=")), None)
    if role is None and "--role" in args:
        role = args[args.index("--role") + 1]
    return (role or "video") in {"video", "all"}


# ---- the compose file is valid ------------------------------------------------------------------------------------


def test_compose_file_validates_against_the_compose_spec_schema() -> None:
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    Draft7Validator.check_schema(schema)
    errors = sorted(Draft7Validator(schema).iter_errors(compose()), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_vendored_schema_is_the_recorded_upstream_file() -> None:
    digest = hashlib.sha256((SCHEMAS / "compose-spec.json").read_bytes()).hexdigest()
    assert digest in (SCHEMAS / "README.md").read_text(), "schema changed: record its source and sha256 in README"


def test_every_variable_compose_interpolates_is_documented_in_env_example() -> None:
    documented = {e.name for e in env_example()}
    used = set().union(*(referenced_variables(s) for s in strings(compose())))
    assert used - documented == set(), "add these to .env.example"
    # …and no compose-only variable in .env.example is left over from an older compose file.
    compose_only = {e.name for e in env_example() if not e.name.startswith("VIDQ_")}
    assert compose_only - used == set(), "documented in .env.example but unused by docker-compose.yml"


def test_compose_starts_with_the_env_example_as_is() -> None:
    """Every ${…} resolves from a copied .env.example (with its empty secrets filled in)."""
    for text in strings(compose()):
        interpolate(text, dotenv())


# ---- names the deployment uses exist in the code ---------------------------------------------------------------


def test_compose_commands_are_real_vidq_commands_with_real_options() -> None:
    assert vidq_services(), "no service runs a vidq image"
    for name, service in vidq_services().items():
        assert service.get("entrypoint") in (None, ["vidq"]), f"{name}: the images' ENTRYPOINT is vidq"
        args = as_list(service.get("command"))
        if not args:  # the image's CMD applies: checked with the Dockerfiles
            continue
        assert cli_args_problems(args) == [], f"service {name}: {args}"


def test_compose_healthchecks_use_real_commands_and_paths() -> None:
    for name, service in services().items():
        test = (service.get("healthcheck") or {}).get("test")
        if not test or name not in vidq_services():
            continue
        words = as_list(test)
        assert words[0] in {"CMD", "CMD-SHELL"}, f"{name}: healthcheck test must start with CMD or CMD-SHELL"
        command = words[1:] if words[0] == "CMD" else shlex.split(" ".join(words[1:]))
        if command[0] == "vidq":
            assert cli_args_problems(command[1:]) == [], f"{name} healthcheck: {command}"
        if as_list(service.get("command"))[:1] == ["api"]:
            paths = urls_paths(" ".join(command))
            assert paths, f"{name}: the API's healthcheck should request an API path"
            assert set(paths) <= api_paths(), f"{name}: {paths} not served by the API"


def test_every_vidq_variable_is_a_real_setting() -> None:
    known = settings_env_names()
    sources = {
        "docker-compose.yml": COMPOSE_FILE.read_text(),
        ".env.example": ENV_EXAMPLE.read_text(),
        **{f"docker/{p.name}": p.read_text() for p in DOCKERFILES},
    }
    for source, text in sources.items():
        unknown = set(VIDQ_NAME.findall(text)) - known
        assert unknown == set(), f"{source} uses VIDQ_* names that are not settings (shared/infra/config.py)"


def test_env_example_documents_every_setting_once_with_its_default() -> None:
    entries = [e for e in env_example() if e.name.startswith("VIDQ_")]
    names = [e.name for e in entries]
    assert sorted(set(names)) == sorted(names), "a setting appears twice in .env.example"
    assert set(names) == settings_env_names(), "missing in .env.example" if set(names) < settings_env_names() else ""
    defaults = settings_from_env({})
    for entry in env_example():
        assert entry.comment, f".env.example:{entry.line}: {entry.name} needs one comment line above it"
        if not entry.name.startswith("VIDQ_"):
            continue
        field = setting_field(entry.name)
        if entry.active:
            # A value set on purpose: its comment must still give the built-in default.
            match = re.search(r"default: ([^;,)]*)", entry.comment)
            assert match, f".env.example:{entry.line}: say `(default: …)` for {entry.name}"
            shown = match.group(1).strip()
        else:
            shown = entry.value
        default = getattr(defaults, field)
        if shown == "" and default is None:
            continue
        env = {entry.name: shown}
        if field == "env" and shown == "prod":
            env["VIDQ_S3_SECRET_KEY"] = FILLED_SECRET
        assert getattr(settings_from_env(env), field) == default, (
            f".env.example:{entry.line}: {entry.name} shows {shown!r}, but the default is {default!r}"
        )


def test_every_vidq_container_gets_valid_settings() -> None:
    """The settings each vidq service would build (image ENV, .env, environment:) parse, prod checks included."""
    for name, service in vidq_services().items():
        env = effective_env(service)
        try:
            settings = settings_from_env(env)
        except Exception as exc:  # pydantic's ValidationError, with the field and value in its message
            raise AssertionError(f"service {name}: {exc}") from exc
        assert settings.default_model in settings.models_allowed, f"service {name}: default model not allowed"
        assert settings.env == "prod", f"service {name}: compose runs with VIDQ_ENV=prod"


def test_minio_init_script_is_valid_shell() -> None:
    service = services()["minio-init"]
    entrypoint, command = as_list(service["entrypoint"]), as_list(service["command"])
    assert entrypoint[0] == "/bin/sh" and len(command) == 1
    script = interpolate(command[0], dotenv())  # compose turns $$ into $ before the shell sees it
    result = subprocess.run(["sh", "-n", "-c", script], capture_output=True, text=True, timeout=10, check=False)
    assert result.returncode == 0, result.stderr
    assert 'mc mb --ignore-existing "local/$VIDQ_S3_BUCKET"' in script


def test_queue_names_match_shared_queues() -> None:
    queues = queue_names()
    files = [COMPOSE_FILE, ENV_EXAMPLE, *DOCKERFILES, *DOCKER_DIR.glob("*.md")]
    for path in files:
        unknown = {name for name in QUEUE_NAME.findall(path.read_text()) if not known_queue(name)}
        assert not unknown, f"{path.name}: {sorted(unknown)} are not queues (shared/queues.py)"
    # The CLI's roles spell queue names out: they must be the real ones, video ones in strict priority order.
    from shared.queues import Queue

    roles = worker_roles()
    assert roles["video"] == [q.value for q in Queue.video()]
    assert roles["webhooks"] == [Queue.WEBHOOKS.value]
    assert set().union(*map(set, roles.values())) <= queues
    for name, service in vidq_services().items():
        args = as_list(service.get("command"))
        if args[:1] == ["worker"] and "--role" in args:
            assert args[args.index("--role") + 1] in roles, f"{name}: unknown worker role"


# ---- the worker: GPU, profiles, shutdown ------------------------------------------------------------------------


def test_video_workers_outlive_their_longest_task_on_shutdown() -> None:
    """Celery's warm shutdown lets the running job finish; Docker must not SIGKILL before the hard time limit."""
    video_workers = {n: s for n, s in vidq_services().items() if runs_video_worker(s)}
    assert set(video_workers) == {"worker", "worker-cpu", "worker-canary"}
    for name, service in video_workers.items():
        limit = settings_from_env(effective_env(service)).task_time_limit_s
        grace = duration_s(service.get("stop_grace_period", "10s"))
        assert grace > limit, f"{name}: stop_grace_period {grace:.0f}s <= VIDQ_TASK_TIME_LIMIT_S {limit}s"


def test_gpu_and_cpu_workers_sit_in_their_profiles() -> None:
    svc = services()
    gpu, cpu = svc["worker"], svc["worker-cpu"]
    assert gpu.get("profiles") == ["gpu"] and cpu.get("profiles") == ["cpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert gpu["build"]["target"] == "worker" and cpu["build"]["target"] == "worker-cpu"
    assert settings_from_env(effective_env(cpu)).device == "cpu"
    assert settings_from_env(effective_env(gpu)).device == "cuda"
    # The canary pool's worker: its own profile, the canary's queues only.
    canary = svc["worker-canary"]
    assert canary.get("profiles") == ["canary"]
    args = as_list(canary["command"])
    assert args[args.index("--pool") + 1] == "canary"
    from shared.queues import video_queues

    assert video_queues("canary") == ["video.high.canary", "video.medium.canary", "video.low.canary"]
    # Every other service runs in every profile.
    assert all("profiles" not in s for n, s in svc.items() if n not in {"worker", "worker-cpu", "worker-canary"})


def test_broker_never_evicts_and_the_cache_is_not_the_broker() -> None:
    svc = services()
    broker = settings_from_env(effective_env(svc["api"])).broker_url
    assert broker.host in svc and broker.host != "redis-cache", f"broker at {broker.host}"
    args = as_list(svc[broker.host]["command"])
    policy = args[args.index("--maxmemory-policy") + 1] if "--maxmemory-policy" in args else "(default)"
    assert policy == "noeviction", "the broker's Redis must never evict a message"
    cache_args = as_list(svc["redis-cache"]["command"])
    assert "allkeys-lru" in cache_args and "--maxmemory" in cache_args


# ---- start-up order -----------------------------------------------------------------------------------------------


def depends_on(service: Mapping[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: spec.get("condition", "service_started") for name, spec in deps.items()}


def has_healthcheck(service: Mapping[str, Any]) -> bool:
    check = service.get("healthcheck") or {}
    if check.get("disable") in (True, "true"):
        return False
    if check.get("test"):
        return True
    found = image_stage(service)
    if found is None:
        return False
    parsed, target = found
    stage = parsed.stage(target)
    return stage is not None and stage.last("HEALTHCHECK") is not None


def test_api_waits_for_healthy_backends_migrations_and_the_bucket() -> None:
    assert depends_on(services()["api"]) == {
        "postgres": "service_healthy",
        "redis": "service_healthy",
        "migrate": "service_completed_successfully",
        "minio-init": "service_completed_successfully",
    }


def test_depends_on_conditions_can_be_met() -> None:
    svc = services()
    for name, service in svc.items():
        for target, condition in depends_on(service).items():
            assert target in svc, f"{name} depends on a missing service {target}"
            assert "profiles" not in svc[target], f"{name} depends on {target}, which only runs in a profile"
            if condition == "service_healthy":
                assert has_healthcheck(svc[target]), f"{name} waits for {target} to be healthy: it has no healthcheck"
            if condition == "service_completed_successfully":
                assert svc[target].get("restart", "no") == "no", f"{target} is one-shot: restart must be 'no'"


# ---- images -------------------------------------------------------------------------------------------------------


def image_is_pinned(image: str) -> bool:
    name, _, digest = image.partition("@")
    last = name.rsplit("/", 1)[-1]
    tag = last.partition(":")[2]
    return bool(digest.startswith("sha256:") or (tag and tag != "latest"))


def test_third_party_images_are_pinned() -> None:
    for name, service in services().items():
        image = service.get("image")
        assert image, f"{name}: name its image"
        if "build" in service:
            assert image.startswith("vidq-"), f"{name}: built images are vidq-…"
            continue
        assert image_is_pinned(image), f"{name}: pin {image} to a tag (not latest) or a digest"


def test_dockerfile_base_images_are_pinned() -> None:
    for path in DOCKERFILES:
        parsed = dockerfile(path)
        stage_names = {s.name for s in parsed.stages}
        for stage in parsed.stages:
            base = parsed.resolved_base(stage)
            if base in stage_names:
                continue
            assert "$" not in base, f"{path.name}: FROM {stage.base} has no ARG default"
            assert image_is_pinned(base), f"{path.name}: FROM {base} is not pinned"


def test_compose_builds_existing_dockerfile_targets() -> None:
    for name, service in services().items():
        build = service.get("build")
        if build is None:
            continue
        path = REPO_ROOT / build.get("context", ".") / build["dockerfile"]
        assert path.is_file(), f"{name}: {path} missing"
        target = build.get("target")
        assert target is None or dockerfile(path.resolve()).stage(target), f"{name}: no stage {target} in {path.name}"


def runtime_stages() -> Iterator[tuple[Path, Dockerfile, str]]:
    """The stages that are images: each Dockerfile's last stage and every compose build target."""
    built = [found for found in map(image_stage, services().values()) if found is not None]
    for path in DOCKERFILES:
        parsed = dockerfile(path)
        names = {str(parsed.stages[-1].name)} | {t for p, t in built if p.path == path.resolve()}
        for name in sorted(names):
            yield path, parsed, name


def test_dockerfiles_parse() -> None:
    assert {p.name for p in DOCKERFILES} == {"api.Dockerfile", "worker.Dockerfile"}
    for path in DOCKERFILES:
        parsed = parse_dockerfile(path)
        assert parsed.stages, path.name
        for stage in parsed.stages:
            for instruction in stage.all("HEALTHCHECK"):
                healthcheck_command(instruction.value, where=f"{path.name}:{instruction.line}")


def test_runtime_stages_run_vidq_as_non_root_with_a_healthcheck() -> None:
    for path, parsed, name in runtime_stages():
        stage = parsed.stage(name)
        assert stage is not None, f"{path.name}: no stage {name}"
        where = f"{path.name} [{name}]"
        user = stage.last("USER")
        assert user is not None and not is_root_user(user.value), f"{where}: needs a non-root USER"
        entrypoint = stage.last("ENTRYPOINT")
        assert entrypoint is not None and command_words(entrypoint.value, where=where) == ["vidq"], where
        cmd = stage.last("CMD")
        assert cmd is not None, f"{where}: CMD missing"
        assert cli_args_problems(command_words(cmd.value, where=where)) == [], where
        health = stage.last("HEALTHCHECK")
        assert health is not None, f"{where}: HEALTHCHECK missing"
        command = healthcheck_command(health.value, where=where)
        assert command, f"{where}: HEALTHCHECK NONE"
        if command[0] == "vidq":
            assert cli_args_problems(command[1:]) == [], where
        else:
            paths = urls_paths(" ".join(command))
            assert paths and set(paths) <= api_paths(), f"{where}: HEALTHCHECK requests {paths}, not API paths"


def test_liveness_probe_commands_exist() -> None:
    assert {"worker-alive", "sweep-alive", "prewarmer", "prewarmer-alive"} <= cli_commands()


def test_exactly_one_sweeper_runs_and_no_api_sweeps_in_process() -> None:
    """The sweeper is one service running `vidq sweep --forever` on the CPU image, probed by `vidq sweep-alive`; the
    API leaves it off (more sweepers would be safe under the advisory lock, but pointless)."""
    sweepers = {n: s for n, s in vidq_services().items() if as_list(s.get("command"))[:1] == ["sweep"]}
    assert list(sweepers) == ["sweeper"], sweepers
    sweeper = sweepers["sweeper"]
    assert as_list(sweeper["command"]) == ["sweep", "--forever"]
    assert sweeper.get("deploy", {}).get("replicas", 1) == 1 and sweeper.get("scale", 1) == 1
    assert sweeper.get("restart") == "unless-stopped"
    assert as_list(sweeper["healthcheck"]["test"]) == ["CMD", "vidq", "sweep-alive"]
    assert depends_on(sweeper).get("migrate") == "service_completed_successfully", "it needs the schema"
    for name, service in vidq_services().items():
        if as_list(service.get("command"))[:1] == ["api"]:
            assert settings_from_env(effective_env(service)).sweeper_in_api is False, f"{name} runs the sweeper too"


def test_exactly_one_prewarmer_runs_on_the_cpu_torch_image_in_every_profile() -> None:
    """One service runs `vidq prewarmer`: on the worker image built for the CPU (it needs torch, and a plain
    `docker compose up` must work without a GPU), in no profile, on the CPU, probed by `vidq prewarmer-alive`, its
    metrics port exposed, started like the sweeper."""
    prewarmers = {n: s for n, s in vidq_services().items() if as_list(s.get("command"))[:1] == ["prewarmer"]}
    assert list(prewarmers) == ["prewarmer"], prewarmers
    prewarmer = prewarmers["prewarmer"]
    assert as_list(prewarmer["command"]) == ["prewarmer"]
    found = image_stage(prewarmer)
    assert found is not None and found[0].path.name == "worker.Dockerfile" and found[1] == "worker-cpu"
    assert "profiles" not in prewarmer and "deploy" not in prewarmer, "no profile and no GPU reservation"
    assert prewarmer.get("restart") == services()["sweeper"].get("restart") == "unless-stopped"
    assert as_list(prewarmer["healthcheck"]["test"]) == ["CMD", "vidq", "prewarmer-alive"]
    assert depends_on(prewarmer) == depends_on(services()["sweeper"]), "Postgres, Redis and the schema"
    settings = settings_from_env(effective_env(prewarmer))
    assert settings.prewarmer_device == "cpu"
    assert settings.prewarmer_metrics_port and str(settings.prewarmer_metrics_port) in map(str, prewarmer["expose"])
    # Settings the encoder is loaded with: an unset dtype follows the image's VIDQ_DEVICE (cpu: float32, the CPU
    # worker's dtype), never a CUDA device that a CPU-only host does not have.
    assert settings.device in {"cpu", None} or settings.prewarmer_dtype is not None
    # The same models as the workers.
    assert {"models:/models"} <= set(prewarmer.get("volumes", []))


# ---- the build context ------------------------------------------------------------------------------------------


def dockerignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    patterns = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        glob = line.lstrip("!").strip("/")
        regex = re.escape(glob).replace(r"\*\*", "\0").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        patterns.append((negate, re.compile(regex.replace("\0", ".*") + "$")))
    return patterns


def ignored(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matching a folder excludes what is inside."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for negate, pattern in dockerignore_patterns():
        if any(pattern.match(c) for c in candidates):
            result = not negate
    return result


def test_build_context_has_what_the_images_copy_and_no_secrets() -> None:
    for path in DOCKERFILES:
        for stage in dockerfile(path).stages:
            for copy in stage.all("COPY"):
                if "--from=" in copy.value:
                    continue
                sources = [w for w in shlex.split(copy.value) if not w.startswith("--")][:-1]
                for source in sources:
                    assert (REPO_ROOT / source).exists(), f"{path.name}:{copy.line}: COPY {source}: not in the repo"
                    assert not ignored(source), f"{path.name}:{copy.line}: {source} is excluded by .dockerignore"
    for secret_or_bulk in [".env", ".env.prod", ".venv", ".git", "out", "tests", "shared/__pycache__/x.pyc"]:
        assert ignored(secret_or_bulk), f".dockerignore should exclude {secret_or_bulk}"


# ---- the CPU image really needs no torch ------------------------------------------------------------------------


def test_api_image_installs_no_worker_extra() -> None:
    runs = " ".join(i.value for s in dockerfile(DOCKER_DIR / "api.Dockerfile").stages for i in s.all("RUN"))
    assert "[worker" not in runs and "torch==" not in runs, "the API image must not install torch"


def test_what_the_cpu_image_runs_imports_without_torch() -> None:
    """The API image runs the API, migrations, the sweeper, Flower and the webhook worker with no torch or diffusers
    installed: import all of it with those modules blocked."""
    script = """
import sys
for blocked in ("torch", "diffusers", "transformers", "accelerate", "av", "PIL", "numpy", "tokenizers"):
    sys.modules[blocked] = None  # `import blocked` now raises ImportError
import typer
import tools.cli
typer.main.get_command(tools.cli.app)
from services.api.app import create_app
create_app()
import services.webhooks.app, services.webhooks.tasks, services.sweeper.sweeper
import shared.infra.liveness, shared.infra.migrate
"""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("name", ["api", "flower", "webhooks", "migrate", "sweeper"])
def test_cpu_image_services_use_the_cpu_image(name: str) -> None:
    found = image_stage(services()[name])
    assert found is not None and found[0].path.name == "api.Dockerfile", name
