"""deploy/: the Compose file and the Kubernetes manifests, checked against the real thing (issue 32 #5).

Every `switchyard …` command line in them is parsed by the CLI's own parser (gateway/cli.py; the engine's by
`switchyard engine serve`'s), every policy in them by the gateway's policy loader, every SWITCHYARD_* variable
must be one the code reads, every switchyard_* metric an autoscaler or alert names must be one the gateway or
the engine exports, and the names they use for each other (Services, ports, selectors, scale targets, the
policy's engine URL) must agree. The HPA's per-replica target must be what the gateway computes for the policy.
"""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.cli import build_parser, engine_serve_parser
from gateway.policy import PolicyError, load_policy, parse_policy

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
# Metrics the alerts read that other exporters provide (kube-state-metrics).
FOREIGN_METRICS = {"kube_statefulset_status_replicas_ready"}


# ---------------------------------------------------------------------------------------------- helpers


def _k8s() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def _of_kind(kind: str) -> list[dict]:
    return [d for _, d in _k8s() if d["kind"] == kind]


def _named(kind: str, name: str) -> dict:
    found = [d for d in _of_kind(kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r} in deploy/k8s, found {len(found)}"
    return found[0]


def _parse_switchyard(argv: list[str]):
    """The namespace the real CLI makes of `switchyard ARGV`; a clear failure with argparse's message if not."""
    if argv[:2] == ["engine", "serve"]:
        parser, words = engine_serve_parser(), argv[2:]
    else:
        parser, words = build_parser(argv), argv
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(words)
    except SystemExit:
        pytest.fail(f"`switchyard {shlex.join(argv)}` is refused by the CLI: {err.getvalue().strip()}")


def _command_line(command, args=None) -> list[str]:
    words = shlex.split(command) if isinstance(command, str) else list(command or [])
    words += shlex.split(args) if isinstance(args, str) else list(args or [])
    return [str(w) for w in words]


def _containers(workload: dict) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def _switchyard_lines() -> list[tuple[str, list[str]]]:
    """(where, argv after `switchyard`) for every switchyard command in deploy/."""
    lines = []
    for name, svc in _compose()["services"].items():
        words = _command_line(svc.get("entrypoint"), svc.get("command"))
        if words and words[0] == "switchyard":
            lines.append((f"compose.yaml services.{name}", words[1:]))
    for file, d in _k8s():
        if d["kind"] in ("Deployment", "StatefulSet", "Job"):
            for c in _containers(d):
                words = _command_line(c.get("command"), c.get("args"))
                if words and words[0] == "switchyard":
                    lines.append((f"k8s/{file} {d['kind']} {d['metadata']['name']} {c['name']}", words[1:]))
    return lines


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _exported_metrics() -> set[str]:
    """Every metric family the gateway (all its modules loaded) and the engine register."""
    import prometheus_client

    import gateway.app  # noqa: F401 - registers the gateway's metrics in the default registry
    from hosted.metrics import EngineMetrics

    names = set()
    for registry in (prometheus_client.REGISTRY, EngineMetrics().registry):
        for family in registry.collect():
            names.add(family.name)
            if family.type == "counter":
                names.add(family.name + "_total")
    return names


def _metric_names(text: str) -> set[str]:
    names = set(re.findall(r"\b(switchyard_[a-z_]+|kube_[a-z_]+)\b", text))
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}


# ---------------------------------------------------------------------------------------------- command lines


def test_every_switchyard_command_line_parses_with_the_real_cli():
    lines = _switchyard_lines()
    commands = {tuple(argv[:2]) if argv[0] in ("engine", "db") else (argv[0],) for _, argv in lines}
    assert {("serve",), ("engine", "serve"), ("db", "upgrade")} <= commands, commands
    for where, argv in lines:
        args = _parse_switchyard(argv)
        assert args is not None, where


def test_a_made_up_flag_is_caught():  # the check above would catch a flag the CLI does not have
    with pytest.raises(pytest.fail.Exception, match="unrecognized arguments: --replicas"):
        _parse_switchyard(["serve", "--port", "8000", "--replicas", "3"])
    with pytest.raises(pytest.fail.Exception, match="unrecognized arguments"):
        _parse_switchyard(["engine", "serve", "--model", "m", "--tensor-parallel-size", "2"])


def test_environment_variables_are_ones_the_code_reads():
    source = "".join(p.read_text() for p in (ROOT / "gateway").rglob("*.py"))
    used = set(re.findall(r"\bSWITCHYARD_[A-Z_]+\b", (DEPLOY / "compose.yaml").read_text()))
    for path in K8S.glob("*.yaml"):
        used |= set(re.findall(r"\bSWITCHYARD_[A-Z_]+\b", path.read_text()))
    used -= {"SWITCHYARD_IMAGE"}  # compose's own interpolation variable (which image to run), not the code's
    assert used, "no SWITCHYARD_* settings found"
    unknown = sorted(v for v in used if f'"{v}"' not in source)
    assert not unknown, f"deploy/ sets variables the gateway never reads: {unknown}"


# ---------------------------------------------------------------------------------------------- compose


def test_compose_wires_gateways_engines_postgres_and_redis():
    services = _compose()["services"]
    assert {"postgres", "redis", "migrate", "gateway"} <= set(services)
    gateway = _command_line(services["gateway"]["command"])
    assert services["gateway"]["deploy"]["replicas"] >= 2

    # the policy the gateways are given is the file mounted at --policy, and it loads
    mounted = {v.split(":")[1]: v.split(":")[0] for v in services["gateway"]["volumes"]}
    policy_file = (DEPLOY / mounted[_flag(gateway, "--policy")]).resolve()
    policy = load_policy(policy_file)
    # each engine URL names an engine service, on its --port, serving the model under the backend's name
    urls = [u for b in policy.backends.values() if b.kind == "engine" for u in (b.api_bases or [b.api_base])]
    assert len(urls) >= 2, "the Compose policy should spread over at least two engines"
    for backend in (b for b in policy.backends.values() if b.kind == "engine"):
        for base in backend.api_bases or [backend.api_base]:
            url = urlsplit(base)
            engine = _command_line(services[url.hostname]["command"])
            assert engine[:3] == ["switchyard", "engine", "serve"]
            assert url.port == int(_flag(engine, "--port"))
            assert backend.model == _flag(engine, "--served-model-name")
            assert services["gateway"]["depends_on"][url.hostname]["condition"] == "service_healthy"
    # the database URL points at the postgres service with its user and database
    env = services["gateway"]["environment"]
    db = urlsplit(env["SWITCHYARD_DATABASE_URL"])
    pg = services["postgres"]["environment"]
    assert db.hostname == "postgres" and db.username == pg["POSTGRES_USER"] and db.path == "/" + pg["POSTGRES_DB"]
    assert services["gateway"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    # the replicas share budgets and limits through the redis service
    redis = urlsplit(_flag(gateway, "--redis-url"))
    assert redis.hostname == "redis" and (redis.port or 6379) == 6379
    assert services["gateway"]["depends_on"]["redis"]["condition"] == "service_healthy"


# ---------------------------------------------------------------------------------------------- kubernetes


def test_k8s_has_every_part_and_selectors_match():
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in _k8s()}
    for part in [("Deployment", "gateway"), ("StatefulSet", "engine"), ("Deployment", "redis"),
                 ("StatefulSet", "postgres"), ("ScaledObject", "engine"), ("ConfigMap", "switchyard-policy"),
                 ("Job", "switchyard-migrate"), ("HorizontalPodAutoscaler", "engine"), ("PrometheusRule", "switchyard")]:
        assert part in kinds, f"deploy/k8s lacks {part}"
    workloads = [d for _, d in _k8s() if d["kind"] in ("Deployment", "StatefulSet")]
    for w in workloads:
        want = w["spec"]["selector"]["matchLabels"]
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert want.items() <= labels.items(), f"{w['metadata']['name']}: selector does not match its pods"
    for svc in _of_kind("Service"):
        selected = [w for w in workloads
                    if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, f"Service {svc['metadata']['name']} selects {len(selected)} workloads"
        ports = {p["containerPort"] for c in _containers(selected[0]) for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, f"Service {svc['metadata']['name']}: no container port {p['targetPort']}"
    engine = _named("StatefulSet", "engine")
    assert engine["spec"]["serviceName"] in {s["metadata"]["name"] for s in _of_kind("Service")
                                             if s["spec"].get("clusterIP") == "None"}


def test_k8s_ports_policy_and_engine_agree():
    gateway = _named("Deployment", "gateway")
    (gw,) = gateway["spec"]["template"]["spec"]["containers"]
    gw_argv = _command_line(gw["command"], gw["args"])
    assert int(_flag(gw_argv, "--port")) == gw["ports"][0]["containerPort"]
    # the replicas share budgets and limits through the redis Service
    redis = urlsplit(_flag(gw_argv, "--redis-url"))
    assert "--workers" not in gw_argv  # one process per pod: Prometheus scrapes every process
    redis_svc = _named("Service", redis.hostname.split(".")[0])
    assert (redis.port or 6379) in {p["port"] for p in redis_svc["spec"]["ports"]}
    # the policy file is the ConfigMap mounted where --policy says
    mount = next(m for m in gw["volumeMounts"] if _flag(gw_argv, "--policy").startswith(m["mountPath"] + "/"))
    volume = next(v for v in gateway["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    config = _named("ConfigMap", volume["configMap"]["name"])
    policy = parse_policy(config["data"][Path(_flag(gw_argv, "--policy")).name], "k8s/gateway.yaml ConfigMap")
    (eng,) = _named("StatefulSet", "engine")["spec"]["template"]["spec"]["containers"]
    eng_argv = _command_line(eng["command"], eng["args"])
    services = {s["metadata"]["name"]: s for s in _of_kind("Service")}
    engine = _named("StatefulSet", "engine")
    pods = services[engine["spec"]["serviceName"]]
    most = {_named("ScaledObject", "engine")["spec"]["maxReplicaCount"],
            _named("HorizontalPodAutoscaler", "engine")["spec"]["maxReplicas"]}
    for backend in (b for b in policy.backends.values() if b.kind == "engine"):
        # the fleet lists each replica the autoscalers may start, by its StatefulSet name, and no more
        bases = backend.api_bases or [backend.api_base]
        assert most == {len(bases)}, f"autoscalers' maximum {most} vs {len(bases)} replicas in api_bases"
        for i, base in enumerate(bases):
            url = urlsplit(base)
            assert url.hostname == f"engine-{i}.{pods['metadata']['name']}"
            assert url.port in {p["port"] for p in pods["spec"]["ports"]}
            assert url.port == int(_flag(eng_argv, "--port"))
        assert backend.model == _flag(eng_argv, "--served-model-name")
    # the secrets the pods read are the ones the Secret in gateway.yaml's header creates
    header = (K8S / "gateway.yaml").read_text().split("apiVersion")[0]
    for _, d in _k8s():
        if d["kind"] in ("Deployment", "StatefulSet", "Job"):
            for c in _containers(d):
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        assert ref["name"] == "switchyard" and f"--from-literal={ref['key']}=" in header


def test_a_bad_policy_in_the_configmap_would_be_caught():
    with pytest.raises(PolicyError, match="autoscale"):
        parse_policy("backends:\n  a: {kind: engine, model: m, api_base: 'http://e:1/v1', autoscale: {speed: 1}}\n"
                     "routes:\n  r: {strategy: fixed, backend: a}\n", "configmap")


def test_autoscalers_target_the_engine_and_read_real_metrics():
    exported = _exported_metrics()
    scaled = _named("ScaledObject", "engine")
    hpa = _named("HorizontalPodAutoscaler", "engine")
    for target in (scaled["spec"]["scaleTargetRef"], hpa["spec"]["scaleTargetRef"]):
        assert (target["kind"], target["name"]) == ("StatefulSet", "engine")
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "1"
    query = trigger["metadata"]["query"]
    assert _metric_names(query) == {"switchyard_backend_output_tokens_per_second",
                                    "switchyard_backend_replica_target_tokens_per_second"}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["external"]["metric"]["name"] in exported
    rules = yaml.safe_dump(_named("PrometheusRule", "switchyard"))
    named = _metric_names(query) | _metric_names(rules) | {metric["external"]["metric"]["name"]}
    unknown = sorted(n for n in named - FOREIGN_METRICS if n not in exported)
    assert not unknown, f"deploy/k8s reads metrics nothing exports: {unknown}"


def test_hpa_target_is_what_the_gateway_computes_for_the_policy():
    from gateway.demand import DemandTracker

    config = _named("ConfigMap", "switchyard-policy")
    policy = parse_policy(config["data"]["policy.yaml"], "k8s/gateway.yaml ConfigMap")
    hpa = _named("HorizontalPodAutoscaler", "engine")
    (metric,) = hpa["spec"]["metrics"]
    backend = metric["external"]["metric"]["selector"]["matchLabels"]["backend"]
    tracker = DemandTracker(export=False)
    tracker.observe(policy.backends[backend], 0, 0, 0.0)
    computed = tracker.replica_target_tokens_per_s(backend)
    assert float(metric["external"]["target"]["averageValue"]) == pytest.approx(computed, abs=0.05)
    assert f'backend="{backend}"' in _named("ScaledObject", "engine")["spec"]["triggers"][0]["metadata"]["query"]
