{{/* Names, labels and the derived settings shared by the templates. */}}

{{- define "sparsecast.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "sparsecast.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "sparsecast.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "sparsecast.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "sparsecast.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "sparsecast.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sparsecast
{{- end }}

{{/* Selector labels of one component: include "sparsecast.selectorLabels" (list . "trainer") */}}
{{- define "sparsecast.selectorLabels" -}}
{{- $root := index . 0 }}
app.kubernetes.io/name: {{ include "sparsecast.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "sparsecast.secretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-secrets" (include "sparsecast.fullname" .)) }}
{{- end }}

{{- define "sparsecast.image" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- end }}

{{- define "sparsecast.redisUrl" -}}
{{- if .Values.redis.bundled }}
{{- printf "redis://%s-redis:6379/0" (include "sparsecast.fullname" .) }}
{{- else }}
{{- required "redis.url is required when redis.bundled is false" .Values.redis.url }}
{{- end }}
{{- end }}

{{- define "sparsecast.registryUrl" -}}
{{- printf "http://%s-registry:%v" (include "sparsecast.fullname" .) .Values.registry.port }}
{{- end }}

{{- define "sparsecast.minioEndpoint" -}}
{{- printf "http://%s-minio:9000" (include "sparsecast.fullname" .) }}
{{- end }}

{{- define "sparsecast.storeUrl" -}}
{{- if .Values.minio.bundled }}
{{- printf "s3://%s/runs" .Values.minio.bucket }}
{{- else }}
{{- required "store.url is required when minio.bundled is false" .Values.store.url }}
{{- end }}
{{- end }}

{{/* Kept across upgrades: the value already in the release's Secret, else a new random one. */}}
{{- define "sparsecast.generated" -}}
{{- $root := index . 0 }}
{{- $key := index . 1 }}
{{- $existing := lookup "v1" "Secret" $root.Release.Namespace (printf "%s-secrets" (include "sparsecast.fullname" $root)) }}
{{- if and $existing (hasKey $existing.data $key) }}
{{- index $existing.data $key | b64dec }}
{{- else }}
{{- randAlphaNum 32 }}
{{- end }}
{{- end }}

{{/* HTTP probes of a sparsecast container: include "sparsecast.probes" (list port startupSeconds) */}}
{{- define "sparsecast.probes" -}}
{{- $port := index . 0 }}
{{- $startup := index . 1 }}
startupProbe:
  httpGet: {path: /healthz, port: {{ $port }}}
  periodSeconds: 5
  failureThreshold: {{ div $startup 5 }}
livenessProbe:
  httpGet: {path: /healthz, port: {{ $port }}}
  periodSeconds: 15
  timeoutSeconds: 5
  failureThreshold: 4
readinessProbe:
  httpGet: {path: /readyz, port: {{ $port }}}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
{{- end }}

{{/* Environment every sparsecast container gets: the ConfigMap, plus named keys of the Secret.
     include "sparsecast.env" (list . "SPARSECAST_API_TOKEN" "SPARSECAST_REDIS_URL") */}}
{{- define "sparsecast.env" -}}
{{- $root := index . 0 }}
envFrom:
  - configMapRef:
      name: {{ include "sparsecast.fullname" $root }}-config
env:
{{- range $key := rest . }}
  - name: {{ $key }}
    valueFrom:
      secretKeyRef:
        name: {{ include "sparsecast.secretName" $root }}
        key: {{ $key }}
{{- end }}
{{- end }}
