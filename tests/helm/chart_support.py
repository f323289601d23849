"""Helpers for the Helm chart tests: parsing rendered manifests strictly, Helm's values coalescing, and picking
workloads apart. Imported by the test modules as `chart_support` (tests/helm is on sys.path under pytest)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "bucketserve"
RELEASE = "rel"
NAMESPACE = "llm"

Manifest = dict[str, Any]
Render = Callable[..., list[Manifest]]


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys, which kubectl and the API server also reject."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def parse_manifests(rendered: dict[str, str]) -> list[Manifest]:
    """Every non-empty YAML document of the rendered templates (NOTES.txt is not a manifest)."""
    docs: list[Manifest] = []
    for path in sorted(rendered):
        if not path.endswith(".yaml"):
            continue
        for doc in yaml.load_all(rendered[path], Loader=_StrictLoader):
            if doc:
                assert isinstance(doc, dict), f"{path}: a manifest must be a mapping"
                docs.append(doc)
    return docs


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's coalescing of user values over chart defaults: maps merge, a null deletes the key."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def one(manifests: list[Manifest], kind: str) -> Manifest:
    found = [m for m in manifests if m["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def container(workload: Manifest) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    result: dict[str, Any] = containers[0]
    return result


def env_values(workload: Manifest) -> dict[str, str]:
    """Plain `value:` environment entries of the workload's container."""
    return {e["name"]: e["value"] for e in container(workload)["env"] if "value" in e}


# Value sets the chart must render and validate: one per optional feature, plus everything at once.
SCENARIOS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "hpa": {"autoscaling": {"enabled": True, "mode": "hpa", "minReplicas": 2, "maxReplicas": 6,
                            "targetRequestsWaiting": 2.5}},
    "keda": {"autoscaling": {"enabled": True, "mode": "keda", "maxReplicas": 3}},
    "service-monitor": {
        "server": {"protectMetrics": True},
        "apiKeys": {"existingSecret": "bucketserve-keys"},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
                    "authorization": {"secretName": "bucketserve-scrape", "secretKey": "token"}},
    },
    "pod-monitor": {"metrics": {"podMonitor": {"enabled": True, "interval": "30s", "scrapeTimeout": "20s"}}},
    "neuroncore": {"neuron": {"resourceName": "aws.amazon.com/neuroncore", "count": 2}},
    "tensor-parallel": {"server": {"tensorParallelSize": 4}, "neuron": {"resourceName": "aws.amazon.com/neuroncore"}},
    "existing-claim": {"compileCache": {"existingClaim": "neff-cache"},
                       "models": {"existingClaim": "checkpoints", "readOnly": True},
                       "server": {"model": "/models/Llama-3.2-1B-Instruct", "requireCachedGraphs": True}},
    "precompile": {"precompile": {"enabled": True, "resources": {"requests": {"cpu": "8", "memory": "32Gi"},
                                                                 "limits": {"memory": "64Gi"}}}},
    "dashboard": {"dashboard": {"enabled": True, "namespace": "monitoring",
                                "annotations": {"grafana_folder": "LLM"}}},
    "cpu": {"server": {"device": "cpu", "compileBackend": "eager", "dtype": "float32"},
            "neuron": {"enabled": False}, "compileCache": {"persistence": {"enabled": False}},
            "podDisruptionBudget": {"enabled": False}, "serviceAccount": {"create": False}},
    "everything": {
        "replicaCount": 2,
        "image": {"repository": "123456789012.dkr.ecr.us-east-2.amazonaws.com/bucketserve", "tag": "0.1.0-neuron",
                  "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "ecr"}],
        "server": {"model": "/models/llama", "buckets": [128, 256, 512, 1024], "batchSizes": [1, 4, 16],
                   "maxModelLen": 4096, "drainTimeout": 45.5, "requestTimeout": 120, "recompilePolicy": "allow"},
        "warmup": {"expectedSeconds": 5400, "marginPercent": 10},
        "preStopSleepSeconds": 15,
        "terminationGracePeriodSeconds": 90,
        "schedulerName": "my-scheduler",
        "nodeSelector": {"node.kubernetes.io/instance-type": "trn2.48xlarge"},
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname", "labelSelector": {
                "matchLabels": {"app.kubernetes.io/name": "bucketserve"}}}}]}},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "bucketserve"}}}],
        "priorityClassName": "llm-serving",
        "podAnnotations": {"team": "llm"},
        "podLabels": {"cost-center": "research"},
        "serviceAccount": {"name": "bucketserve-sa",
                           "annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/x"}},
        "compileCache": {"persistence": {"storageClassName": "efs-sc", "accessModes": ["ReadWriteMany"],
                                         "size": "200Gi"}},
        "precompile": {"enabled": True},
        "service": {"type": "LoadBalancer", "port": 8080, "annotations": {"a": "b"}},
        "metrics": {"podAnnotations": True, "serviceMonitor": {"enabled": True}},
        "autoscaling": {"enabled": True, "mode": "keda",
                        "keda": {"query": "sum(bucketserve_requests_waiting{job=\"llm\"})"}},
        "podDisruptionBudget": {"maxUnavailable": None, "minAvailable": "50%"},
        "dashboard": {"enabled": True},
        "extraEnv": [{"name": "NEURON_RT_LOG_LEVEL", "value": "WARNING"}],
        "extraVolumes": [{"name": "plans", "configMap": {"name": "bucket-plans"}}],
        "extraVolumeMounts": [{"name": "plans", "mountPath": "/etc/bucketserve", "readOnly": True}],
    },
}
