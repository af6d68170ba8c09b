"""docker-compose.yml: valid for docker-compose, and wired the way `docker compose up` relies on."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from inference_service.server.main import build_parser as worker_parser
from openai_gateway.__main__ import parse_args as gateway_args

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yml"


def compose(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [shutil.which("docker-compose"), "-f", str(COMPOSE_FILE), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )


def normalized_config() -> dict:
    """The file as docker-compose resolves it (interpolated, defaults filled) or, without the
    binary, as PyYAML reads it. PyYAML is only there as a dependency of a dependency; never added."""
    try:
        import yaml
    except ImportError:
        yaml = None
    if shutil.which("docker-compose") is None:
        if yaml is None:
            pytest.skip("neither docker-compose nor PyYAML is installed")
        return yaml.safe_load(COMPOSE_FILE.read_text())
    if yaml is not None:
        printed = compose("config")
        assert printed.returncode == 0, printed.stderr
        return yaml.safe_load(printed.stdout)
    as_json = compose("config", "--format", "json")  # Compose v2 only; v1 prints its usage instead
    if as_json.returncode != 0 or not as_json.stdout.lstrip().startswith("{"):
        pytest.skip("docker-compose v1 prints only YAML, and PyYAML is not installed")
    return json.loads(as_json.stdout)


@pytest.fixture(scope="module")
def services() -> dict:
    return normalized_config()["services"]


def test_docker_compose_accepts_the_file():
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed; only the structure tests below check the file")
    result = compose("config", "-q")
    assert result.returncode == 0, result.stderr


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def published(port: str | dict) -> tuple[str, int, int]:
    """(host address, host port, container port) of a `ports` entry, short or long form: the file
    has the short one, docker-compose v1 prints it with "/tcp", v2 prints the long one."""
    if isinstance(port, dict):
        return port.get("host_ip", ""), int(port["published"]), int(port["target"])
    *host, outside, inside = port.removesuffix("/tcp").split(":")
    return ":".join(host), int(outside), int(inside)


def test_the_services_exist(services):
    assert {"minio", "minio-init", "adapter-store", "inference-worker", "openai-gateway"} <= set(services)


def test_store_and_worker_have_healthchecks(services):
    assert "shared.health_probe" in services["adapter-store"]["healthcheck"]["test"]
    worker_check = services["inference-worker"]["healthcheck"]["test"]
    assert worker_check[-2:] == ["127.0.0.1:50051", "readiness"]


def test_gateway_healthcheck_asks_its_own_health_route(services):
    gateway = services["openai-gateway"]
    port = flag(gateway["command"], "--listen").rsplit(":", 1)[1]
    assert f"'http://127.0.0.1:{port}/health'" in gateway["healthcheck"]["test"][-1]


def test_gateway_reaches_the_worker_and_store_services_where_they_listen(services):
    command = services["openai-gateway"]["command"]
    assert command[:3] == ["python", "-m", "openai_gateway"]
    args = gateway_args(command[3:])  # exits on a flag the gateway does not have
    for address, service in ((args.worker, "inference-worker"), (args.store, "adapter-store")):
        host, _, port = address.rpartition(":")
        assert host == service, f"--worker/--store {address}: no service {host}"
        assert flag(services[service]["command"], "--listen") == f"0.0.0.0:{port}"


def test_gateway_has_the_stores_admin_token_and_publishes_its_port(services):
    gateway, store = services["openai-gateway"], services["adapter-store"]
    assert gateway["environment"]["LORAMUX_ADMIN_TOKEN"] == store["environment"]["LORAMUX_ADMIN_TOKEN"]
    listen = int(flag(gateway["command"], "--listen").rsplit(":", 1)[1])
    assert [published(p) for p in gateway["ports"]] == [("127.0.0.1", 8000, listen)]


def test_start_order(services):
    assert services["minio-init"]["depends_on"]["minio"]["condition"] == "service_healthy"
    store_deps = services["adapter-store"]["depends_on"]
    assert store_deps["minio-init"]["condition"] == "service_completed_successfully"
    worker_deps = services["inference-worker"]["depends_on"]
    assert worker_deps["adapter-store"]["condition"] == "service_healthy"
    gateway_deps = services["openai-gateway"]["depends_on"]
    assert gateway_deps["inference-worker"]["condition"] == "service_healthy"


@pytest.mark.parametrize("service", ["inference-worker", "openai-gateway"])
def test_a_service_that_exits_is_restarted(services, service):
    """The worker exits after an engine failure; the gateway on any crash."""
    assert services[service]["restart"] in ("always", "unless-stopped", "on-failure")


def test_the_gpu_override_reserves_as_many_gpus_as_the_worker_has_ranks():
    """docker-compose.gpu.yml, its ${VAR:-default}s at their defaults: the worker splits the model
    over as many ranks on CUDA as it reserves GPUs, and NCCL gets a /dev/shm of its size."""
    yaml = pytest.importorskip("yaml")
    text = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", (REPO / "docker-compose.gpu.yml").read_text())
    worker = yaml.safe_load(text)["services"]["inference-worker"]
    command = [str(part) for part in worker["command"]]
    args, unknown = worker_parser().parse_known_args(command[3:])
    assert command[:3] == ["python", "-m", "inference_service"] and not unknown
    (gpus,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert args.device == "cuda" and args.tensor_parallel_size == gpus["count"] and gpus["driver"] == "nvidia"
    assert worker["shm_size"] == "1gb"
