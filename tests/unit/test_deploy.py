"""The deployment files (Dockerfile, deploy/kubernetes/) against the Kubernetes schemas and
against the proxy they run: every probe, port and variable must be one ``pdclient serve``
has. No cluster is needed: ``kubernetes-validate`` carries the schemas."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pdclient.serve import SETTINGS, ServeConfig

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33.0"
# Custom resources: the schemas cover the built-in kinds only.
CUSTOM_KINDS = {"ServiceMonitor", "Kustomization"}


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


def _by_name(kind: str, name: str) -> dict[str, Any]:
    for _, doc in _documents():
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name} in {MANIFESTS}")


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container.get("env", [])}


def _setting_envs() -> set[str]:
    return {s.env for s in SETTINGS if s.env}


@pytest.mark.parametrize(("file", "doc"), _documents(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_manifest_is_valid_kubernetes(file: str, doc: dict[str, Any]) -> None:
    if doc["kind"] in CUSTOM_KINDS:
        assert doc["apiVersion"] in ("monitoring.coreos.com/v1", "kustomize.config.k8s.io/v1beta1")
        return
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    listed = set(yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}


def test_proxy_deployment_agrees_with_the_cli() -> None:
    deployment = _by_name("Deployment", "pdclient-serve")
    container = _container(deployment)
    env = _env(container)
    unknown = {name for name in env if name.startswith("PDCLIENT_SERVE_")} - _setting_envs()
    assert not unknown, f"not pdclient serve settings: {unknown}"
    # The config the proxy would run with, from exactly these variables.
    plain = {k: v for k, v in env.items() if isinstance(v, str)}
    plain["PDCLIENT_SERVE_API_KEYS"] = "a-key"
    config = ServeConfig.load(environ=plain)
    (port,) = container["ports"]
    assert config.port == port["containerPort"] and config.host == "0.0.0.0"
    assert config.api_keys == ("a-key",)
    assert config.options.discovery and config.options.health_checks
    # The probes are the proxy's own routes, on its port.
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port["name"]}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": port["name"]}
    # SIGTERM comes after preStop; the grace period must cover both and the proxy's own.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > int(pre_stop[1]) + config.grace_period
    # The pools' URLs name the headless Services, on their ports.
    for leg, url in (("prefill", config.options.prefill_urls[0]), ("decode", config.options.decode_urls[0])):
        service = _by_name("Service", f"vllm-{leg}")
        assert service["spec"]["clusterIP"] == "None"
        assert url == f"http://vllm-{leg}:{service['spec']['ports'][0]['port']}/v1"


@pytest.mark.parametrize("leg", ["prefill", "decode"])
def test_vllm_deployments_run_the_nixl_connector(leg: str) -> None:
    container = _container(_by_name("Deployment", f"vllm-{leg}"))
    args = container["args"]
    (given,) = [a.split("=", 1)[1] for a in args if a.startswith("--kv-transfer-config=")]
    config = json.loads(given)
    assert config["kv_connector"] in ("NixlConnector", "NixlPushConnector") and config["kv_role"] == "kv_both"
    env = _env(container)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ports["nixl"]
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert f"--port={ports['http']}" in args


def test_service_monitor_scrapes_the_proxy_and_the_pools() -> None:
    monitor = _by_name("ServiceMonitor", "pdclient")
    selector = monitor["spec"]["selector"]["matchLabels"]
    for name in ("pdclient-serve", "vllm-prefill", "vllm-decode"):
        labels = _by_name("Service", name)["metadata"]["labels"]
        assert selector.items() <= labels.items(), name
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def test_dockerfile_runs_the_proxy_as_non_root_with_known_settings() -> None:
    text = (REPO / "Dockerfile").read_text()
    final = text.rsplit("\nFROM ", 1)[1]
    assert re.search(r"^USER (?!0\b|root\b)\S+", final, re.M), "the image must not run as root"
    assert "[serve]" in final
    env = dict(re.findall(r"(PDCLIENT_SERVE_\w+)=(\S+)", final))
    assert set(env) <= _setting_envs()
    exposed = int(re.search(r"^EXPOSE (\d+)", final, re.M).group(1))  # type: ignore[union-attr]
    assert exposed == int(env["PDCLIENT_SERVE_PORT"])
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (.+)$", final, re.M).group(1))  # type: ignore[union-attr]
    assert entrypoint == ["pdclient", "serve"]
    # What the build stage copies is what .dockerignore lets through.
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if line and line[0] != "#"}
    copied = {w for line in re.findall(r"^COPY (?!--)(.+)$", text, re.M) for w in shlex.split(line)[:-1]}
    assert copied and not copied & ignored
    assert all((REPO / name).exists() for name in copied)
