"""The chart lints, and every value set renders to manifests that validate strictly against the Kubernetes schema
(CRDs by shape), with the security, probe, cache and placement properties the deployment relies on."""

from __future__ import annotations

from typing import Any

import pytest
from chart_support import CHART_DIR, NAMESPACE, RELEASE, SCENARIOS, Manifest, Render, container, deep_merge, one

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

# the oldest release the chart declares it supports (Chart.yaml kubeVersion) and a current one
KUBE_VERSIONS = ("1.25.0", "1.33.0")
BUILTIN_KINDS = {"Deployment", "Service", "ServiceAccount", "PersistentVolumeClaim", "Job",
                 "HorizontalPodAutoscaler", "PodDisruptionBudget", "ConfigMap"}
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "ScaledObject"}
SELECTOR = {"app.kubernetes.io/name": "bucketserve", "app.kubernetes.io/instance": RELEASE,
            "app.kubernetes.io/component": "server"}


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def scenario(request: pytest.FixtureRequest, render: Render, default_values: dict[str, Any]
             ) -> tuple[str, dict[str, Any], list[Manifest]]:
    overrides = SCENARIOS[request.param]
    return request.param, deep_merge(default_values, overrides), render(overrides)


def test_lint_is_clean(helm: Any) -> None:
    for name, overrides in SCENARIOS.items():
        report = helm.lint(CHART_DIR, overrides, strict=True, namespace=NAMESPACE)
        assert report["errors"] == [], (name, report)
        # severity 2 = warning, 3 = error; info (1) such as "icon is recommended" is fine
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], (name, report)


def test_manifests_validate_strictly(scenario: tuple[str, dict[str, Any], list[Manifest]]) -> None:
    name, _, manifests = scenario
    kinds = {m["kind"] for m in manifests}
    assert kinds <= BUILTIN_KINDS | CRD_KINDS, f"{name}: unexpected kinds {kinds - BUILTIN_KINDS - CRD_KINDS}"
    for manifest in manifests:
        if manifest["kind"] in CRD_KINDS:
            continue  # no schema bundled for CRDs: checked by hand below
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(manifest, version, strict=True)


def test_strict_validation_catches_a_misplaced_field(render: Render) -> None:
    """Guards the guard: an unknown field in a rendered Deployment must fail kubernetes-validate."""
    deployment = one(render(), "Deployment")
    container(deployment)["startupProbes"] = container(deployment).pop("startupProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[-1], strict=True)


def test_optional_objects_follow_values(scenario: tuple[str, dict[str, Any], list[Manifest]]) -> None:
    name, values, manifests = scenario
    kinds = [m["kind"] for m in manifests]
    autoscaling = values["autoscaling"]
    expected = {
        "HorizontalPodAutoscaler": autoscaling["enabled"] and autoscaling["mode"] == "hpa",
        "ScaledObject": autoscaling["enabled"] and autoscaling["mode"] == "keda",
        "ServiceMonitor": values["metrics"]["serviceMonitor"]["enabled"],
        "PodMonitor": values["metrics"]["podMonitor"]["enabled"],
        "Job": values["precompile"]["enabled"],
        "ConfigMap": values["dashboard"]["enabled"],
        "PodDisruptionBudget": values["podDisruptionBudget"]["enabled"],
        "ServiceAccount": int(values["serviceAccount"]["create"])
        * (1 + int(values["precompile"]["enabled"])),
        "PersistentVolumeClaim": values["compileCache"]["persistence"]["enabled"]
        and not values["compileCache"]["existingClaim"],
    }
    for kind, present in expected.items():
        assert kinds.count(kind) == int(present), f"{name}: {kind} count {kinds.count(kind)}"
    assert kinds.count("Deployment") == 1 and kinds.count("Service") == 1
    deployment = one(manifests, "Deployment")
    assert ("replicas" in deployment["spec"]) == (not autoscaling["enabled"]), "autoscalers own the replica count"


def test_pod_security(scenario: tuple[str, dict[str, Any], list[Manifest]]) -> None:
    _, _, manifests = scenario
    for workload in [m for m in manifests if m["kind"] in ("Deployment", "Job")]:
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["automountServiceAccountToken"] is False
        assert pod["enableServiceLinks"] is False, "service links would inject BUCKETSERVE_PORT=tcp://..."
        sc = container(workload)["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert sc["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"]: m["name"] for m in container(workload)["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]], "a read-only root filesystem needs a writable /tmp"


def test_probes_and_shutdown(scenario: tuple[str, dict[str, Any], list[Manifest]]) -> None:
    _, values, manifests = scenario
    deployment = one(manifests, "Deployment")
    c = container(deployment)
    assert c["startupProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    startup = c["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= values["warmup"]["expectedSeconds"]
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep" and int(pre_stop[1]) == values["preStopSleepSeconds"]
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > int(pre_stop[1]) + values["server"]["drainTimeout"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": values["server"]["port"]}
    assert c["command"] == ["bucketserve", "serve"]


def test_compile_cache_is_where_both_caches_point(scenario: tuple[str, dict[str, Any], list[Manifest]]) -> None:
    name, values, manifests = scenario
    cache = values["compileCache"]
    for workload in [m for m in manifests if m["kind"] in ("Deployment", "Job")]:
        c = container(workload)
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["BUCKETSERVE_COMPILE_CACHE_DIR"] == env["TORCH_NEURONX_NEFF_CACHE_DIR"] == cache["mountPath"]
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == cache["mountPath"])
        assert not mount.get("readOnly", False)
        volume = next(v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
        if cache["existingClaim"]:
            assert volume["persistentVolumeClaim"]["claimName"] == cache["existingClaim"]
        elif cache["persistence"]["enabled"]:
            claim = one(manifests, "PersistentVolumeClaim")
            assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
            annotations = claim["metadata"]["annotations"]
            assert annotations["helm.sh/resource-policy"] == "keep"
            assert annotations["helm.sh/hook"] == "pre-install", f"{name}: the precompile hook needs the claim first"
            assert claim["spec"]["accessModes"] == cache["persistence"]["accessModes"]
        else:
            assert "emptyDir" in volume


def test_neuron_placement(scenario: tuple[str, dict[str, Any], list[Manifest]]) -> None:
    _, values, manifests = scenario
    neuron = values["neuron"]
    for workload in [m for m in manifests if m["kind"] in ("Deployment", "Job")]:
        pod = workload["spec"]["template"]["spec"]
        resources = container(workload)["resources"]
        toleration = {"key": "aws.amazon.com/neuron", "operator": "Exists", "effect": "NoSchedule"}
        # one NeuronCore per tensor-parallel rank, else neuron.count
        tp = values["server"]["tensorParallelSize"]
        count = tp if tp > 1 else neuron["count"]
        if neuron["enabled"]:
            assert resources["limits"][neuron["resourceName"]] == count
            assert resources["requests"][neuron["resourceName"]] == count
            assert toleration in pod["tolerations"]
        else:
            assert not any(k.startswith("aws.amazon.com/") for k in resources.get("limits", {}))
            assert toleration not in pod.get("tolerations", [])
        for extra in values["tolerations"]:
            assert extra in pod["tolerations"]
        assert pod.get("schedulerName", "") == values["schedulerName"]
        assert pod.get("nodeSelector", {}) == values["nodeSelector"]
        assert pod.get("affinity", {}) == values["affinity"]


@pytest.mark.parametrize("name", ["precompile", "everything"])
def test_precompile_job_is_a_pre_rollout_hook_with_the_server_settings(render: Render, name: str) -> None:
    manifests = render(SCENARIOS[name])
    job, deployment = one(manifests, "Job"), one(manifests, "Deployment")
    annotations = job["metadata"]["annotations"]
    assert set(annotations["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
    assert int(annotations["helm.sh/hook-weight"]) > -10, "after the compile-cache claim hook"
    assert container(job)["command"] == ["bucketserve", "precompile"]
    assert container(job)["env"] == container(deployment)["env"]
    assert container(job)["volumeMounts"] == container(deployment)["volumeMounts"]
    job_pod, server_pod = job["spec"]["template"]["spec"], deployment["spec"]["template"]["spec"]
    assert job_pod["volumes"] == server_pod["volumes"]
    assert job_pod["tolerations"] == server_pod["tolerations"]
    assert job_pod["restartPolicy"] == "Never"
    assert job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "precompile"


def test_precompile_job_can_verify_before_rollout(render: Render) -> None:
    job = one(render({"precompile": {"enabled": True, "verify": {"enabled": True, "minAgreement": 0.9}}}), "Job")
    assert container(job)["command"] == [
        "sh", "-c", "bucketserve precompile && bucketserve verify --min-agreement 0.9 --max-tokens 16 --out /tmp/verify"]


def hook_phase(manifest: Manifest) -> tuple[set[str], int] | None:
    annotations = manifest["metadata"].get("annotations", {})
    if "helm.sh/hook" not in annotations:
        return None
    return set(annotations["helm.sh/hook"].split(",")), int(annotations.get("helm.sh/hook-weight", "0"))


@pytest.mark.parametrize("name", ["precompile", "everything", "existing-claim-precompile", "no-service-account"])
def test_precompile_job_finds_what_it_mounts_at_install(render: Render, name: str) -> None:
    """A pre-install hook runs before the release's ordinary objects exist: every chart-made object the Job
    uses must itself be a pre-install hook with a lower weight (or come from outside the chart)."""
    extra = {"existing-claim-precompile": {**SCENARIOS["existing-claim"], "precompile": {"enabled": True}},
             "no-service-account": {"precompile": {"enabled": True},
                                    "serviceAccount": {"create": False, "name": "llm-reader"}}}
    manifests = render(SCENARIOS.get(name) or extra[name])
    job = one(manifests, "Job")
    job_hooks, job_weight = hook_phase(job) or (set(), 0)
    assert "pre-install" in job_hooks
    pod = job["spec"]["template"]["spec"]
    used = {("ServiceAccount", pod["serviceAccountName"])}
    used |= {("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"])
             for v in pod["volumes"] if "persistentVolumeClaim" in v}
    made = {(m["kind"], m["metadata"]["name"]): m for m in manifests}
    for key in used:
        if key not in made:
            continue  # an existing claim or account, there before the release
        phase = hook_phase(made[key])
        assert phase is not None, f"{key} is an ordinary release object: it does not exist yet when the Job runs"
        hooks, weight = phase
        assert "pre-install" in hooks and weight < job_weight, key


def test_service_and_pdb_select_only_server_pods(scenario: tuple[str, dict[str, Any], list[Manifest]]) -> None:
    _, values, manifests = scenario
    deployment = one(manifests, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == SELECTOR
    service = one(manifests, "Service")
    assert service["spec"]["selector"] == SELECTOR
    assert service["spec"]["ports"] == [{"name": "http", "port": values["service"]["port"], "targetPort": "http",
                                         "protocol": "TCP"}]
    assert SELECTOR.items() <= pod_labels.items()
    for job in [m for m in manifests if m["kind"] == "Job"]:
        job_labels = job["spec"]["template"]["metadata"]["labels"]
        assert not SELECTOR.items() <= job_labels.items(), "the Service must not route to the precompile Job"
    if values["podDisruptionBudget"]["enabled"]:
        pdb = one(manifests, "PodDisruptionBudget")
        assert pdb["spec"]["selector"]["matchLabels"] == SELECTOR
        assert len({"minAvailable", "maxUnavailable"} & set(pdb["spec"])) == 1


def test_monitors_have_the_operator_shape(scenario: tuple[str, dict[str, Any], list[Manifest]]) -> None:
    _, values, manifests = scenario
    for monitor in [m for m in manifests if m["kind"] in ("ServiceMonitor", "PodMonitor")]:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
        spec = monitor["spec"]
        endpoints_key = "endpoints" if monitor["kind"] == "ServiceMonitor" else "podMetricsEndpoints"
        assert set(spec) == {"selector", "namespaceSelector", endpoints_key}
        assert spec["selector"] == {"matchLabels": SELECTOR}
        assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        (endpoint,) = spec[endpoints_key]
        assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
        settings = values["metrics"]["serviceMonitor" if monitor["kind"] == "ServiceMonitor" else "podMonitor"]
        assert endpoint["interval"] == settings["interval"]
        assert endpoint["scrapeTimeout"] == settings["scrapeTimeout"]
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "authorization"}
        if values["server"]["protectMetrics"]:
            auth = values["metrics"]["authorization"]
            assert endpoint["authorization"] == {"type": "Bearer", "credentials": {
                "name": auth["secretName"], "key": auth["secretKey"]}}
        for key, value in settings["labels"].items():
            assert monitor["metadata"]["labels"][key] == value


def test_scaled_object_has_the_keda_shape(scenario: tuple[str, dict[str, Any], list[Manifest]]) -> None:
    _, values, manifests = scenario
    for scaled in [m for m in manifests if m["kind"] == "ScaledObject"]:
        assert scaled["apiVersion"] == "keda.sh/v1alpha1"
        spec = scaled["spec"]
        assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval",
                             "cooldownPeriod", "advanced", "triggers"}
        deployment = one(manifests, "Deployment")
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                          "name": deployment["metadata"]["name"]}
        assert spec["minReplicaCount"] == values["autoscaling"]["minReplicas"]
        assert spec["maxReplicaCount"] == values["autoscaling"]["maxReplicas"]
        assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == values["autoscaling"]["behavior"]
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        metadata = trigger["metadata"]
        assert all(isinstance(v, str) for v in metadata.values()), "KEDA trigger metadata is a map of strings"
        assert "bucketserve_requests_waiting" in metadata["query"]
        assert "cpu" not in metadata["query"]
        assert float(metadata["threshold"]) == values["autoscaling"]["targetRequestsWaiting"]
        assert metadata["serverAddress"] == values["autoscaling"]["keda"]["serverAddress"]
        if not values["autoscaling"]["keda"]["query"]:
            assert f'namespace="{NAMESPACE}"' in metadata["query"]
            assert f'pod=~"{deployment["metadata"]["name"]}-.*"' in metadata["query"]


def test_hpa_scales_on_the_queue_not_cpu(render: Render) -> None:
    hpa = one(render(SCENARIOS["hpa"]), "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "bucketserve_requests_waiting"},
        "target": {"type": "AverageValue", "averageValue": "2.5"}}}]
    assert hpa["spec"]["minReplicas"] == 2 and hpa["spec"]["maxReplicas"] == 6
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300


def test_metrics_pod_annotations(render: Render) -> None:
    manifests = render(SCENARIOS["everything"])
    annotations = one(manifests, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"team": "llm", "prometheus.io/scrape": "true", "prometheus.io/port": "8000",
                           "prometheus.io/path": "/metrics"}
