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


def test_service_monitors_scrape_the_proxy_with_a_key_and_the_pools() -> None:
    def selected(monitor: dict[str, Any]) -> set[str]:
        services = [doc for _, doc in _documents() if doc["kind"] == "Service"]
        return {
            s["metadata"]["name"] for s in services if _selects(monitor["spec"]["selector"], s["metadata"]["labels"])
        }

    proxy, pools = _by_name("ServiceMonitor", "pdclient-serve"), _by_name("ServiceMonitor", "vllm")
    assert selected(proxy) == {"pdclient-serve"} and selected(pools) == {"vllm-prefill", "vllm-decode"}
    assert proxy["spec"]["endpoints"][0]["path"] == pools["spec"]["endpoints"][0]["path"] == "/metrics"
    # The proxy's /metrics needs one of its keys (status_requires_api_key); the vLLM servers' does not.
    (endpoint,) = proxy["spec"]["endpoints"]
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "pdclient-serve", "key": "metrics-key"},
    }
    assert "authorization" not in pools["spec"]["endpoints"][0]


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


# -- who reaches the vLLM servers ------------------------------------------------------------

POOLS = ("prefill", "decode")


def _pod_labels(name: str) -> dict[str, str]:
    labels: dict[str, str] = _by_name("Deployment", name)["spec"]["template"]["metadata"]["labels"]
    return labels


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions In / Exists) on ``labels``."""
    assert selector and set(selector) <= {"matchLabels", "matchExpressions"}, selector
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        assert operator in ("In", "Exists"), expression
        if key not in labels or (operator == "In" and labels[key] not in expression["values"]):
            return False
    return True


def _policies_for(labels: dict[str, str]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (file, doc)
        for file, doc in _documents()
        if doc["kind"] == "NetworkPolicy" and _selects(doc["spec"]["podSelector"], labels)
    ]


def _container_port(deployment: str, name: str) -> int:
    port: int = next(
        p["containerPort"] for p in _container(_by_name("Deployment", deployment))["ports"] if p["name"] == name
    )
    return port


@pytest.mark.parametrize("leg", POOLS)
def test_only_the_proxy_and_the_other_pools_nixl_reach_a_vllm_pod(leg: str) -> None:
    """Anyone who reaches a vLLM server calls it with kv_transfer_params of its own: its
    /v1 needs the key, but vLLM's other routes (/invocations, /tokenize...) need none."""
    other = POOLS[1 - POOLS.index(leg)]
    pod = _pod_labels(f"vllm-{leg}")
    policies = _policies_for(pod)
    assert policies, f"no NetworkPolicy selects the vllm-{leg} pods"
    env = _env(_container(_by_name("Deployment", f"vllm-{leg}")))
    ucx_first, ucx_last = (int(n) for n in env["UCX_TCP_PORT_RANGE"].split("-"))
    admitted: dict[str, set[Any]] = {}
    for file, policy in policies:
        assert "Ingress" in policy["spec"]["policyTypes"]
        for rule in policy["spec"].get("ingress", []):
            assert rule.get("from") and rule.get("ports"), f"{file}: a rule without from or ports admits anyone"
            for peer in rule["from"]:
                assert "ipBlock" not in peer, f"{file}: an address block admits whoever holds it"
                assert "podSelector" in peer, f"{file}: a peer without a podSelector admits a whole namespace"
                names = [
                    n
                    for n in ("pdclient-serve", "vllm-prefill", "vllm-decode")
                    if _selects(peer["podSelector"], _pod_labels(n))
                ]
                if file == "monitoring.yaml" and not names:  # Prometheus, in the namespace it runs in
                    assert peer["namespaceSelector"], "a Prometheus in any namespace is anyone's pod labelled so"
                    names = ["prometheus"]
                else:
                    assert "namespaceSelector" not in peer, f"{file}: only this namespace's pods"
                (name,) = names
                ports = {(p["port"], p.get("endPort")) for p in rule["ports"]}
                admitted.setdefault(name, set()).update(ports)
    assert admitted.pop("pdclient-serve") == {("http", None)}
    assert admitted.pop(f"vllm-{other}") == {("nixl", None), (ucx_first, ucx_last)}
    assert admitted.pop("prometheus", {("http", None)}) == {("http", None)}
    assert not admitted, f"admitted besides the proxy and the other pool: {admitted}"
    # The ports admitted are the ones NIXL uses.
    assert _container_port(f"vllm-{leg}", "nixl") == int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
    assert ucx_first > _container_port(f"vllm-{leg}", "nixl") and ucx_last >= ucx_first


def _secret_ref(env: dict[str, Any], name: str) -> dict[str, Any]:
    ref: dict[str, Any] = env[name]["secretKeyRef"]
    return ref


@pytest.mark.parametrize("leg", POOLS)
def test_vllm_takes_the_key_the_proxy_sends_from_one_secret(leg: str) -> None:
    proxy = _env(_container(_by_name("Deployment", "pdclient-serve")))
    vllm = _container(_by_name("Deployment", f"vllm-{leg}"))
    env = _env(vllm)
    # vLLM reads VLLM_API_KEY as --api-key: in a variable, not the command line (ps shows it).
    assert not any(a.startswith("--api-key") for a in vllm["args"])
    key = _secret_ref(env, "VLLM_API_KEY")
    assert key == _secret_ref(proxy, "PDCLIENT_SERVE_UPSTREAM_API_KEY") and not key.get("optional")
    # The legs are signed with the secret the servers' guard checks (an image with the server patch).
    assert _secret_ref(env, "PDCLIENT_REUSE_SECRET") == _secret_ref(proxy, "PDCLIENT_REUSE_SECRET")
    assert _secret_ref(proxy, "PDCLIENT_REUSE_SECRET")["name"] == key["name"]


def test_the_proxy_shows_the_servers_only_to_a_key() -> None:
    container = _container(_by_name("Deployment", "pdclient-serve"))
    plain = {k: v for k, v in _env(container).items() if isinstance(v, str)}
    config = ServeConfig.load(environ={**plain, "PDCLIENT_SERVE_API_KEYS": "a-key"})
    # /metrics needs a key; /ready without one gives the probe its code and no endpoint.
    assert config.status_requires_api_key
    (port,) = _by_name("Service", "pdclient-serve")["spec"]["ports"]
    assert [p["name"] for p in container["ports"]] == [port["targetPort"]]


@pytest.mark.parametrize("leg", POOLS)
def test_vllm_pods_run_unprivileged(leg: str) -> None:
    deployment = _by_name("Deployment", f"vllm-{leg}")
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    context = container["securityContext"]
    assert context["allowPrivilegeEscalation"] is False and not context.get("privileged")
    assert context["capabilities"]["drop"] == ["ALL"] and not context["capabilities"].get("add")
    # Not root, so vLLM's caches ($HOME/.cache: the model, torch.compile, Triton) need a writable HOME.
    home = _env(container)["HOME"]
    volumes = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    assert any(m["mountPath"] == home and m["name"] in volumes for m in container["volumeMounts"])
