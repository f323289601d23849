{{/*
Cross-field checks that values.schema.json cannot express. Each failure names the values involved, so
`helm install` stops before anything reaches the cluster.
*/}}

{{/* The startup probe's failureThreshold: given, or computed to cover the expected warm-up plus a margin. */}}
{{- define "bucketserve.startupFailureThreshold" -}}
{{- $probe := .Values.probes.startup -}}
{{- $period := int64 $probe.periodSeconds -}}
{{- $expected := int64 .Values.warmup.expectedSeconds -}}
{{- if gt (int64 $probe.failureThreshold) 0 -}}
{{- int64 $probe.failureThreshold -}}
{{- else -}}
{{- $budget := div (mul $expected (add 100 (int64 .Values.warmup.marginPercent))) 100 -}}
{{- /* ceil(budget / period), and at least 1 */ -}}
{{- max 1 (div (add $budget (sub $period 1)) $period) -}}
{{- end -}}
{{- end -}}

{{/* drainTimeout may be fractional: the grace period has to cover it rounded up. */}}
{{- define "bucketserve.drainSeconds" -}}
{{- int64 (ceil (float64 .Values.server.drainTimeout)) -}}
{{- end -}}

{{- define "bucketserve.validate" -}}
{{- $v := .Values -}}

{{- $threshold := int64 (include "bucketserve.startupFailureThreshold" .) -}}
{{- $startupBudget := mul $threshold (int64 $v.probes.startup.periodSeconds) -}}
{{- if lt $startupBudget (int64 $v.warmup.expectedSeconds) -}}
{{- fail (printf "probes.startup: failureThreshold (%d) * periodSeconds (%d) = %ds does not cover warmup.expectedSeconds (%d); raise failureThreshold or set it to 0 to compute it" $threshold (int64 $v.probes.startup.periodSeconds) $startupBudget (int64 $v.warmup.expectedSeconds)) -}}
{{- end -}}

{{- $drain := int64 (include "bucketserve.drainSeconds" .) -}}
{{- $shutdown := add (int64 $v.preStopSleepSeconds) $drain -}}
{{- if le (int64 $v.terminationGracePeriodSeconds) $shutdown -}}
{{- fail (printf "terminationGracePeriodSeconds (%d) must be larger than preStopSleepSeconds (%d) + server.drainTimeout (%d) = %ds, or the kubelet kills the server mid-drain" (int64 $v.terminationGracePeriodSeconds) (int64 $v.preStopSleepSeconds) $drain $shutdown) -}}
{{- end -}}

{{- if and (eq $v.server.device "neuron") (not $v.neuron.enabled) -}}
{{- fail "server.device is neuron but neuron.enabled is false: the pod would get no Neuron device" -}}
{{- end -}}
{{- if and $v.neuron.enabled (gt (int64 $v.server.tensorParallelSize) 1) (ne $v.neuron.resourceName "aws.amazon.com/neuroncore") -}}
{{- fail (printf "server.tensorParallelSize %d requests one NeuronCore per rank: set neuron.resourceName to aws.amazon.com/neuroncore (got %s)" (int64 $v.server.tensorParallelSize) $v.neuron.resourceName) -}}
{{- end -}}
{{- if and (eq $v.server.compileBackend "neuron") (ne $v.server.device "neuron") -}}
{{- fail (printf "server.compileBackend neuron needs server.device neuron, got %s" $v.server.device) -}}
{{- end -}}

{{- if and $v.server.requireCachedGraphs (not (include "bucketserve.cachePersistent" .)) -}}
{{- fail "server.requireCachedGraphs needs a persistent compile cache: set compileCache.existingClaim or compileCache.persistence.enabled" -}}
{{- end -}}

{{- if and $v.metrics.serviceMonitor.enabled $v.metrics.podMonitor.enabled -}}
{{- fail "metrics.serviceMonitor and metrics.podMonitor are both enabled: every series would be scraped twice" -}}
{{- end -}}
{{- if and $v.server.protectMetrics (or $v.metrics.serviceMonitor.enabled $v.metrics.podMonitor.enabled) (not (and $v.metrics.authorization.secretName $v.metrics.authorization.secretKey)) -}}
{{- fail "server.protectMetrics is true: set metrics.authorization.secretName and secretKey so the monitor can scrape /metrics" -}}
{{- end -}}

{{- if and $v.autoscaling.enabled (gt (int64 $v.autoscaling.minReplicas) (int64 $v.autoscaling.maxReplicas)) -}}
{{- fail (printf "autoscaling.minReplicas (%d) is larger than autoscaling.maxReplicas (%d)" (int64 $v.autoscaling.minReplicas) (int64 $v.autoscaling.maxReplicas)) -}}
{{- end -}}

{{- if $v.podDisruptionBudget.enabled -}}
{{- $pdb := $v.podDisruptionBudget -}}
{{- if eq (hasKey $pdb "minAvailable") (hasKey $pdb "maxUnavailable") -}}
{{- fail "podDisruptionBudget: set exactly one of minAvailable and maxUnavailable (null the other)" -}}
{{- end -}}
{{- end -}}

{{- range $v.extraEnv -}}
{{- if or (hasPrefix "BUCKETSERVE_" .name) (eq .name "TORCH_NEURONX_NEFF_CACHE_DIR") -}}
{{- fail (printf "extraEnv sets %s, which the chart owns: use the matching key under server (or compileCache.mountPath)" .name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
