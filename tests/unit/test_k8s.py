"""deploy/k8s (Kustomize overlays) and deploy/grafana against the Kubernetes schemas and against what the
services really accept and export (no cluster here: kubectl only renders the overlays)."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import promql_parser
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
GRAFANA = REPO / "deploy" / "grafana"
OVERLAYS = ("cpu-only", "gpu", "gpu-vllm")
GPU_IMAGES = {"gpu": "tandem-cuda:latest", "gpu-vllm": "tandem-vllm:latest"}
KUBERNETES_VERSION = "1.32"
KUBECTL = shutil.which("kubectl")
ALLOWED_OTEL = {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SERVICE_NAME"}
# Kinds of custom resources, which the Kubernetes schemas do not know: their structure is checked below.
CUSTOM_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "PodMonitor")}
WORKER_MODULES = {"cpu_worker": ("cpu", 50061), "gpu_worker": ("gpu", 50062)}
KIND_LABEL = "tandem.dev/worker-kind"
# What a downward-API variable resolves to in a pod, for parsing the environment here.
DOWNWARD_VALUES = {"metadata.namespace": "tandem", "requests.cpu": "2"}
# Grafana's variables, as the dashboard's queries use them, replaced by what they could stand for.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h", "$job": ".*"}

needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl (with its built-in Kustomize) is not installed: "
                                                            "the overlays cannot be rendered")


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    result = subprocess.run([KUBECTL, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return tuple(obj for obj in yaml.safe_load_all(result.stdout) if obj)


@pytest.fixture(params=OVERLAYS)
def overlay(request) -> str:
    return request.param


@pytest.fixture
def objects(overlay) -> tuple[dict, ...]:
    return render(overlay)


def of_kind(objects, kind: str) -> dict[str, dict]:
    return {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == kind}


def pod_labels(deployment: dict) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def containers(deployment: dict) -> list[dict]:
    return deployment["spec"]["template"]["spec"]["containers"]


def ports(container: dict) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container.get("ports", [])}


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def selected(selector: dict[str, str], deployments: dict[str, dict]) -> set[str]:
    return {name for name, deployment in deployments.items() if matches(selector, pod_labels(deployment))}


def module_of(container: dict) -> str:
    command = container["command"]
    assert command[:2] == ["python", "-m"], command
    return command[2]


def environment(container: dict) -> dict[str, str]:
    """The container's variables, downward-API ones resolved to a typical value."""
    values = {}
    for var in container.get("env", []):
        if "value" in var:
            values[var["name"]] = var["value"]
        else:
            source = var["valueFrom"]
            ref = source.get("fieldRef", {}).get("fieldPath") or source.get("resourceFieldRef", {}).get("resource")
            assert ref in DOWNWARD_VALUES, f"{var['name']}: unexpected valueFrom {source}"
            values[var["name"]] = DOWNWARD_VALUES[ref]
    return values


def entry_point(module: str):
    """(parser, parse_config) of the module a container runs."""
    if module == "router_svc":
        from router_svc.config import build_parser, parse_config

        return build_parser(), parse_config
    from tandem.worker import config

    kind, port = WORKER_MODULES[module]
    return config.build_parser(kind, port), lambda argv: config.parse_config(kind, port, argv)


def parsed_config(container: dict, monkeypatch):
    """The container's configuration as its entry point parses it from the container's command and environment."""
    module = module_of(container)
    parser, parse_config = entry_point(module)
    env = environment(container)
    unknown = {key for key in env if key not in parser.env_vars and key not in ALLOWED_OTEL}
    assert not unknown, f"{container['name']} sets variables that {module} ignores: {unknown}"
    for key in list(parser.env_vars) + sorted(ALLOWED_OTEL):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return parse_config(container["command"][3:] + container.get("args", []))


@functools.cache
def exported_series() -> frozenset[str]:
    """Every series name the router and the workers export: their registered metrics and the workers' engine gauges."""
    from prometheus_client import REGISTRY

    import router_svc.metrics  # noqa: F401  (registers the router's metrics)
    from tandem.engine.config import SchedulerConfig
    from tandem.engine.engine import EngineState
    from tandem.engine.rates import Rates
    from tandem.engine.scheduler import Scheduler
    from tandem.worker.metrics import EngineStateCollector

    rates = Rates(**{field.name: 1 for field in dataclasses.fields(Rates)})
    state = EngineState(seq=0, healthy=True, device="cpu", max_active_requests=8, block_size=16,
                        load=Scheduler(SchedulerConfig(), 64).load(), rates=rates)
    families = [*REGISTRY.collect(), *EngineStateCollector(lambda: state).collect()]
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count", "")}
    return frozenset(family.name + suffix for family in families for suffix in suffixes.get(family.type, ("",)))


def metric_names(query: str) -> set[str]:
    """The metric names a PromQL query reads (Grafana's variables replaced first); fails on a syntax error."""
    for variable, value in GRAFANA_VARIABLES.items():
        query = query.replace("${" + variable[1:] + "}", value).replace(variable, value)
    assert "$" not in query, f"an unknown variable in {query}"
    names = set()
    promql_parser.walk(promql_parser.parse(query),
                       lambda node: names.add(node.name) if isinstance(node, promql_parser.VectorSelector) else None)
    return names


def matchers(query: str) -> dict[str, dict[str, str]]:
    """For each metric a query reads, its equality matchers."""
    found = {}

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            found[node.name] = {m.name: m.value for m in node.matchers.matchers if m.op == promql_parser.MatchOp.Equal}

    promql_parser.walk(promql_parser.parse(query), visit)
    return found


# --- the rendered overlays ------------------------------------------------------------------------------


@needs_kubectl
def test_every_object_matches_the_kubernetes_schema(objects):
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {exc}")
        except kubernetes_validate.SchemaNotFoundError:
            pytest.fail(f"{obj['apiVersion']} {obj['kind']} is neither a Kubernetes kind nor a custom one checked here")


@needs_kubectl
def test_the_overlays_deploy_the_router_and_their_workers(objects, overlay):
    deployments = of_kind(objects, "Deployment")
    expected = {"router", "cpu-worker", "gpu-worker"} if overlay in GPU_IMAGES else {"router", "cpu-worker"}
    assert set(deployments) == expected
    assert set(of_kind(objects, "ScaledObject")) == set(of_kind(objects, "PodDisruptionBudget")) == expected - {"router"}
    gpus = {name: containers(d)[0]["resources"].get("limits", {}).get("nvidia.com/gpu") for name, d in deployments.items()}
    assert {name for name, count in gpus.items() if count} == ({"gpu-worker"} if overlay in GPU_IMAGES else set())
    if overlay in GPU_IMAGES:
        assert int(gpus["gpu-worker"]) == 1
        (gpu_worker,) = containers(deployments["gpu-worker"])
        assert gpu_worker["image"] == GPU_IMAGES[overlay]
        assert environment(gpu_worker).get("TANDEM_ENGINE", "tandem") == ("vllm" if overlay == "gpu-vllm" else "tandem")
    for name in ("router", "cpu-worker"):
        assert containers(deployments[name])[0]["image"] == "tandem:latest", name
    namespaces = {obj["metadata"].get("namespace") for obj in objects if obj["kind"] != "Namespace"}
    assert namespaces == {"tandem"} and set(of_kind(objects, "Namespace")) == {"tandem"}


@needs_kubectl
def test_every_deployment_sets_only_variables_its_entry_point_accepts(objects, monkeypatch):
    for name, deployment in of_kind(objects, "Deployment").items():
        (container,) = containers(deployment)
        config = parsed_config(container, monkeypatch)
        declared = ports(container)
        assert config.host == "0.0.0.0", name
        assert config.port == declared["grpc"], f"{name} serves gRPC on {config.port}, declares {declared}"
        assert config.metrics_port == declared["metrics"], f"{name} serves metrics on {config.metrics_port}"
        if module_of(container) == "router_svc":
            assert config.http_port == declared["http"]
        else:
            assert set(declared) == {"grpc", "metrics"}


@needs_kubectl
def test_pods_carry_the_labels_and_port_the_router_discovers_workers_by(objects):
    deployments = of_kind(objects, "Deployment")
    router = environment(containers(deployments["router"])[0])
    assert router["TANDEM_DISCOVER"] == "k8s"
    selector = dict(term.split("=", 1) for term in router["TANDEM_SELECTOR"].split(","))
    assert selector == {"app.kubernetes.io/part-of": "tandem", "app.kubernetes.io/component": "worker"}
    workers = selected(selector, deployments)
    assert workers == set(deployments) - {"router"}, "the router's selector must pick the workers and only them"
    for name, deployment in deployments.items():
        labels = pod_labels(deployment)
        assert labels["app.kubernetes.io/part-of"] == "tandem" and labels["app.kubernetes.io/name"] == name
        assert matches(deployment["spec"]["selector"]["matchLabels"], labels), name
        assert selected(deployment["spec"]["selector"]["matchLabels"], deployments) == {name}, name
        (container,) = containers(deployment)
        if name == "router":
            assert labels["app.kubernetes.io/component"] == "router" and KIND_LABEL not in labels
            continue
        kind, _ = WORKER_MODULES[module_of(container)]
        assert labels[KIND_LABEL] == kind, f"{name} runs a {kind} worker but is labelled {labels.get(KIND_LABEL)}"
        assert "grpc" in ports(container), f"{name} has no container port named grpc for the router to dial"
        assert "replicas" not in deployment["spec"], f"{name}: KEDA owns the replica count"


@needs_kubectl
def test_probes_use_grpc_health_on_declared_ports(objects):
    for name, deployment in of_kind(objects, "Deployment").items():
        (container,) = containers(deployment)
        declared = ports(container)
        for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[probe_name]
            if "grpc" in probe:
                assert probe["grpc"]["port"] == declared["grpc"], f"{name} {probe_name} probes {probe['grpc']['port']}"
            else:
                port = probe["tcpSocket"]["port"]
                assert port in declared or port in declared.values(), f"{name} {probe_name}: undeclared port {port}"
        assert "grpc" in container["readinessProbe"], f"{name}: readiness follows gRPC health"
        if name != "router":  # the router is NOT_SERVING without healthy workers: its liveness only asks that it listens
            assert "grpc" in container["livenessProbe"] and "grpc" in container["startupProbe"], name
            startup = container["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, f"{name}: too little time to load"


@needs_kubectl
def test_termination_grace_outlasts_the_drain(objects, monkeypatch):
    from router_svc.__main__ import GRACE_S

    for name, deployment in of_kind(objects, "Deployment").items():
        (container,) = containers(deployment)
        period = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        # Past the drain, the worker stops its server (1 s) and its engine; the router stops both its front ends.
        drain = GRACE_S if name == "router" else parsed_config(container, monkeypatch).drain_grace_s
        assert period >= drain + 5, f"{name}: {period} s to terminate, {drain} s to drain"


@needs_kubectl
def test_every_container_requests_resources(objects):
    for name, deployment in of_kind(objects, "Deployment").items():
        (container,) = containers(deployment)
        requests = container["resources"]["requests"]
        assert {"cpu", "memory"} <= set(requests), name
        assert "memory" in container["resources"]["limits"], name


@needs_kubectl
def test_services_select_pods_on_their_named_ports(objects):
    deployments = of_kind(objects, "Deployment")
    services = of_kind(objects, "Service")
    assert set(services) == {"router"}
    service = services["router"]
    assert selected(service["spec"]["selector"], deployments) == {"router"}
    declared = ports(containers(deployments["router"])[0])
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        "grpc": (50051, "grpc"), "http": (8000, "http"), "metrics": (9451, "metrics")}
    assert all(p["targetPort"] in declared for p in service["spec"]["ports"])


@needs_kubectl
def test_the_router_may_get_list_and_watch_pods(objects):
    router = of_kind(objects, "Deployment")["router"]["spec"]["template"]["spec"]
    account = router["serviceAccountName"]
    assert account in of_kind(objects, "ServiceAccount")
    roles = of_kind(objects, "Role")
    bindings = [b for b in of_kind(objects, "RoleBinding").values()
                if any(s["kind"] == "ServiceAccount" and s["name"] == account for s in b["subjects"])]
    granted = set()
    for binding in bindings:
        assert binding["roleRef"]["kind"] == "Role" and binding["roleRef"]["name"] in roles
        assert all(s.get("namespace", binding["metadata"]["namespace"]) == binding["metadata"]["namespace"]
                   for s in binding["subjects"])
        for rule in roles[binding["roleRef"]["name"]]["rules"]:
            if "" in rule["apiGroups"] and "pods" in rule["resources"]:
                granted |= set(rule["verbs"])
    assert {"get", "list", "watch"} <= granted
    assert granted <= {"get", "list", "watch"}, "the router only reads pods"


@needs_kubectl
def test_one_disruption_budget_per_worker_kind(objects):
    deployments = of_kind(objects, "Deployment")
    for name, budget in of_kind(objects, "PodDisruptionBudget").items():
        assert selected(budget["spec"]["selector"]["matchLabels"], deployments) == {name}
        assert budget["spec"].get("maxUnavailable", 0) >= 1 or "minAvailable" in budget["spec"]


# --- custom resources: KEDA and prometheus-operator -------------------------------------------------------


@needs_kubectl
def test_scaled_objects_scale_each_worker_on_its_waiting_queue(objects):
    deployments = of_kind(objects, "Deployment")
    (monitor,) = of_kind(objects, "PodMonitor").values()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    relabelled = {rule["targetLabel"]: rule["sourceLabels"] for rule in endpoint["relabelings"]}
    for name, scaled in of_kind(objects, "ScaledObject").items():
        assert scaled["apiVersion"] == "keda.sh/v1alpha1"
        spec = scaled["spec"]
        target = spec["scaleTargetRef"]
        assert target.get("kind", "Deployment") == "Deployment" and target["name"] in deployments
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus"
        metadata = trigger["metadata"]
        assert metadata["serverAddress"].startswith("http") and float(metadata["threshold"]) > 0
        assert all(isinstance(value, str) for value in metadata.values()), "KEDA trigger metadata are strings"
        names = metric_names(metadata["query"])
        assert names == {"tandem_worker_requests_waiting"} and names <= exported_series()
        selectors = matchers(metadata["query"])["tandem_worker_requests_waiting"]
        kind = pod_labels(deployments[target["name"]])[KIND_LABEL]
        assert selectors == {"namespace": scaled["metadata"]["namespace"], "worker_kind": kind}
        # worker_kind exists only because the PodMonitor copies the pod label onto the series.
        assert relabelled["worker_kind"] == ["__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", KIND_LABEL)]


@needs_kubectl
def test_the_pod_monitor_scrapes_every_pod_on_its_metrics_port(objects, monkeypatch):
    deployments = of_kind(objects, "Deployment")
    (monitor,) = of_kind(objects, "PodMonitor").values()
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    spec = monitor["spec"]
    assert selected(spec["selector"]["matchLabels"], deployments) == set(deployments)
    # Jobs named after the pods' app, as docker-compose names its jobs: the dashboard reads both.
    assert spec["jobLabel"] == "app.kubernetes.io/name"
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    for name, deployment in deployments.items():
        (container,) = containers(deployment)
        assert ports(container)[endpoint["port"]] == parsed_config(container, monkeypatch).metrics_port, name


# --- Grafana -----------------------------------------------------------------------------------------------


def dashboard() -> dict:
    return json.loads((GRAFANA / "dashboards" / "tandem.json").read_text())


def all_panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def dashboard_queries() -> list[tuple[str, str]]:
    board = dashboard()
    queries = [(panel["title"], target["expr"])
               for panel in all_panels(board["panels"]) for target in panel.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((\w+), *\w+\)", variable["definition"])
            assert match, variable["definition"]
            queries.append((f"variable {variable['name']}", match[1]))
    return queries


def test_every_dashboard_query_parses_and_reads_exported_metrics():
    queries = dashboard_queries()
    assert len(queries) > 20
    exported = exported_series()
    for title, query in queries:
        unknown = metric_names(query) - exported
        assert not unknown, f"panel {title!r} reads metrics nobody exports: {unknown}"


def test_the_dashboard_shows_what_serving_needs():
    read = set().union(*(metric_names(query) for _, query in dashboard_queries()))
    for metric in ("tandem_router_time_to_first_token_seconds_bucket", "tandem_worker_time_to_first_token_seconds_bucket",
                   "tandem_worker_time_per_output_token_seconds_bucket", "tandem_worker_requests_running",
                   "tandem_worker_requests_waiting", "tandem_worker_kv_usage_ratio", "tandem_router_decisions_total",
                   "tandem_router_failovers_total", "tandem_worker_preemptions_total",
                   "tandem_worker_step_batch_size_bucket", "tandem_worker_prompt_tokens_bucket",
                   "tandem_worker_output_tokens_bucket"):
        assert metric in read, f"the dashboard does not show {metric}"
    titles = [panel["title"] for panel in all_panels(dashboard()["panels"])]
    assert "Offload share" in titles


def test_the_dashboard_is_well_formed_for_provisioning():
    board = dashboard()
    assert board["uid"] == "tandem" and board["title"]
    panels = list(all_panels(board["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert all(target["datasource"] == panel["datasource"] for target in panel["targets"]), panel["title"]
            grid = panel["gridPos"]
            assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
    (datasource,) = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    assert datasource["name"] == "datasource" and datasource["query"] == "prometheus"


def test_grafana_provisioning_points_at_prometheus_and_the_dashboards():
    sources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = sources["datasources"]
    assert (source["type"], source["url"], source["uid"]) == ("prometheus", "http://prometheus:9090", "prometheus")
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "tandem.yml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "/var/lib/grafana/dashboards"
    (datasource,) = [v for v in dashboard()["templating"]["list"] if v["type"] == "datasource"]
    assert datasource["current"]["value"] == source["uid"]
