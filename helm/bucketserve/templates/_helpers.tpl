{{/* Names and labels. */}}
{{- define "bucketserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "bucketserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "bucketserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "bucketserve.labels" -}}
helm.sh/chart: {{ include "bucketserve.chart" . }}
app.kubernetes.io/name: {{ include "bucketserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Server pods only: the precompile Job's pods carry component=precompile, so no monitor or PDB picks them. */}}
{{- define "bucketserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "bucketserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: server
{{- end -}}

{{- define "bucketserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "bucketserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The precompile hook Job runs before the release's ServiceAccount exists: it gets a hook account of its own. */}}
{{- define "bucketserve.precompileServiceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- printf "%s-precompile" (include "bucketserve.serviceAccountName" .) | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- include "bucketserve.serviceAccountName" . -}}
{{- end -}}
{{- end -}}

{{- define "bucketserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "bucketserve.compileCacheClaim" -}}
{{- default (printf "%s-compile-cache" (include "bucketserve.fullname" .)) .Values.compileCache.existingClaim -}}
{{- end -}}

{{/* True when the compile cache outlives pods (a claim, created or existing). */}}
{{- define "bucketserve.cachePersistent" -}}
{{- if or .Values.compileCache.existingClaim .Values.compileCache.persistence.enabled -}}true{{- end -}}
{{- end -}}

{{/*
One value as the server parses it from its environment: numbers without a fraction print as integers (YAML and
JSON numbers arrive as float64, which would otherwise print as 1.048576e+06), lists join with commas (the
server's parse_sizes), booleans print as true/false.
*/}}
{{- define "bucketserve.scalar" -}}
{{- if kindIs "bool" . -}}
{{- ternary "true" "false" . -}}
{{- else if or (kindIs "float64" .) (kindIs "float32" .) -}}
{{- if eq (floor .) (float64 .) -}}{{- int64 . -}}{{- else -}}{{- . -}}{{- end -}}
{{- else if kindIs "invalid" . -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{- define "bucketserve.envValue" -}}
{{- if kindIs "slice" . -}}
{{- $parts := list -}}
{{- range . -}}{{- $parts = append $parts (include "bucketserve.scalar" .) -}}{{- end -}}
{{- join "," $parts -}}
{{- else -}}
{{- include "bucketserve.scalar" . -}}
{{- end -}}
{{- end -}}

{{/*
The server's settings as a map of ServerSettings field names in camelCase: values.server plus the three the chart
owns. Every entry becomes BUCKETSERVE_<UPPER_SNAKE_CASE>: one mechanical rule, so no setting can be dropped.
*/}}
{{- define "bucketserve.settings" -}}
{{- $settings := deepCopy .Values.server -}}
{{- $_ := set $settings "host" "0.0.0.0" -}}
{{- $_ := set $settings "compileCacheDir" .Values.compileCache.mountPath -}}
{{- toJson $settings -}}
{{- end -}}

{{- define "bucketserve.env" -}}
{{- $settings := include "bucketserve.settings" . | fromJson -}}
{{- range $key, $value := $settings }}
- name: {{ printf "BUCKETSERVE_%s" ($key | snakecase | upper) }}
  value: {{ include "bucketserve.envValue" $value | quote }}
{{- end }}
{{- if .Values.apiKeys.existingSecret }}
- name: BUCKETSERVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKeys.existingSecret }}
      key: {{ .Values.apiKeys.secretKey }}
{{- end }}
# TorchNeuron's own NEFF cache lives in the same volume as the server's graph cache
- name: TORCH_NEURONX_NEFF_CACHE_DIR
  value: {{ .Values.compileCache.mountPath | quote }}
# the root filesystem is read-only; libraries that cache under ~ write to the /tmp emptyDir
- name: HOME
  value: /tmp
- name: PYTHONUNBUFFERED
  value: "1"
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Neuron units requested: one NeuronCore per tensor-parallel rank, else neuron.count. */}}
{{- define "bucketserve.neuronCount" -}}
{{- $tp := int64 .Values.server.tensorParallelSize -}}
{{- if gt $tp 1 -}}{{- $tp -}}{{- else -}}{{- int64 .Values.neuron.count -}}{{- end -}}
{{- end -}}

{{/* requests/limits with the Neuron resource added to both (extended resources cannot be overcommitted). */}}
{{- define "bucketserve.containerResources" -}}
{{- $root := index . 0 -}}
{{- $base := index . 1 -}}
{{- $requests := deepCopy (default dict $base.requests) -}}
{{- $limits := deepCopy (default dict $base.limits) -}}
{{- if $root.Values.neuron.enabled -}}
{{- $count := include "bucketserve.neuronCount" $root | int64 -}}
{{- $_ := set $requests $root.Values.neuron.resourceName $count -}}
{{- $_ := set $limits $root.Values.neuron.resourceName $count -}}
{{- end -}}
{{- $out := dict -}}
{{- if $requests -}}{{- $_ := set $out "requests" $requests -}}{{- end -}}
{{- if $limits -}}{{- $_ := set $out "limits" $limits -}}{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{- define "bucketserve.volumeMounts" -}}
- name: compile-cache
  mountPath: {{ .Values.compileCache.mountPath }}
- name: models
  mountPath: {{ .Values.models.mountPath }}
  readOnly: {{ and (not (empty .Values.models.existingClaim)) .Values.models.readOnly }}
- name: tmp
  mountPath: /tmp
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "bucketserve.volumes" -}}
- name: compile-cache
{{- if include "bucketserve.cachePersistent" . }}
  persistentVolumeClaim:
    claimName: {{ include "bucketserve.compileCacheClaim" . }}
{{- else }}
  emptyDir: {}
{{- end }}
- name: models
{{- if .Values.models.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.models.existingClaim }}
    readOnly: {{ .Values.models.readOnly }}
{{- else }}
  emptyDir: {}
{{- end }}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmp.sizeLimit }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Placement shared by the server pods and the precompile Job: both need a Neuron device. */}}
{{- define "bucketserve.scheduling" -}}
{{- with .Values.schedulerName }}
schedulerName: {{ . }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $tolerations := list -}}
{{- if and .Values.neuron.enabled .Values.neuron.tolerateTaint -}}
{{- $tolerations = append $tolerations (dict "key" "aws.amazon.com/neuron" "operator" "Exists" "effect" "NoSchedule") -}}
{{- end -}}
{{- $tolerations = concat $tolerations .Values.tolerations -}}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
automountServiceAccountToken: false
# Service links would inject <SERVICE>_PORT=tcp://... variables; a Service named "bucketserve" would then set
# BUCKETSERVE_PORT and collide with the server's own settings.
enableServiceLinks: false
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}

{{/* An IntOrString field: bare digits stay a number, anything else (e.g. "50%") is quoted. */}}
{{- define "bucketserve.intOrString" -}}
{{- if regexMatch "^[0-9]+$" . -}}{{- . -}}{{- else -}}{{- . | quote -}}{{- end -}}
{{- end -}}

{{/* Bearer-token authorization for a monitor endpoint when /metrics needs an API key. */}}
{{- define "bucketserve.monitorAuthorization" -}}
{{- if .Values.server.protectMetrics }}
authorization:
  type: Bearer
  credentials:
    name: {{ .Values.metrics.authorization.secretName }}
    key: {{ .Values.metrics.authorization.secretKey }}
{{- end }}
{{- end -}}
