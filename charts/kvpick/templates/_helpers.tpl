{{/* Chart name, overridable with nameOverride. */}}
{{- define "kvpick.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified name for the objects: fullnameOverride, else the release name when it already
contains the chart name (`helm install kvpick ...` gives `kvpick`), else `<release>-<chart>`.
*/}}
{{- define "kvpick.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The config ConfigMap's name. */}}
{{- define "kvpick.configName" -}}
{{- printf "%s-config" (include "kvpick.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The InferencePool's name (pool mode). */}}
{{- define "kvpick.poolName" -}}
{{- required "pool.name is required with mode=pool" .Values.pool.name }}
{{- end }}

{{/* The namespace of the pool / pods kvpick watches: pool.namespace, else the release's. */}}
{{- define "kvpick.poolNamespace" -}}
{{- default .Release.Namespace .Values.pool.namespace }}
{{- end }}

{{/* `k=v,...` from pool.selector.matchLabels (selector mode's --endpoint-selector). */}}
{{- define "kvpick.endpointSelector" -}}
{{- $pairs := list }}
{{- range $k, $v := .Values.pool.selector.matchLabels }}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{/* `P,...` from pool.targetPorts (selector mode's --target-ports). */}}
{{- define "kvpick.targetPorts" -}}
{{- $ports := list }}
{{- range .Values.pool.targetPorts }}
{{- $ports = append $ports (toString (int .number)) }}
{{- end }}
{{- join "," $ports }}
{{- end }}

{{- define "kvpick.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select the pods (stable across upgrades). */}}
{{- define "kvpick.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpick.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: endpoint-picker
{{- end }}

{{/* Labels on every object. */}}
{{- define "kvpick.labels" -}}
helm.sh/chart: {{ include "kvpick.chart" . }}
{{ include "kvpick.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* "true" unless flowControl.watchCrds is false (empty then): watch the flow-policy CRDs. */}}
{{- define "kvpick.flowWatchCrds" -}}
{{- $v := (.Values.flowControl | default dict).watchCrds }}
{{- if not (and (kindIs "bool" $v) (not $v)) }}true{{- end }}
{{- end }}
