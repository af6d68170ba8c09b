"""deploy/k8s: every manifest valid against the Kubernetes API schema, and wired the way the pods
rely on at run time: command lines the real parsers accept, probes on the ports the processes
listen on, every Secret and ConfigMap they name present, nginx's upstreams naming every worker, the
gateway reaching the router and the stores through Services that lead to them."""

import argparse
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from adapter_store.__main__ import build_parser as store_parser
from inference_service.server.main import build_parser as worker_parser
from openai_gateway.__main__ import parse_args as gateway_args

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
NGINX = REPO / "deploy" / "nginx"
# The oldest version the manifests must work on: native sidecars (restartPolicy: Always on an init
# container) are on by default from 1.29 and GA in 1.33.
KUBERNETES_VERSION = "1.33"


class GatewayParser:
    """openai_gateway builds its parser inside parse_args, which exits on an unknown flag itself."""

    def parse_known_args(self, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
        return gateway_args(argv), []


PARSERS = {"inference_service": worker_parser, "adapter_store": store_parser, "openai_gateway": GatewayParser}
GRPC_PROGRAMS = ("adapter_store", "inference_service")
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_resources() -> list[dict]:
    return [d for path in MANIFESTS for d in documents(path)]


def one(kind: str, name: str) -> dict:
    return next(r for r in all_resources() if r["kind"] == kind and r["metadata"]["name"] == name)


def pod_specs() -> list[dict]:
    return [r["spec"]["template"]["spec"] for r in all_resources() if "template" in r.get("spec", {})]


def containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


def loramux_containers() -> list[tuple[str, dict, argparse.Namespace]]:
    """(program, container, parsed flags) of every container running one of our programs."""
    found = []
    for spec in pod_specs():
        for c in containers(spec):
            command = c.get("command", []) + c.get("args", [])
            if command[:2] == ["python", "-m"]:
                assert command[2] in PARSERS, f"container {c['name']} runs an unknown module {command[2]}"
                found.append((command[2], c, parse(command[2], command[3:], c)))
    return found


def parse(program: str, argv: list[str], container: dict) -> argparse.Namespace:
    """The flags as the program sees them, with the container's environment set (the token
    defaults come from it)."""
    env = {e["name"]: e.get("value", f"<{e['name']} from the cluster>") for e in container.get("env", [])}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        try:
            args, unknown = PARSERS[program]().parse_known_args(argv)
        except SystemExit:
            pytest.fail(f"{program} in container {container['name']} rejects a value in {argv}")
    assert not unknown, f"{program} in container {container['name']} has no flags {unknown}"
    return args


def grpc_containers() -> list[tuple[str, dict, argparse.Namespace]]:
    """loramux_containers() of the worker and the store: gRPC, with a separate metrics port."""
    return [found for found in loramux_containers() if found[0] in GRPC_PROGRAMS]


def gateway() -> tuple[dict, argparse.Namespace]:
    return next((c, args) for program, c, args in loramux_containers() if program == "openai_gateway")


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def named_ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def assert_valid(resource: dict, source: str) -> None:
    """Strict: a field the API does not have (a typo) fails too."""
    try:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(part) for part in e.path)
        pytest.fail(f"{source}: {resource['kind']}/{resource['metadata']['name']}: {where}: {e.message}")


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_strictly(path):
    for resource in documents(path):
        assert_valid(resource, path.name)


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = {r for r in kustomization["resources"] if r.endswith(".yaml")}
    assert listed == {p.name for p in MANIFESTS}


def test_kustomize_builds_the_router_config_from_deploy_nginx():
    kubectl, kustomize = shutil.which("kubectl"), shutil.which("kustomize")
    if not (kubectl or kustomize):
        pytest.skip("neither kubectl nor kustomize is installed")
    command = [kubectl, "kustomize"] if kubectl else [kustomize, "build"]
    built = subprocess.run([*command, str(K8S)], capture_output=True, text=True, timeout=30)
    assert built.returncode == 0, built.stderr
    resources = list(yaml.safe_load_all(built.stdout))
    for r in resources:
        assert_valid(r, "kustomize build")
    config = next(r for r in resources if r["kind"] == "ConfigMap")
    assert config["data"]["loramux.conf"] == (NGINX / "loramux.conf").read_text()
    assert config["data"]["listen.conf"] == (NGINX / "listen.conf").read_text()
    assert config["data"]["upstreams.conf"] == (K8S / "nginx-upstreams.conf").read_text()
    router = next(
        r for r in resources if r["metadata"]["name"] == "loramux-router" and r["kind"] == "Deployment"
    )
    volumes = router["spec"]["template"]["spec"]["volumes"]
    assert config["metadata"]["name"] in [v["configMap"]["name"] for v in volumes if "configMap" in v]
    assert {r["metadata"].get("namespace") for r in resources if r["kind"] != "Namespace"} == {"loramux"}


def test_worker_store_and_gateway_command_lines_parse():
    """loramux_containers() parses each command line with its program's parser, failing on an
    unknown flag or a bad value."""
    programs = sorted(program for program, _, _ in loramux_containers())
    assert programs == ["adapter_store", "inference_service", "openai_gateway"]


def test_probes_and_ports_are_where_the_processes_listen():
    for program, c, args in grpc_containers():
        listen, metrics = port_of(args.listen), port_of(args.metrics_listen)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["grpc"]["port"] == listen, f"{program} {probe}"
        assert {listen, metrics} <= set(named_ports(c).values()), program
        assert args.listen.startswith("0.0.0.0:"), f"{program}: kubelet probes come from outside the pod"


def test_worker_uses_its_sidecar_store_with_the_shared_token():
    by_program = {program: (c, args) for program, c, args in loramux_containers()}
    store, store_args = by_program["adapter_store"]
    worker_args = by_program["inference_service"][1]
    assert store.get("restartPolicy") == "Always", "the store must be a native sidecar"
    assert worker_args.store == f"127.0.0.1:{port_of(store_args.listen)}"
    assert worker_args.api_token and store_args.admin_token
    assert worker_args.store_token and worker_args.store_token == store_args.worker_token


def test_stores_share_a_catalog_in_buckets_the_cluster_creates():
    store_args = next(args for program, _, args in loramux_containers() if program == "adapter_store")
    assert store_args.catalog and store_args.catalog.startswith("s3://"), (
        "each pod would have its own catalog"
    )
    job = one("Job", "minio-create-bucket")["spec"]["template"]["spec"]["containers"][0]
    created = set(re.findall(r"local/([a-z0-9.-]+)", " ".join(job["args"])))
    wanted = {store_args.catalog.removeprefix("s3://").partition("/")[0], *store_args.s3_allowed_bucket}
    assert wanted <= created
    assert store_args.s3_endpoint == f"http://minio:{one('Service', 'minio')['spec']['ports'][0]['port']}"


def test_writable_paths_are_volumes():
    cache = re.search(r"^ENV LORAMUX_CACHE=(\S+)", (REPO / "Dockerfile").read_text(), re.M).group(1)
    for program, c, args in loramux_containers():
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert "/tmp" in mounts
        if program in GRPC_PROGRAMS:  # the gateway keeps nothing on disk
            writable = str(args.data_dir) if program == "adapter_store" else f"{cache}/adapters"
            assert writable in mounts, f"{program} writes to {writable}"


def test_every_secret_and_config_map_named_exists():
    secrets = {
        r["metadata"]["name"]: {*r.get("stringData", {}), *r.get("data", {})}
        for r in all_resources()
        if r["kind"] == "Secret"
    }
    config_maps = {
        g["name"]
        for folder in (K8S, NGINX)
        for g in yaml.safe_load((folder / "kustomization.yaml").read_text()).get("configMapGenerator", [])
    }
    for spec in pod_specs():
        for c in containers(spec):
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets.get(ref["name"], ()), f"{c['name']}: {env['name']}"
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps


def test_every_service_reaches_a_named_container_port():
    for service in (r for r in all_resources() if r["kind"] == "Service"):
        selector = service["spec"]["selector"]
        pods = [
            r["spec"]["template"]
            for r in all_resources()
            if selector.items()
            <= r.get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {}).items()
        ]
        assert pods, f"service {service['metadata']['name']} selects no pods"
        ports = {n: p for pod in pods for c in containers(pod["spec"]) for n, p in named_ports(c).items()}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"{service['metadata']['name']}: {port['targetPort']}"
        scraped = service["metadata"].get("annotations", {}).get("prometheus.io/port")
        if scraped:
            assert [int(scraped)] == [ports[p["targetPort"]] for p in service["spec"]["ports"]]


def test_metrics_services_scrape_every_process():
    metrics = {port_of(args.metrics_listen) for _, _, args in grpc_containers()}
    metrics.add(port_of(gateway()[1].listen))  # the gateway serves /metrics on its API port
    scraped = {
        int(r["metadata"]["annotations"]["prometheus.io/port"])
        for r in all_resources()
        if r["kind"] == "Service"
        and r["metadata"].get("annotations", {}).get("prometheus.io/scrape") == "true"
    }
    assert scraped == metrics == {9400, 9401, 8000}


def directives(path: Path) -> list[list[str]]:
    """An nginx include file's directives as word lists, comments and the closing ';' dropped."""
    lines = (line.split("#")[0].strip().removesuffix(";") for line in path.read_text().splitlines())
    return [line.split() for line in lines if line]


def test_nginx_upstreams_name_every_worker_pod():
    workers = one("StatefulSet", "loramux-worker")
    governing = one("Service", workers["spec"]["serviceName"])
    assert governing["spec"]["clusterIP"] == "None", "only a headless Service gives pods DNS names"
    namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    worker_args = next(args for program, _, args in loramux_containers() if program == "inference_service")
    domain = f"{governing['metadata']['name']}.{namespace}.svc.cluster.local"
    expected = {
        f"{workers['metadata']['name']}-{i}.{domain}:{port_of(worker_args.listen)}"
        for i in range(workers["spec"]["replicas"])
    }
    ours = directives(K8S / "nginx-upstreams.conf")
    servers = [words for words in ours if words[0] == "server"]
    assert {words[1] for words in servers} == expected
    shipped = next(words for words in directives(NGINX / "upstreams.conf") if words[0] == "server")
    for words in servers:
        assert set(words[2:]) == {"resolve", *shipped[2:]}, "failover as deploy/nginx/upstreams.conf has it"
    assert any(words[0] == "resolver" for words in ours), "`resolve` needs a resolver"


def service_backend(address: str) -> tuple[dict, dict, int]:
    """(pod template, container, container port) that the Service named by HOST:PORT sends to."""
    host, port = address.rsplit(":", 1)
    services = [r for r in all_resources() if r["kind"] == "Service" and r["metadata"]["name"] == host]
    ports = [p["targetPort"] for s in services for p in s["spec"]["ports"] if p["port"] == int(port)]
    if not ports:
        pytest.fail(f"{address}: no Service {host} with port {port}")
    service, target = services[0], ports[0]
    selector = service["spec"]["selector"].items()
    for r in all_resources():
        template = r.get("spec", {}).get("template", {})
        if selector <= template.get("metadata", {}).get("labels", {}).items():
            for c in containers(template["spec"]):
                if target in named_ports(c):
                    return template, c, named_ports(c)[target]
    pytest.fail(f"{address}: Service {host} reaches no container port {target}")


def test_gateway_calls_the_workers_through_the_router():
    """Through nginx, so that the SDK's x-loramux-adapter keeps each adapter on one worker."""
    template, _, port = service_backend(gateway()[1].worker)
    router = one("Deployment", "loramux-router")["spec"]["selector"]["matchLabels"]
    assert router.items() <= template["metadata"]["labels"].items(), "not the router's pods"
    assert f"listen {port}" in (NGINX / "listen.conf").read_text()


def test_gateway_reaches_a_store_sidecar_of_the_shared_catalog():
    _, store, port = service_backend(gateway()[1].store)
    store_args = next(args for program, c, args in grpc_containers() if c == store)
    assert port == port_of(store_args.listen) and store_args.catalog.startswith("s3://")


def secret_of(container: dict, variable: str) -> tuple[str, str]:
    env = next(e for e in container["env"] if e["name"] == variable)
    ref = env["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def test_gateway_sends_the_tokens_the_store_and_workers_check():
    c, args = gateway()
    by_program = {program: container for program, container, _ in grpc_containers()}
    assert args.admin_token and args.worker_token and args.api_key
    admin = secret_of(c, "LORAMUX_ADMIN_TOKEN")
    assert admin == secret_of(by_program["adapter_store"], "LORAMUX_ADMIN_TOKEN")
    assert secret_of(c, "LORAMUX_API_TOKEN") == secret_of(
        by_program["inference_service"], "LORAMUX_API_TOKEN"
    )
    assert secret_of(c, "LORAMUX_GATEWAY_API_KEY") not in (admin, secret_of(c, "LORAMUX_API_TOKEN"))


def test_gateway_probes_and_service_are_where_it_listens():
    c, args = gateway()
    listen = port_of(args.listen)
    assert args.listen.startswith("0.0.0.0:"), "kubelet probes come from outside the pod"
    probes = {kind: c[kind]["httpGet"] for kind in ("readinessProbe", "livenessProbe")}
    assert all(named_ports(c)[probe["port"]] == listen for probe in probes.values())
    assert probes["readinessProbe"]["path"] == "/health"
    # /health is 503 until the workers have loaded their model: not a reason to restart the gateway.
    assert probes["livenessProbe"]["path"] != "/health"
    assert one("Deployment", "loramux-gateway")["spec"]["replicas"] >= 2
    assert service_backend("loramux-gateway:8000")[1] == c


def test_the_gpu_overlay_gives_each_worker_as_many_gpus_as_tensor_parallel_ranks():
    """deploy/k8s-gpu: the worker asks for N GPUs and splits the model over N ranks on CUDA, with a
    /dev/shm large enough for NCCL; everything else is deploy/k8s as it is."""
    kubectl = shutil.which("kubectl") or pytest.skip("kubectl is not installed")
    built = subprocess.run(
        [kubectl, "kustomize", str(REPO / "deploy" / "k8s-gpu")], capture_output=True, text=True
    )
    assert built.returncode == 0, built.stderr
    resources = [r for r in yaml.safe_load_all(built.stdout) if r]
    for r in resources:
        assert_valid(r, "kustomize build deploy/k8s-gpu")
    workers = next(r for r in resources if r["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    worker = next(c for c in workers["containers"] if c["name"] == "worker")
    args = parse("inference_service", worker["command"][3:], worker)
    assert (
        args.device == "cuda" and args.tensor_parallel_size == worker["resources"]["limits"]["nvidia.com/gpu"]
    )
    shm = next(m for m in worker["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert next(v for v in workers["volumes"] if v["name"] == shm["name"])["emptyDir"]["medium"] == "Memory"
