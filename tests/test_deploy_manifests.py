"""The shipped Kubernetes manifests and Docker Compose file: validated against the real schemas, cross-checked.

Schemas: Kubernetes' OpenAPI schemas as `kubernetes-validate` ships them (strict: unknown fields are errors), and
the compose-spec JSON schema as `check-jsonschema` vendors it.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.config import DiscoveryConfig, GatewayConfig, QueueConfig, from_mapping
from gateway.discovery import DnsDiscovery
from gateway.policies import make_policy
from gateway.router import Router

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose"


def k8s_objects() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def find(kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in k8s_objects() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def flag(args: list[str], name: str) -> str | None:
    """The value of `--name=value` or `--name value` in an argument list."""
    for i, arg in enumerate(args):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(args):
            return args[i + 1]
    return None


def test_every_manifest_is_valid_yaml_with_kind_and_name() -> None:
    """Each document has apiVersion, kind and metadata.name; kustomization lists every namespaced file."""
    objects = k8s_objects()
    assert objects
    for obj in objects:
        assert obj.get("apiVersion") and obj.get("kind")
        if obj["kind"] != "Kustomization":
            assert obj["metadata"]["name"]
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert set(kustomization["resources"]) == {"namespace.yaml", "replicas.yaml", "gateway.yaml"}
    assert all((K8S / r).is_file() for r in kustomization["resources"])


def test_every_kubernetes_object_is_valid_against_the_kubernetes_schema() -> None:
    """Each object (the Kustomization aside: not an API object) passes strict validation for current Kubernetes."""
    objects = [o for o in k8s_objects() if o["kind"] != "Kustomization"]
    assert {o["kind"] for o in objects} >= {"Namespace", "ConfigMap", "Deployment", "Service"}
    for obj in objects:
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def test_the_kubernetes_validator_catches_a_mistake() -> None:
    """The same check refuses a misspelt field and a wrong type: it is not a rubber stamp."""
    deployment = find("Deployment", "smallserve-gateway")
    misspelt = copy.deepcopy(deployment)
    misspelt["spec"]["replica"] = misspelt["spec"].pop("replicas")
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "three"
    for broken in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def check_compose(path: Path) -> subprocess.CompletedProcess[str]:
    command = [str(Path(sys.executable).parent / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
               str(path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_compose_file_is_valid_against_the_compose_spec(tmp_path: Path) -> None:
    """docker-compose.yaml passes the compose-spec schema; a misspelt service key does not."""
    result = check_compose(COMPOSE / "docker-compose.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    broken = compose()
    broken["services"]["gateway"]["depends"] = broken["services"]["gateway"].pop("depends_on")
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(broken))
    result = check_compose(tmp_path / "broken.yaml")
    assert result.returncode != 0 and "depends" in result.stdout


def test_gateway_pods_are_several_and_share_load_through_the_feedback() -> None:
    """Several gateway pods, each with the replica-load feedback on and a worker per CPU it requests."""
    deployment = find("Deployment", "smallserve-gateway")
    config, _ = gateway_config_from_k8s()
    assert deployment["spec"]["replicas"] >= 2
    assert config.feedback.enabled and config.feedback.interval_s <= 1
    cpu = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"]
    assert config.workers == int(cpu)


def test_headless_service_selects_the_replica_pods() -> None:
    """The Service is headless, selects exactly the replica pods' labels, and targets their http port."""
    service = find("Service", "vllm-replicas")
    deployment = find("Deployment", "vllm-replica")
    assert service["spec"]["clusterIP"] == "None"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port = service["spec"]["ports"][0]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert port["targetPort"] in [p["name"] for p in container["ports"]]
    assert service["metadata"]["namespace"] == deployment["metadata"]["namespace"]


def test_replica_pods_share_gpus_within_memory() -> None:
    """Replica pods run vllm-openai on GPU nodes, one shared GPU unit each, fixed KV pools that fit a GPU."""
    deployment = find("Deployment", "vllm-replica")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"].startswith("vllm/vllm-openai:")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    args = container["args"]
    assert flag(args, "--port") == "8000" and flag(args, "--model")
    assert flag(args, "--max-num-seqs") is not None
    sharing = yaml.safe_load(find("ConfigMap", "smallserve-gpu-sharing")["data"]["any"])
    per_gpu = sharing["sharing"]["timeSlicing"]["resources"][0]["replicas"]
    assert per_gpu >= 2
    assert deployment["spec"]["replicas"] % per_gpu == 0
    kv_bytes = int(flag(args, "--kv-cache-memory-bytes") or 0)
    assert kv_bytes > 0, "pods on one GPU start together: a fixed KV pool, not profiling"
    assert per_gpu * (kv_bytes + 2 * 2**30) < 80 * 10**9  # KV + weights/activations per pod, on an 80 GB GPU


def test_replica_probes_and_prometheus_annotations() -> None:
    """Replica pods are probed on /health and scraped on the port they serve /metrics on."""
    template = find("Deployment", "vllm-replica")["spec"]["template"]
    container = template["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    notes = template["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
    assert int(notes["prometheus.io/port"]) == container["ports"][0]["containerPort"]


def gateway_config_from_k8s() -> tuple[GatewayConfig, dict[str, Any]]:
    data = yaml.safe_load(find("ConfigMap", "smallserve-gateway")["data"]["gateway.yaml"])
    return from_mapping(data), data


def test_gateway_discovers_replicas_through_the_headless_service() -> None:
    """The gateway's config loads and its discovery name is the headless Service's cluster DNS name and port."""
    config, _ = gateway_config_from_k8s()
    service = find("Service", "vllm-replicas")
    assert not config.replicas and len(config.discovery) == 1
    entry = config.discovery[0]
    assert entry.name == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"
    assert entry.port == service["spec"]["ports"][0]["port"]
    args = find("Deployment", "vllm-replica")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert entry.max_requests == int(flag(args, "--max-num-seqs") or 0)


def test_gateway_deployment_mounts_its_config_and_is_scraped() -> None:
    """The gateway reads the ConfigMap from where it is mounted, listens where probed, and is scraped."""
    template = find("Deployment", "smallserve-gateway")["spec"]["template"]
    container = template["spec"]["containers"][0]
    config_path = container["command"][container["command"].index("--config") + 1]
    mount = next(m for m in container["volumeMounts"] if config_path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == "smallserve-gateway"
    assert Path(config_path).name in find("ConfigMap", "smallserve-gateway")["data"]
    config, _ = gateway_config_from_k8s()
    assert container["ports"][0]["containerPort"] == config.port
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    service = find("Service", "smallserve-gateway")
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()


class StubResolver:
    """Answers only for the names it knows, like a cluster DNS with one headless Service."""

    def __init__(self, records: dict[str, list[str]]) -> None:
        self.records = records

    async def resolve(self, name: str, port: int) -> list[str]:
        if name not in self.records:
            raise OSError(f"NXDOMAIN {name}")
        return self.records[name]


async def test_k8s_gateway_config_finds_the_pods_with_a_stub_resolver() -> None:
    """Fed the manifest's discovery entry, the gateway's DNS discovery turns the pod IPs into capped replicas."""
    config, _ = gateway_config_from_k8s()
    service = find("Service", "vllm-replicas")
    name = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"
    router = Router(make_policy(config.policy), QueueConfig())
    entry: DiscoveryConfig = config.discovery[0]
    discovery = DnsDiscovery(router, entry, StubResolver({name: ["10.1.0.7", "10.1.0.8", "10.1.1.3", "10.1.1.4"]}))
    await discovery.refresh()
    assert sorted(router.replicas) == [f"http://10.1.{x}:8000" for x in ("0.7", "0.8", "1.3", "1.4")]
    assert all(r.max_requests == entry.max_requests for r in router.replicas.values())


def compose() -> dict[str, Any]:
    return yaml.safe_load((COMPOSE / "docker-compose.yaml").read_text())  # type: ignore[no-any-return]


def vllm_services() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose()["services"].items() if name.startswith("vllm-")}


def test_compose_replicas_share_one_gpu_within_memory() -> None:
    """N >= 2 vllm-openai services reserve the same GPU, and their memory fractions add up to at most 0.9."""
    services = vllm_services()
    assert len(services) >= 2
    devices = set()
    total = 0.0
    for service in services.values():
        assert service["image"].startswith("vllm/vllm-openai:")
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        devices.add(tuple(device["device_ids"]))
        total += float(flag(service["command"], "--gpu-memory-utilization") or 0.9)
        assert flag(service["command"], "--port") == "8000"
        assert "/health" in " ".join(service["healthcheck"]["test"])
    assert len(devices) == 1 and len(next(iter(devices))) == 1
    assert total <= 0.9 + 1e-9


def test_compose_replicas_start_one_after_another() -> None:
    """Each replica after the first waits for the previous one to be healthy."""
    names = sorted(vllm_services(), key=lambda n: int(n.split("-")[1]))
    services = vllm_services()
    assert "depends_on" not in services[names[0]]
    for previous, name in zip(names, names[1:]):
        assert services[name]["depends_on"] == {previous: {"condition": "service_healthy"}}


def test_compose_gateway_fronts_every_replica() -> None:
    """The gateway waits for every replica, mounts its config, and that config lists each service once."""
    gateway = compose()["services"]["gateway"]
    services = vllm_services()
    assert set(gateway["depends_on"]) == set(services)
    assert all(d["condition"] == "service_healthy" for d in gateway["depends_on"].values())
    config_path = gateway["command"][gateway["command"].index("--config") + 1]
    source = next(v.split(":")[0] for v in gateway["volumes"] if v.split(":")[1] == config_path)
    config = from_mapping(yaml.safe_load((COMPOSE / source).read_text()))
    assert sorted(r.url for r in config.replicas) == sorted(f"http://{name}:8000" for name in services)
    for replica in config.replicas:
        command = services[re.sub(r"^http://|:8000$", "", replica.url)]["command"]
        assert replica.max_requests == int(flag(command, "--max-num-seqs") or 0)
    assert f"{config.port}:{config.port}" in gateway["ports"]
    assert (COMPOSE / gateway["build"]["context"] / gateway["build"]["dockerfile"]).resolve().is_file()


def test_gateway_image_runs_the_gateway_cli() -> None:
    """The gateway image's entry point is the `gateway` console script with a config file."""
    text = (DEPLOY / "gateway.Dockerfile").read_text()
    assert 'ENTRYPOINT ["gateway"]' in text and "--config" in text
