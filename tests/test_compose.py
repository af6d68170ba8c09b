"""docker-compose.yml: valid for docker-compose, and wired the way `docker compose up` relies on."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

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


def test_the_four_services_exist(services):
    assert {"minio", "minio-init", "adapter-store", "inference-worker"} <= set(services)


def test_store_and_worker_have_healthchecks(services):
    assert "shared.health_probe" in services["adapter-store"]["healthcheck"]["test"]
    worker_check = services["inference-worker"]["healthcheck"]["test"]
    assert worker_check[-2:] == ["127.0.0.1:50051", "readiness"]


def test_start_order(services):
    assert services["minio-init"]["depends_on"]["minio"]["condition"] == "service_healthy"
    store_deps = services["adapter-store"]["depends_on"]
    assert store_deps["minio-init"]["condition"] == "service_completed_successfully"
    worker_deps = services["inference-worker"]["depends_on"]
    assert worker_deps["adapter-store"]["condition"] == "service_healthy"


def test_a_worker_that_exits_after_an_engine_failure_is_restarted(services):
    assert services["inference-worker"]["restart"] in ("always", "unless-stopped", "on-failure")
