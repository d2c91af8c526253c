"""The Kubernetes manifests in deploy/kubernetes: schema-valid and consistent with the code.

No cluster runs them here. Each YAML document is validated offline against the Kubernetes
OpenAPI schema that ``kubernetes-validate`` ships, in strict mode (an unknown or misplaced
field fails); then what the manifests hand to kvtether is checked against kvtether itself:
router flags and ``KVTETHER_ROUTER_*`` variables are RouterSettings fields with valid values,
the vLLM example's ``--kv-transfer-config`` is what ``kvtether stack up --profile gpu`` builds,
and the settings both sides read agree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvtether.connector._compat import TARGET_VLLM_VERSION
from kvtether.connector._settings import ConnectorSettings
from kvtether.protocol import CONTROL_SECRET_ENV
from kvtether.router.settings import RouterSettings
from kvtether.stack._commands import InstancePlan, VllmCommands, kv_transfer_config
from kvtether.stack.settings import StackSettings

# Pinned: the oldest of the three newest minors kubernetes-validate 1.37 ships (Kubernetes
# supports three at a time). Fields these manifests use exist there and in every later one.
K8S_VERSION = "1.35"

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
ROUTER_PREFIX = RouterSettings.model_config["env_prefix"]


def _load() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(KUBE.rglob("*.yaml")):
        if path.name == "kustomization.yaml":  # kustomize's own file, not a Kubernetes object
            continue
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                docs.append((f"{path.relative_to(KUBE)}#{i} {doc['kind']}", doc))
    return docs


DOCS = _load()
OBJECTS = [doc for _, doc in DOCS]


def _of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in OBJECTS if d["kind"] == kind]


def _pod_specs() -> list[dict[str, Any]]:
    return [d["spec"]["template"]["spec"] for d in OBJECTS
            if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]


def _containers() -> list[dict[str, Any]]:
    return [c for spec in _pod_specs()
            for c in spec.get("initContainers", []) + spec["containers"]]


def _router_containers() -> list[dict[str, Any]]:
    return [c for c in _containers() if c.get("command", [])[:2] == ["kvtether", "router"]]


def _vllm_containers() -> list[dict[str, Any]]:
    return [c for c in _containers() if "--kv-transfer-config" in c.get("args", [])]


def _arg(container: dict[str, Any], flag: str) -> str:
    args = container["args"]
    return args[args.index(flag) + 1]


def _config_map(name: str) -> dict[str, str]:
    return next(d["data"] for d in _of_kind("ConfigMap") if d["metadata"]["name"] == name)


def _router_env() -> dict[str, str]:
    """Every environment variable the router containers get (ConfigMaps, then env)."""
    env: dict[str, str] = {}
    for c in _router_containers():
        for source in c.get("envFrom", []):
            env.update(_config_map(source["configMapRef"]["name"]))
        env.update({e["name"]: e.get("value", "<from a Secret>") for e in c.get("env", [])})
    return env


def test_the_manifests_are_found() -> None:
    kinds = {d["kind"] for d in OBJECTS}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "Secret", "NetworkPolicy",
            "PodDisruptionBudget", "HorizontalPodAutoscaler"} <= kinds
    assert len(_router_containers()) == 1 and len(_vllm_containers()) == 2


@pytest.mark.parametrize("doc", OBJECTS, ids=[name for name, _ in DOCS])
def test_every_document_matches_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_strict_schema_check_rejects_an_unknown_field() -> None:
    # The check above would pass vacuously if strict mode let misspelled fields through.
    service = next(d for d in OBJECTS if d["kind"] == "Service")
    bad = {**service, "spec": {**service["spec"], "sessionAffinityy": "None"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


@pytest.mark.parametrize("kustomization", sorted(KUBE.rglob("kustomization.yaml")),
                         ids=lambda p: str(p.relative_to(KUBE)))
def test_kustomization_resources_exist(kustomization: Path) -> None:
    resources = yaml.safe_load(kustomization.read_text())["resources"]
    assert resources
    missing = [r for r in resources if not (kustomization.parent / r).is_file()]
    assert not missing, f"{kustomization}: no such resource {missing}"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its kustomize) not installed")
@pytest.mark.parametrize("kustomization", sorted(KUBE.rglob("kustomization.yaml")),
                         ids=lambda p: str(p.relative_to(KUBE)))
def test_kustomize_renders_every_listed_object(kustomization: Path) -> None:
    rendered = subprocess.run(["kubectl", "kustomize", str(kustomization.parent)],
                              capture_output=True, text=True, check=True, timeout=60).stdout
    listed = [d for r in yaml.safe_load(kustomization.read_text())["resources"]
              for d in yaml.safe_load_all((kustomization.parent / r).read_text()) if d]

    def names(docs: list[dict[str, Any]]) -> list[tuple[str, str]]:
        return sorted((d["kind"], d["metadata"]["name"]) for d in docs)

    assert names(list(yaml.safe_load_all(rendered))) == names(listed)


def test_router_flags_and_env_are_router_settings() -> None:
    fields = set(RouterSettings.model_fields)
    for c in _router_containers():
        argv = c["command"][2:] + c.get("args", [])
        flags = [a[2:].split("=", 1)[0].replace("-", "_") for a in argv if a.startswith("--")]
        assert set(flags) <= fields, f"not router settings: {set(flags) - fields}"
    for source in (s for c in _router_containers() for s in c.get("envFrom", [])):
        keys = _config_map(source["configMapRef"]["name"])
        assert all(k.startswith(ROUTER_PREFIX) for k in keys), "the router ignores other names"
    names = {k[len(ROUTER_PREFIX):].lower() for k in _router_env() if k.startswith(ROUTER_PREFIX)}
    assert names and names <= fields, f"not router settings: {names - fields}"


def test_router_env_values_validate(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith(ROUTER_PREFIX)]:
        monkeypatch.delenv(name)
    for name, value in _router_env().items():
        if name.startswith(ROUTER_PREFIX):
            monkeypatch.setenv(name, value)
    settings = RouterSettings()
    assert settings.host == "0.0.0.0"  # reachable from the Service, not loopback
    assert len(settings.decode_urls) == len(settings.decode_control_urls) >= 1
    assert len(settings.prefill_urls) == len(settings.prefill_control_urls) >= 1
    assert _router_env()[ROUTER_PREFIX + "STORE"].startswith("redis://")


def test_images_are_pinned() -> None:
    for c in _containers():
        image = c["image"]
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        assert "@sha256:" in image or (tag and tag != "latest"), f"unpinned image {image}"


@pytest.mark.parametrize("field", ["resources", "readinessProbe", "livenessProbe"])
def test_every_container_has(field: str) -> None:
    for c in _containers():
        assert c.get(field), f"container {c['name']} has no {field}"
        if field == "resources":
            assert c[field].get("requests") and c[field].get("limits", {}).get("memory")


def test_router_pods_run_non_root_on_a_read_only_root() -> None:
    for spec in _pod_specs():
        if any(c in _router_containers() for c in spec["containers"]):
            assert spec["securityContext"]["runAsNonRoot"] is True
            for c in spec["containers"]:
                assert c["securityContext"]["readOnlyRootFilesystem"] is True
                assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_referenced_secrets_and_config_maps_are_defined() -> None:
    secrets = {d["metadata"]["name"]: set(d["stringData"]) for d in _of_kind("Secret")}
    config_maps = {d["metadata"]["name"] for d in _of_kind("ConfigMap")}
    for spec in _pod_specs():
        for c in spec["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets.get(ref["name"], set()), ref
            for source in c.get("envFrom", []):
                assert source["configMapRef"]["name"] in config_maps
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets


def test_vllm_example_loads_the_connector_as_the_stack_does() -> None:
    stack = StackSettings(profile="gpu", control_host="0.0.0.0")
    for c in _vllm_containers():
        config = json.loads(_arg(c, "--kv-transfer-config"))
        extra = config["kv_connector_extra_config"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        plan = InstancePlan(name="x", role=extra["kvtether_role"], host="0.0.0.0", port=8000,
                            log_path=Path("unused"), control_port=ports["kvtether-ctl"])
        assert config == kv_transfer_config(plan, stack)
        served = dataclasses.replace(plan, model_dir=Path("model"), served_model_name="model")
        stack_argv = {"args": VllmCommands().command(served, stack).argv}
        assert _arg(c, "--scheduler-cls") == _arg(stack_argv, "--scheduler-cls")
        # Typos in kvtether_* keys would be ignored by the connector: each must be a setting.
        aliases = {f.alias for f in ConnectorSettings.model_fields.values()}
        assert {k for k in extra if k.startswith("kvtether_")} <= aliases
        ConnectorSettings.from_extra_config(extra, env={CONTROL_SECRET_ENV: "x"})
        env = {e["name"]: e for e in c["env"]}
        assert "secretKeyRef" in env[CONTROL_SECRET_ENV]["valueFrom"]
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] \
            == "status.podIP"
        assert f"v{TARGET_VLLM_VERSION}" in c["image"]


def test_router_and_vllm_agree_on_shared_settings() -> None:
    env = _router_env()
    for c in _vllm_containers():
        extra = json.loads(_arg(c, "--kv-transfer-config"))["kv_connector_extra_config"]
        shared = {
            "KV_BLOCK_SIZE_TOKENS": _arg(c, "--block-size"),
            "KV_RECOMPUTE_THRESHOLD_TOKENS": extra["kv_recompute_threshold"],
            "DECODER_KV_BLOCKS_TTL_S": extra["decoder_kv_blocks_ttl"],
            "LEASE_TTL_S": extra["kvtether_lease_ttl_s"],
        }
        for name, value in shared.items():
            assert float(env[ROUTER_PREFIX + name]) == float(value), name
        port = str(extra["kvtether_control_port"])
        for urls in ("PREFILL_CONTROL_URLS", "DECODE_CONTROL_URLS"):
            assert all(u.endswith(f":{port}") for u in json.loads(env[ROUTER_PREFIX + urls]))


def test_only_routers_reach_the_control_port_and_the_store() -> None:
    control_port = 5900
    policies = {d["metadata"]["name"]: d["spec"] for d in _of_kind("NetworkPolicy")}
    router = {"app.kubernetes.io/name": "kvtether-router"}
    for name, port in (("kvtether-valkey", 6379), ("kvtether-connector-control", control_port)):
        for rule in policies[name]["ingress"]:
            covers = any(p["port"] <= port <= p.get("endPort", p["port"]) for p in rule["ports"])
            only_routers = all(f.get("podSelector", {}).get("matchLabels") == router
                               for f in rule["from"])
            assert only_routers or not covers, f"{name}: {rule}"
    selected = policies["kvtether-connector-control"]["podSelector"]["matchLabels"]
    for pool in (d for d in _of_kind("StatefulSet") if d["metadata"]["name"].startswith("vllm")):
        assert selected.items() <= pool["spec"]["template"]["metadata"]["labels"].items()


def test_vllm_image_is_built_for_the_connector_s_version() -> None:
    dockerfile = (ROOT / "deploy" / "images" / "vllm.Dockerfile").read_text()
    assert re.search(rf"^ARG VLLM_VERSION={re.escape(TARGET_VLLM_VERSION)}$", dockerfile, re.M)
