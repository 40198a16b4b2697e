"""The Kubernetes manifests (ops/k8s) render with kustomize, every object validates against the
Kubernetes schemas (KEDA's and the Prometheus Operator's from tests/ops/schemas), and they say what
docs/scaling.md says: the same `kvgate` entry points the tests start, KEDA on the very stream each
worker consumes, only the gateway reachable from outside and workers talking only to Redis."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from kvgate.cli import main as kvgate_cli
from shared import names

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "ops/k8s"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
OVERLAYS = ["gpu", "cpu", "external-redis"]
K8S_VERSION = "1.32"  # the kubectl these machines carry
# What the integration tests start (as tests/ops/test_compose.py): `kvgate up` spawns gateway,
# worker, celery worker and beat; compose's model-init and the cpu overlay's init run demo-model.
TESTED_ENTRY_POINTS = {"gateway", "worker", "celery worker", "celery beat"}
INIT_ENTRY_POINTS = {"demo-model"}
KIND_WITH_PODS = {"Deployment", "StatefulSet"}


def _kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("kubectl is missing: .ci/run installs it")
        pytest.skip("kubectl is not installed (kubectl 1.32, or Debian's kubernetes-client)")
    return path


_rendered: dict[str, list[dict]] = {}


def render(overlay: str) -> list[dict]:
    """The overlay's objects as `kubectl kustomize` renders them (offline), once per session."""
    if overlay not in _rendered:
        out = subprocess.run([_kubectl(), "kustomize", str(K8S / "overlays" / overlay)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        _rendered[overlay] = [d for d in yaml.safe_load_all(out.stdout) if d]
    return _rendered[overlay]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    return doc


def pod_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    return [(d["metadata"]["name"], d["spec"]["template"]) for d in docs if d["kind"] in KIND_WITH_PODS]


def settings(docs: list[dict]) -> dict[str, str]:
    (cm,) = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith("kvgate-settings")]
    return cm["data"]


def worker_identity(container: dict) -> tuple[str, str]:
    args = container["args"]
    return args[args.index("--served-name") + 1], args[args.index("--version") + 1]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates(overlay):
    docs = render(overlay)
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy",
            "ConfigMap", "Secret", "ScaledObject", "ServiceMonitor", "PodMonitor"} <= {d["kind"] for d in docs}
    for doc in docs:
        group_version = doc["apiVersion"].replace("/", "_")
        crd = SCHEMAS / f"{group_version}_{doc['kind']}.yaml"
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if crd.exists():
            try:
                jsonschema.validate(doc, yaml.safe_load(crd.read_text()))
            except jsonschema.ValidationError as e:
                pytest.fail(f"{where}: {e.message[:300]} at {list(e.absolute_path)}")
            continue
        try:  # strict: unknown fields are errors, as the API server's field validation makes them
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            pytest.fail(f"{where}: no schema, neither Kubernetes' nor one in tests/ops/schemas")
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where}: {e.message[:300]} at {list(e.path)}")


def test_a_crd_schema_refuses_what_the_crd_would():
    """The shipped schemas are not vacuous: a misspelt field and a numeric trigger value fail."""
    docs = render("gpu")
    schema = yaml.safe_load((SCHEMAS / "keda.sh_v1alpha1_ScaledObject.yaml").read_text())
    (so,) = of_kind(docs, "ScaledObject")
    typo = json.loads(json.dumps(so))
    typo["spec"]["minReplicas"] = 1
    number = json.loads(json.dumps(so))
    number["spec"]["triggers"][0]["metadata"]["pendingEntriesCount"] = 16
    for bad in (typo, number):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def _check_entry(where: str, container: dict, allowed: set[str]) -> str:
    assert container["command"] == ["kvgate"], f"{where} does not run the kvgate console script"
    args = container["args"]
    entry = " ".join(args[:2]) if args[0] == "celery" else args[0]
    assert entry in allowed, f"{where} runs `kvgate {entry}`, which no test starts"
    if not entry.startswith("celery"):  # celery's own arguments go to Celery
        cmd = kvgate_cli.commands[args[0]]
        options = {opt for p in cmd.params for opt in p.opts}
        for arg in args[1:]:
            if arg.startswith("--"):
                assert arg.split("=")[0] in options, f"{where}: `kvgate {entry}` has no {arg}"
    return entry


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_containers_run_the_entry_points_the_tests_start(overlay):
    seen = set()
    for name, template in pod_specs(render(overlay)):
        spec = template["spec"]
        for c in spec["containers"]:
            if "kvgate" in c["image"]:
                seen.add(_check_entry(f"{name}/{c['name']}", c, TESTED_ENTRY_POINTS))
        for c in spec.get("initContainers", []):
            _check_entry(f"{name}/{c['name']} (init)", c, INIT_ENTRY_POINTS)
    assert seen == TESTED_ENTRY_POINTS


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_scales_each_worker_on_the_stream_it_consumes(overlay):
    docs = render(overlay)
    workers = {d["metadata"]["name"]: d for d in of_kind(docs, "Deployment")
               if d["spec"]["template"]["spec"]["containers"][0]["args"][0] == "worker"}
    scaled = of_kind(docs, "ScaledObject")
    assert sorted(s["spec"]["scaleTargetRef"]["name"] for s in scaled) == sorted(workers), \
        "one ScaledObject per worker Deployment (model version)"
    for so in scaled:
        worker = workers[so["spec"]["scaleTargetRef"]["name"]]
        served, version = worker_identity(worker["spec"]["template"]["spec"]["containers"][0])
        assert so["spec"]["minReplicaCount"] >= 1, "no live worker: the gateway answers 503"
        assert "replicas" not in worker["spec"], "KEDA owns the count: a re-apply must not reset it"
        kinds = set()
        for trigger in so["spec"]["triggers"]:
            meta = trigger["metadata"]
            assert trigger["type"] == "redis-streams"
            assert meta["stream"] == names.request_stream(served, version)
            assert meta["consumerGroup"] == names.CONSUMER_GROUP
            kinds |= {"pending", "lag"} & {"pending" * ("pendingEntriesCount" in meta),
                                           "lag" * ("lagCount" in meta)}
            auth = named(docs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
            for ref in auth["spec"]["secretTargetRef"]:
                assert ref["key"] in named(docs, "Secret", ref["name"])["stringData"]
        assert kinds == {"pending", "lag"}


def _selects(selector: dict, labels: dict) -> bool:
    assert "matchExpressions" not in selector, "extend _selects to read matchExpressions"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _rules(docs: list[dict], labels: dict, direction: str) -> list[dict]:
    """Every ingress or egress rule of the policies that select a pod with these labels."""
    key, policy_type = direction, direction.capitalize()
    return [rule for p in of_kind(docs, "NetworkPolicy")
            if policy_type in p["spec"]["policyTypes"] and _selects(p["spec"]["podSelector"], labels)
            for rule in p["spec"].get(key, [])]


def _pod_labels(docs: list[dict]) -> dict[str, dict]:
    return {name: t["metadata"]["labels"] for name, t in pod_specs(docs)}


def _ports(rule: dict) -> set[int]:
    return {p["port"] for p in rule.get("ports", [])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_open_only_the_gateway_and_workers_reach_only_redis(overlay):
    docs = render(overlay)
    deny = named(docs, "NetworkPolicy", "default-deny")["spec"]
    assert deny["podSelector"] == {} and set(deny["policyTypes"]) == {"Ingress", "Egress"}
    assert "ingress" not in deny and "egress" not in deny
    pods = _pod_labels(docs)
    for name, labels in pods.items():
        for rule in _rules(docs, labels, "ingress"):
            open_to_all = not rule.get("from")
            assert not open_to_all or name == "kvgate-gateway", f"{name} is reachable from anywhere"
    gateway_open = [r for r in _rules(docs, pods["kvgate-gateway"], "ingress") if not r.get("from")]
    assert [_ports(r) for r in gateway_open] == [{8000}]
    redis = {"app.kubernetes.io/name": "kvgate-redis"}
    external = overlay == "external-redis"
    for name, labels in pods.items():
        if labels.get("app.kubernetes.io/name") != "kvgate-worker":
            continue
        for rule in _rules(docs, labels, "egress"):
            for peer in rule["to"]:
                if "ipBlock" in peer:
                    assert external and _ports(rule) <= {6379, 26379}, f"{name} may reach {peer}"
                elif peer.get("podSelector") == {"matchLabels": redis}:
                    assert _ports(rule) == {6379} and "namespaceSelector" not in peer
                else:  # DNS, and nothing else
                    assert peer["podSelector"]["matchLabels"] == {"k8s-app": "kube-dns"}
                    assert _ports(rule) == {53}
        for rule in _rules(docs, labels, "ingress"):  # Prometheus scrapes /metrics, nothing else
            assert _ports(rule) == {9400} and all("namespaceSelector" in p for p in rule["from"])
    if not external:  # the in-cluster Redis takes kvgate's clients (and KEDA), nobody else
        redis_pod = pods["kvgate-redis"]
        for rule in _rules(docs, redis_pod, "ingress"):
            assert _ports(rule) == {6379}
            for peer in rule["from"]:
                assert peer in ({"podSelector": {"matchLabels": {"kvgate/redis-client": "true"}}},
                                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}}})
        assert all(_ports(r) == {53} for r in _rules(docs, redis_pod, "egress")), "Redis calls out"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_shutdown_waits_for_the_drain_and_probes_hit_the_served_ports(overlay):
    docs = render(overlay)
    drain = float(settings(docs)["KVGATE_DRAIN_GRACE_S"])
    gateway = named(docs, "Deployment", "kvgate-gateway")["spec"]["template"]["spec"]
    pre_stop = gateway["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep" and gateway["terminationGracePeriodSeconds"] > drain + float(pre_stop[1])
    c = gateway["containers"][0]
    port = c["args"][c["args"].index("--port") + 1]
    assert {p["containerPort"] for p in c["ports"]} == {int(port)}
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for d in of_kind(docs, "Deployment"):
        spec = d["spec"]["template"]["spec"]
        c = spec["containers"][0]
        if c["args"][0] != "worker":
            continue
        assert spec["terminationGracePeriodSeconds"] > drain
        assert "lifecycle" not in c, "SIGTERM is the worker's drain: a preStop sleep only delays it"
        metrics_port = int(c["args"][c["args"].index("--metrics-port") + 1])
        assert {p["containerPort"] for p in c["ports"]} == {metrics_port}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"]["port"] == "metrics"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_as_non_root_on_read_only_filesystems(overlay):
    docs = render(overlay)
    for name, template in pod_specs(docs):
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, name
            assert "memory" in c["resources"]["limits"], f"{name}/{c['name']} has no memory limit"
    budgets = {d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
               for d in of_kind(docs, "PodDisruptionBudget")}
    assert budgets == {"kvgate-gateway", "kvgate-worker"}
    hpa = named(docs, "HorizontalPodAutoscaler", "kvgate-gateway")["spec"]
    assert hpa["metrics"][0]["resource"]["name"] == "cpu" and hpa["minReplicas"] >= 2
    assert "replicas" not in named(docs, "Deployment", "kvgate-gateway")["spec"], "the HPA owns the count"


def test_gpu_workers_take_a_gpu_and_cpu_workers_build_the_demo_model():
    gpu = named(render("gpu"), "Deployment", "kvgate-worker-demo-v1")["spec"]["template"]["spec"]
    worker = gpu["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"name": "KVGATE_DEVICE", "value": "cuda"} in worker["env"]
    assert gpu["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in gpu["tolerations"])
    cpu = named(render("cpu"), "Deployment", "kvgate-worker-demo-v1")["spec"]["template"]["spec"]
    worker = cpu["containers"][0]
    assert "nvidia.com/gpu" not in json.dumps(cpu)
    assert {"name": "KVGATE_DEVICE", "value": "cpu"} in worker["env"]
    (init,) = cpu["initContainers"]
    model = worker["args"][worker["args"].index("--model") + 1]
    assert init["args"] == ["demo-model", model]  # it writes the folder the worker serves
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert model.startswith(mounts["models"] + "/")
    assert {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}["models"] == mounts["models"]


def test_external_redis_replaces_the_in_cluster_one():
    docs = render("external-redis")
    assert not of_kind(docs, "StatefulSet")
    assert "kvgate-redis" not in {d["metadata"]["name"] for d in of_kind(docs, "Service")}
    for so in of_kind(docs, "ScaledObject"):
        assert all("kvgate-redis" not in t["metadata"]["address"] for t in so["spec"]["triggers"])


def test_secrets_are_placeholders_and_every_url_setting_is_there():
    docs = render("gpu")
    secret = named(docs, "Secret", "kvgate-secrets")
    assert "data" not in secret, "base64 values would hide a real secret from review"
    for key, value in secret["stringData"].items():
        assert "REPLACE-ME" in value, f"{key} holds something that is not a placeholder"
    assert {"KVGATE_SECRET", "KVGATE_REDIS_URL", "KVGATE_BROKER_URL", "REDIS_PASSWORD"} <= set(secret["stringData"])
    assert settings(docs)["KVGATE_REDIS_MODE"] == "single"


def test_grafana_dashboards_ship_as_a_configmap():
    board = named(render("gpu"), "ConfigMap", "kvgate-grafana-dashboards")
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = sorted(ROOT.glob("ops/grafana/dashboards/*.json"))
    assert sorted(board["data"]) == [f.name for f in files]
    for f in files:
        assert json.loads(board["data"][f.name]) == json.loads(f.read_text())
