"""values.schema.json accepts the chart's value sets and rejects bad ones (as does `helm template`); the template's
own checks (probe budget, grace period, cross-field rules) fail the render; and every ServerSettings field reaches
the container as the BUCKETSERVE_* variable the server reads, round-tripping to the same settings."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import fields
from typing import Any

import pytest
from chart_support import SCENARIOS, Render, container, deep_merge, env_values, one

from server.arguments import add_server_arguments, env_name, settings_from_args
from server.config import ServerSettings

jsonschema = pytest.importorskip("jsonschema", reason="pip install jsonschema")

# ServerSettings fields the chart sets itself instead of taking from values.server
CHART_OWNED = {"host", "compile_cache_dir", "api_keys"}
NOT_SETTINGS = {"extra"}  # the dataclass's free-form extension map, not a flag
# values.server defaults that deliberately differ from ServerSettings' (a Trainium deployment, JSON logs)
DEPLOYMENT_DEFAULTS = {"device": "neuron", "compile_backend": "neuron", "dtype": "bfloat16", "log_format": "json"}

# Schema-valid values that differ from every ServerSettings default, so each one proves its own wiring.
EVERY_SETTING_CHANGED: dict[str, Any] = {
    "model": "/models/llama", "servedModelName": "llama-1b", "port": 9000, "device": "cuda", "dtype": "bfloat16",
    "compileBackend": "eager", "buckets": [128, 256, 512], "batchSizes": [1, 2], "prefillBatchSizes": [1, 2],
    "kvBuckets": [256, 1024], "prefillChunkSize": 512,
    "maxModelLen": 1024, "bucketsFile": "/models/plan.json", "maxWaitingRequests": 7, "maxWaitingTokens": 9999,
    "recompilePolicy": "allow", "batching": "static", "inductorFreezing": True, "weightPrepack": False, "mixedSteps": False,
    "enablePrefixCaching": False,
    "nativeKernels": False, "cudaGraphs": True, "quantize": "int8",
    "requireCachedGraphs": True, "compileWorkers": 2,
    "numThreads": 3, "protectMetrics": True,
    "maxBodyBytes": 2_000_000, "requestTimeout": 12.5, "drainTimeout": 7.25, "logFormat": "json",
    "logPrompts": True, "lengthsFile": "/models/lengths.jsonl", "modelCacheDir": "/models/cache",
    "tensorParallelSize": 2, "tpTimeout": 30.5, "waitingServedRatio": 1.5, "maxStepTokens": 64, "numSpeculativeTokens": 2,
}

BAD_VALUES: dict[str, dict[str, Any]] = {
    "unknown server key": {"server": {"maxModelLength": 4096}},
    "snake_case server key": {"server": {"max_model_len": 4096}},
    "chart-owned setting": {"server": {"compileCacheDir": "/elsewhere"}},
    "bad device": {"server": {"device": "gpu"}},
    "zero max model len": {"server": {"maxModelLen": 0}},
    "empty batch sizes": {"server": {"batchSizes": []}},
    "bucket as string": {"server": {"buckets": [128, "256"]}},
    "negative drain": {"server": {"drainTimeout": -1}},
    "port out of range": {"server": {"port": 70000}},
    "zero tensor-parallel size": {"server": {"tensorParallelSize": 0}},
    "fractional tensor-parallel size": {"server": {"tensorParallelSize": 1.5}},
    "zero tp timeout": {"server": {"tpTimeout": 0}},
    "negative waiting-served ratio": {"server": {"waitingServedRatio": -1}},
    "max step tokens below -1": {"server": {"maxStepTokens": -2}},
    "speculative tokens above 8": {"server": {"numSpeculativeTokens": 9}},
    "gpu resource": {"neuron": {"resourceName": "nvidia.com/gpu"}},
    "cpu autoscaling": {"autoscaling": {"mode": "cpu"}},
    "zero probe period": {"probes": {"startup": {"periodSeconds": 0}}},
    "unknown top-level key": {"replicas": 3},
    "relative cache path": {"compileCache": {"mountPath": "var/cache"}},
    "bad pull policy": {"image": {"pullPolicy": "Sometimes"}},
    "interval without unit": {"metrics": {"serviceMonitor": {"interval": "15"}}},
    "pdb not a number": {"podDisruptionBudget": {"maxUnavailable": "half"}},
    "fractional replicas": {"replicaCount": 1.5},
    "bad access mode": {"compileCache": {"persistence": {"accessModes": ["ReadWriteSometimes"]}}},
}

# Schema-valid values the templates must refuse, with a fragment of the message that names the problem.
TEMPLATE_FAILURES: dict[str, tuple[dict[str, Any], str]] = {
    "grace below preStop + drain": (
        {"terminationGracePeriodSeconds": 40, "preStopSleepSeconds": 10, "server": {"drainTimeout": 30}},
        "terminationGracePeriodSeconds (40) must be larger"),
    "grace equal to preStop + rounded-up drain": (
        {"terminationGracePeriodSeconds": 60, "preStopSleepSeconds": 10, "server": {"drainTimeout": 49.5}},
        "terminationGracePeriodSeconds (60) must be larger"),
    "explicit startup budget below warm-up": (
        {"warmup": {"expectedSeconds": 3600}, "probes": {"startup": {"periodSeconds": 10, "failureThreshold": 300}}},
        "does not cover warmup.expectedSeconds (3600)"),
    "neuron device without the resource": ({"neuron": {"enabled": False}}, "neuron.enabled is false"),
    "tensor parallel on whole Neuron devices": (
        {"server": {"tensorParallelSize": 2}}, "server.tensorParallelSize 2 requests one NeuronCore per rank"),
    "neuron backend on cpu": (
        {"server": {"device": "cpu", "compileBackend": "neuron"}, "neuron": {"enabled": False}},
        "compileBackend neuron needs server.device neuron"),
    "both monitors": (
        {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}}, "scraped twice"),
    "protected metrics without scrape credentials": (
        {"server": {"protectMetrics": True}, "metrics": {"podMonitor": {"enabled": True}}},
        "metrics.authorization.secretName"),
    "min above max replicas": (
        {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}, "minReplicas (5) is larger"),
    "cached graphs required on an emptyDir": (
        {"server": {"requireCachedGraphs": True}, "compileCache": {"persistence": {"enabled": False}}},
        "needs a persistent compile cache"),
    "both disruption limits": ({"podDisruptionBudget": {"minAvailable": 1}}, "exactly one of minAvailable"),
    "setting bypassed through extraEnv": (
        {"extraEnv": [{"name": "BUCKETSERVE_MAX_MODEL_LEN", "value": "4096"}]},
        "extraEnv sets BUCKETSERVE_MAX_MODEL_LEN"),
}


def camel(field_name: str) -> str:
    head, *rest = field_name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def settings_fields() -> set[str]:
    return {f.name for f in fields(ServerSettings)} - NOT_SETTINGS


def validator(schema: dict[str, Any]) -> Any:
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


# --- the schema -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_schema_accepts_the_value_sets(name: str, default_values: dict[str, Any],
                                       values_schema: dict[str, Any]) -> None:
    validator(values_schema).validate(deep_merge(default_values, SCENARIOS[name]))


def test_schema_accepts_every_setting_changed(default_values: dict[str, Any], values_schema: dict[str, Any]) -> None:
    values = deep_merge(default_values, {"server": EVERY_SETTING_CHANGED, "neuron": {"enabled": False}})
    validator(values_schema).validate(values)


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_schema_rejects_bad_values(name: str, default_values: dict[str, Any], values_schema: dict[str, Any]) -> None:
    errors = list(validator(values_schema).iter_errors(deep_merge(default_values, BAD_VALUES[name])))
    assert errors, f"schema accepted {BAD_VALUES[name]}"


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_helm_rejects_bad_values(name: str, chart: Any, helm: Any) -> None:
    with pytest.raises(helm.HelmValuesError):
        chart.render(BAD_VALUES[name], name="rel", namespace="llm")


def test_schema_is_strict_where_the_chart_owns_the_shape(values_schema: dict[str, Any]) -> None:
    """Every object the chart defines forbids unknown keys; only Kubernetes pass-through objects are open."""
    passthrough = {"affinity", "podSecurityContext", "securityContext", "behavior", "requests", "limits",
                   "updateStrategy",
                   "nodeSelector", "podAnnotations", "podLabels", "annotations", "labels"}

    def walk(node: dict[str, Any], name: str) -> None:
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is False, f"{name} allows unknown keys"
        for key, child in node.get("properties", {}).items():
            if key not in passthrough:
                walk(child, key)

    walk(values_schema, "values")


# --- template checks ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(TEMPLATE_FAILURES))
def test_template_refuses_inconsistent_values(name: str, chart: Any, helm: Any, default_values: dict[str, Any],
                                              values_schema: dict[str, Any]) -> None:
    overrides, message = TEMPLATE_FAILURES[name]
    validator(values_schema).validate(deep_merge(default_values, overrides))  # the template is the only guard
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        chart.render(overrides, name="rel", namespace="llm")


@pytest.mark.parametrize("expected", [1, 601, 7200, 36000])
@pytest.mark.parametrize("period", [1, 7, 30])
@pytest.mark.parametrize("margin", [0, 25])
def test_computed_startup_budget_covers_the_warm_up(render: Render, expected: int, period: int, margin: int) -> None:
    values = {"warmup": {"expectedSeconds": expected, "marginPercent": margin},
              "probes": {"startup": {"periodSeconds": period, "failureThreshold": 0}}}
    probe = container(one(render(values), "Deployment"))["startupProbe"]
    budget = probe["failureThreshold"] * probe["periodSeconds"]
    wanted = expected * (100 + margin) // 100
    assert budget >= wanted
    assert budget < wanted + period, "one period of slack at most: a dead pod should not wait much longer"


def test_explicit_startup_threshold_is_kept_when_it_covers_the_warm_up(render: Render) -> None:
    values = {"warmup": {"expectedSeconds": 3000},
              "probes": {"startup": {"periodSeconds": 10, "failureThreshold": 300}}}
    assert container(one(render(values), "Deployment"))["startupProbe"]["failureThreshold"] == 300


@pytest.mark.parametrize(("pre_stop", "drain", "grace"), [(10, 30, 41), (0, 0.5, 2), (15, 45.5, 62), (5, 0, 6)])
def test_grace_period_just_above_pre_stop_plus_drain_renders(render: Render, pre_stop: int, drain: float,
                                                             grace: int) -> None:
    values = {"preStopSleepSeconds": pre_stop, "terminationGracePeriodSeconds": grace,
              "server": {"drainTimeout": drain}}
    pod = one(render(values), "Deployment")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == grace > pre_stop + math.ceil(drain)


# --- server settings -> container environment ---------------------------------------------------------------------

def test_values_server_keys_are_exactly_the_settings(default_values: dict[str, Any],
                                                     values_schema: dict[str, Any]) -> None:
    expected = {camel(name) for name in settings_fields() - CHART_OWNED}
    assert set(default_values["server"]) == expected
    assert set(values_schema["properties"]["server"]["properties"]) == expected


def test_schema_choices_match_the_server(values_schema: dict[str, Any]) -> None:
    """Every flag with fixed choices has the same enum in the schema, so helm refuses what the server would."""
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    properties = values_schema["properties"]["server"]["properties"]
    with_choices = [a for a in parser._actions if a.choices is not None]
    assert with_choices
    for action in with_choices:
        assert action.choices is not None
        assert set(properties[camel(action.dest)]["enum"]) == set(action.choices), action.dest


def test_values_server_defaults_match_the_server(default_values: dict[str, Any]) -> None:
    defaults = ServerSettings()
    for name in settings_fields() - CHART_OWNED:
        value = default_values["server"][camel(name)]
        expected = DEPLOYMENT_DEFAULTS.get(name, getattr(defaults, name))
        assert (tuple(value) if isinstance(value, list) else value) == expected, name


@pytest.mark.parametrize("name", ["defaults", "everything"])
def test_every_setting_reaches_the_container(render: Render, name: str) -> None:
    env = {e["name"] for e in container(one(render(SCENARIOS[name]), "Deployment"))["env"]}
    for field_name in settings_fields() - {"api_keys"}:
        assert env_name(field_name) in env, f"{field_name} does not reach the container"
    server_keys = {n for n in env if n.startswith("BUCKETSERVE_")}
    known = {env_name(f) for f in settings_fields() - {"api_keys"}}
    assert server_keys <= known | {"BUCKETSERVE_API_KEY"}, f"unknown settings {server_keys - known}"


def test_api_keys_come_from_the_secret(render: Render) -> None:
    env = container(one(render(SCENARIOS["service-monitor"]), "Deployment"))["env"]
    (entry,) = [e for e in env if e["name"] == env_name("api_key")]
    assert entry == {"name": "BUCKETSERVE_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": "bucketserve-keys", "key": "api-keys"}}}
    defaults = container(one(render(), "Deployment"))["env"]
    assert not [e for e in defaults if e["name"] == "BUCKETSERVE_API_KEY"], "no keys unless a Secret is named"


def server_settings_from_env(env: dict[str, str]) -> ServerSettings:
    """What `bucketserve serve` builds from this environment and no flags."""
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    return settings_from_args(parser.parse_args([]), environ=env)


def expected_settings(server_values: dict[str, Any], mount_path: str, api_keys: tuple[str, ...]) -> ServerSettings:
    kwargs: dict[str, Any] = {name: server_values[camel(name)] for name in settings_fields() - CHART_OWNED}
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    return ServerSettings(**kwargs, host="0.0.0.0", compile_cache_dir=mount_path, api_keys=api_keys)


@pytest.mark.parametrize("name", ["defaults", "everything"])
def test_settings_round_trip_through_the_environment(render: Render, default_values: dict[str, Any],
                                                     name: str) -> None:
    values = deep_merge(default_values, SCENARIOS[name])
    env = env_values(one(render(SCENARIOS[name]), "Deployment"))
    settings = server_settings_from_env(env)
    assert settings == expected_settings(values["server"], values["compileCache"]["mountPath"], ())


def test_every_setting_changed_round_trips(render: Render, default_values: dict[str, Any]) -> None:
    """Each key differs from its default, so a dropped, misnamed or mis-serialised key cannot pass unnoticed."""
    overrides = {"server": EVERY_SETTING_CHANGED, "neuron": {"enabled": False},
                 "apiKeys": {"existingSecret": "keys"}, "compileCache": {"mountPath": "/cache/neff"},
                 "metrics": {"podMonitor": {"enabled": False}}}
    deployment = one(render(overrides), "Deployment")
    env = env_values(deployment)
    env["BUCKETSERVE_API_KEY"] = "k1,k2"  # what the kubelet resolves from the Secret
    settings = server_settings_from_env(env)
    values = deep_merge(default_values, overrides)
    assert settings == expected_settings(values["server"], "/cache/neff", ("k1", "k2"))
    defaults = ServerSettings()
    unchanged = [n for n in settings_fields() if getattr(settings, n) == getattr(defaults, n)]
    assert unchanged == [], f"settings left at their defaults: {unchanged}"
    assert env["BUCKETSERVE_MAX_BODY_BYTES"] == "2000000", "integers must not print as 2e+06"
    assert env["BUCKETSERVE_BUCKETS"] == "128,256,512"
    assert env["BUCKETSERVE_REQUIRE_CACHED_GRAPHS"] == "true"
