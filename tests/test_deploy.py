"""Deployment files agree with what the tests run: docker-compose.yml, deploy/k8s/, deploy/prometheus/,
the Dockerfiles, the Makefile and .ci/run. Commands and ports come from tests/service_procs.py."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.service_procs import PORTS, ROOT, service_args

SERVICES = ["critic", "reward", "actor"]
# What a container adds to the tests' command line, and what a test therefore strips before comparing:
# flags with a value, and dotted `key=value` config overrides.
DEPLOY_FLAGS = {"--host", "--checkpoint-dir", "--config", "--auth-token-file"}
# The Kubernetes API version the manifests are checked against (kubernetes-validate ships its schemas).
K8S_SCHEMA_VERSION = "1.31.0"


def load_yaml(path: Path) -> object:
    return yaml.safe_load(path.read_text())


def strip_deploy_args(argv: list[str]) -> list[str]:
    """argv without DEPLOY_FLAGS (and their values) and without `key=value` overrides."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in DEPLOY_FLAGS:
            skip = True
        elif not arg.startswith("-") and "=" in arg:
            continue
        else:
            out.append(arg)
    return out


def flag_value(argv: list[str], flag: str) -> str:
    assert flag in argv, f"{flag} missing from {argv}"
    return argv[argv.index(flag) + 1]


def overrides(argv: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in argv if not a.startswith("-") and "=" in a)


def expected_command(name: str) -> list[str]:
    grpc, http = PORTS[name]
    return ["python", *service_args(name, grpc, http)]


def check_listens_on_all_interfaces(argv: list[str]) -> None:
    """Services listen on loopback by default: out of reach of published ports and of the kubelet's probes."""
    assert flag_value(argv, "--host") == "0.0.0.0", argv


def check_actor_targets(argv: list[str]) -> None:
    """The actor reaches the servers by their service names on their gRPC ports and writes under /runs."""
    ov = overrides(argv)
    assert ov["critic.address"] == f"critic:{PORTS['critic'][0]}"
    assert ov["reward.address"] == f"reward:{PORTS['reward'][0]}"
    assert ov["run_dir"].startswith("/runs/")


# --- docker-compose.yml ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml(ROOT / "docker-compose.yml")


def test_compose_has_the_three_services(compose):
    assert set(SERVICES) <= set(compose["services"])


@pytest.mark.parametrize("name", SERVICES)
def test_compose_command_is_the_tests_command(compose, name):
    command = compose["services"][name]["command"]
    assert isinstance(command, list), "exec form: a list, no shell"
    assert strip_deploy_args(command) == expected_command(name)
    check_listens_on_all_interfaces(command)
    if name == "actor":
        check_actor_targets(command)
        assert (ROOT / flag_value(command, "--config")).is_file(), "the config is read from the image's /app"
    if name == "critic":
        assert flag_value(command, "--checkpoint-dir").startswith("/runs/")


@pytest.mark.parametrize("name", SERVICES)
def test_compose_publishes_the_ports(compose, name):
    published = {str(p) for p in compose["services"][name]["ports"]}
    assert published == {f"{p}:{p}" for p in PORTS[name] if p is not None}


@pytest.mark.parametrize("name", SERVICES)
def test_compose_healthcheck_requests_ready(compose, name):
    test = compose["services"][name]["healthcheck"]["test"]
    assert test[:2] == ["CMD", "python"], "the slim image has no curl"
    assert f"http://localhost:{PORTS[name][1]}/ready" in " ".join(test)


def test_compose_actor_waits_for_healthy_servers(compose):
    actor = compose["services"]["actor"]
    assert actor["depends_on"] == {
        "critic": {"condition": "service_healthy"},
        "reward": {"condition": "service_healthy"},
    }
    assert actor["restart"] == "no"


def test_compose_volumes_and_image(compose):
    assert {"runs", "cache"} <= set(compose["volumes"])
    for name in SERVICES:
        svc = compose["services"][name]
        assert svc["image"] == "ppo-services:cpu"
        assert svc["environment"]["PPO_SERVICES_CACHE"] == "/cache"
        assert {"runs:/runs", "cache:/cache"} <= set(svc["volumes"])
        build = svc["build"]
        assert (ROOT / build["context"] / build["dockerfile"]).is_file()
        assert build["dockerfile"] == "deploy/Dockerfile"


def test_compose_services_authenticate_with_one_generated_token(compose):
    """Listening on 0.0.0.0 needs a token: one service makes it, the others read it from the shared volume."""
    maker = compose["services"]["auth-token"]
    assert "/secrets/auth_token" in " ".join(maker["command"]) and "secrets.token_hex" in " ".join(maker["command"])
    for name in SERVICES:
        svc = compose["services"][name]
        assert flag_value(svc["command"], "--auth-token-file") == "/secrets/auth_token", name
        assert "secrets:/secrets" in svc["volumes"]
    for name in ("critic", "reward"):
        assert compose["services"][name]["depends_on"]["auth-token"] == {"condition": "service_completed_successfully"}


def test_compose_prometheus_is_opt_in(compose):
    prometheus = compose["services"]["prometheus"]
    assert prometheus["profiles"] == ["monitoring"]
    source = prometheus["volumes"][0].split(":")[0]
    assert (ROOT / source).is_file()


def test_prometheus_scrapes_every_service():
    config = load_yaml(ROOT / "deploy/prometheus/prometheus.yml")
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in config["scrape_configs"])
    assert targets == {f"{name}:{PORTS[name][1]}" for name in SERVICES}


def compose_cli() -> list[str] | None:
    """A real Compose implementation: the docker plugin or the standalone docker-compose."""
    if shutil.which("docker"):
        ok = subprocess.run(["docker", "compose", "version"], check=False, capture_output=True, timeout=60).returncode == 0
        if ok:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_documented_exit_code_from_watches_only_its_service(compose):
    """`--exit-code-from S` implies --abort-on-container-exit, which stops the stack when any watched container exits;
    the one-shot auth-token service exits at start, so every documented use names S as the only service to attach."""
    assert any(spec.get("restart") == "no" and "actor" != name for name, spec in compose["services"].items())
    for path in (ROOT / "docker-compose.yml", ROOT / "deploy/README.md"):
        uses = re.findall(r"docker compose up (--exit-code-from (\S+)(?: [a-z-]+)*)", path.read_text())
        assert uses, path
        for command, service in uses:
            assert command.split() == ["--exit-code-from", service, service], (path, command)


def test_compose_file_is_valid_for_compose():
    cli = compose_cli()
    if cli is None:
        pytest.skip("no Compose implementation here (neither `docker compose` nor `docker-compose`)")
    result = subprocess.run([*cli, "-f", "docker-compose.yml", "config", "--quiet"], check=False, cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# --- deploy/k8s --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict]:
    """Every manifest under deploy/k8s, keyed by (kind, name)."""
    docs = {}
    for path in sorted((ROOT / "deploy/k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs[(doc["kind"], doc["metadata"]["name"] if "metadata" in doc else path.name)] = doc
    return docs


def pod_spec(k8s: dict, name: str) -> dict:
    kind = "Job" if name == "actor" else "Deployment"
    return k8s[(kind, name)]["spec"]["template"]["spec"]


def main_container(k8s: dict, name: str) -> dict:
    (container,) = [c for c in pod_spec(k8s, name)["containers"] if c["name"] == name]
    return container


def test_k8s_manifests_match_the_kubernetes_api_schemas(k8s):
    """Each manifest against the Kubernetes API's own OpenAPI schemas (kubernetes-validate, as kubeconform checks
    them), strictly: a misspelt or misplaced field is an error, not something the API server silently drops."""
    for (kind, name), doc in k8s.items():
        if kind == "Kustomization":  # kustomize's own file, not an API object
            continue
        kubernetes_validate.validate(doc, K8S_SCHEMA_VERSION, strict=True)


def test_kustomization_lists_every_manifest(k8s):
    resources = set(k8s[("Kustomization", "kustomization.yaml")]["resources"])
    files = {p.name for p in (ROOT / "deploy/k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert resources == files


@pytest.mark.parametrize("name", SERVICES)
def test_k8s_command_matches_compose(k8s, compose, name):
    container = main_container(k8s, name)
    argv = [*container["command"], *container["args"]]
    assert strip_deploy_args(argv) == expected_command(name)
    check_listens_on_all_interfaces(argv)
    compose_argv = compose["services"][name]["command"]

    def without_threads(a: list[str]) -> list[str]:
        return [x for x in a if not x.startswith("num_threads=")]

    # the thread budget follows each platform's CPU allotment (compose: one shared host, where the actor takes the
    # cores the servers leave; k8s: the requests)
    if name == "actor":
        check_actor_targets(argv)
        assert {k: v for k, v in overrides(argv).items() if k != "num_threads"} == overrides(compose_argv)
    else:
        assert without_threads(argv) == without_threads(compose_argv)


@pytest.mark.parametrize("name", SERVICES)
def test_k8s_services_read_the_token_from_a_secret(k8s, name):
    container = main_container(k8s, name)
    assert flag_value(container["args"], "--auth-token-file") == "/secrets/auth_token"
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["auth"]["mountPath"] == "/secrets" and mounts["auth"]["readOnly"]
    (volume,) = [v for v in pod_spec(k8s, name)["volumes"] if v["name"] == "auth"]
    assert volume["secret"]["secretName"] == "ppo-services-auth"
    assert volume["secret"]["items"] == [{"key": "token", "path": "auth_token"}]


@pytest.mark.parametrize("name", ["critic", "reward"])
def test_k8s_network_policy_lets_only_the_actor_reach_grpc(k8s, name):
    policy = k8s[("NetworkPolicy", name)]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_template_labels(k8s, name).items()
    grpc_port, http_port = PORTS[name]
    by_port = {rule["ports"][0]["port"]: rule for rule in policy["ingress"]}
    assert set(by_port) == {grpc_port, http_port}
    (source,) = by_port[grpc_port]["from"]
    actor_labels = k8s[("Job", "actor")]["spec"]["template"]["metadata"]["labels"]
    assert source["podSelector"]["matchLabels"].items() <= actor_labels.items()
    assert "from" not in by_port[http_port]  # probes and Prometheus


def test_k8s_thread_budgets_match_the_cpu_requests(k8s):
    for name in ("critic", "reward", "actor"):
        container = main_container(k8s, name)
        budget = [x for x in container["args"] if x.startswith("num_threads=")]
        assert budget == [f"num_threads={container['resources']['requests']['cpu']}"], name


@pytest.mark.parametrize("name", SERVICES)
def test_k8s_ports_probes_and_scrape_annotations(k8s, name):
    grpc, http = PORTS[name]
    container = main_container(k8s, name)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == ({"http": http} if grpc is None else {"grpc": grpc, "http": http})
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["resources"]["requests"]
    assert {"name": "PPO_SERVICES_CACHE", "value": "/cache"} in container["env"]
    spec = pod_spec(k8s, name)
    assert spec["terminationGracePeriodSeconds"] >= 30
    kind = "Job" if name == "actor" else "Deployment"
    annotations = k8s[(kind, name)]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(http)
    assert annotations["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("name", ["critic", "reward"])
def test_k8s_service_exposes_the_ports(k8s, name):
    service = k8s[("Service", name)]
    assert service["spec"]["selector"].items() <= pod_template_labels(k8s, name).items()
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert ports == dict(zip(["grpc", "http"], PORTS[name]))


def pod_template_labels(k8s: dict, name: str) -> dict:
    deployment = k8s[("Deployment", name)]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    return labels


def test_k8s_actor_job_mounts_its_config_and_the_runs_claim(k8s):
    spec = pod_spec(k8s, "actor")
    assert spec["restartPolicy"] == "Never"
    container = main_container(k8s, "actor")
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/runs"]]["persistentVolumeClaim"]["claimName"] in {
        name for kind, name in k8s if kind == "PersistentVolumeClaim"
    }
    config_path = Path(flag_value([*container["command"], *container["args"]], "--config"))
    config_map = volumes[mounts[str(config_path.parent)]]["configMap"]["name"]
    data = k8s[("ConfigMap", config_map)]["data"]
    assert config_path.name in data
    yaml.safe_load(data[config_path.name])


def test_k8s_actor_config_is_the_demo_config(k8s, compose):
    """The ConfigMap carries configs/ppo.yaml verbatim (regenerate it as deploy/README.md says)."""
    demo = ROOT / flag_value(compose["services"]["actor"]["command"], "--config")
    (config_map,) = [doc for (kind, _), doc in k8s.items() if kind == "ConfigMap"]
    assert yaml.safe_load(config_map["data"][demo.name]) == load_yaml(demo), (
        f"copy {demo.relative_to(ROOT)} into the `{demo.name}: |` block of deploy/k8s/actor-config.yaml"
    )


# --- Dockerfiles, Makefile, CI -----------------------------------------------------------------------------


def torch_pin() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'"torch==([^"]+)"', text).group(1)


def test_makefile_installs_torch_before_the_package():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^TORCH_VERSION\s*:?=\s*(\S+)", makefile, re.MULTILINE).group(1) == torch_pin()
    torch_install = re.search(r"pip install (\$\(PIP_INSTALL_FLAGS\) )?--index-url \$\(TORCH_CPU_INDEX\) "
                              r"torch==\$\(TORCH_VERSION\)", makefile)
    package_install = re.search(r"install (\$\(PIP_INSTALL_FLAGS\) )?-e '\.\[dev\]'", makefile)
    assert torch_install and package_install and torch_install.start() < package_install.start()
    # bytecode compiled after everything is installed (the installs skip it)
    assert makefile.index("$(call COMPILE_BYTECODE,$(VENV_PY))") > package_install.start()
    assert re.search(r"^test: install$", makefile, re.MULTILINE)


@pytest.mark.parametrize("dockerfile", ["deploy/Dockerfile", "deploy/Dockerfile.gpu"])
def test_dockerfile_installs_torch_first(dockerfile):
    text = (ROOT / dockerfile).read_text()
    assert re.search(r"^ARG TORCH_VERSION=(\S+)", text, re.MULTILINE).group(1) == torch_pin()
    torch_install = text.index('"torch==${TORCH_VERSION}"')
    assert torch_install < text.index("COPY pyproject.toml") < re.search(r"pip install .*-e ", text).start()
    if dockerfile.endswith("gpu"):
        assert "'.[trtllm]'" in text
    else:
        assert "--index-url https://download.pytorch.org/whl/cpu" in text[: torch_install]
        assert re.search(r"^USER (?!root)\S+", text, re.MULTILINE)
        # compile=true on the CPU needs a C++ compiler in the image
        assert re.search(r"apt-get install -y --no-install-recommends .*\bg\+\+", text)


def test_dockerignore_keeps_local_state_out_of_the_image():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "runs"} <= ignored


def test_ci_runs_make_test():
    script = (ROOT / ".ci/run").read_text()
    assert "set -euo pipefail" in script
    assert re.search(r"^make test$", script, re.MULTILINE)


def test_generated_stubs_are_fresh():
    result = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"], check=False, cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", SERVICES)
def test_k8s_pods_meet_the_restricted_pod_security_standard(k8s, name):
    """What a namespace labelled pod-security.kubernetes.io/enforce=restricted checks: non-root, no privilege
    escalation, every capability dropped, the runtime's seccomp profile; and every container, the init one too,
    requests resources."""
    spec = pod_spec(k8s, name)
    assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["seccompProfile"] == {
        "type": "RuntimeDefault"}
    for container in [*spec.get("initContainers", []), *spec["containers"]]:
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False and context["capabilities"] == {"drop": ["ALL"]}, name
        assert container["resources"]["requests"], container["name"]
