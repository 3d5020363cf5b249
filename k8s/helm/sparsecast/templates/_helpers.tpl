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

{{/* An image reference: repository, then the tag (default: the chart's appVersion with the
     flavour, e.g. 0.1.0-cpu), then the digest when given, which pins the image whatever the tag.
     include "sparsecast.imageRef" (list . .Values.image "cpu") */}}
{{- define "sparsecast.imageRef" -}}
{{- $root := index . 0 }}
{{- $image := index . 1 }}
{{- $tag := $image.tag | default (printf "%s-%s" $root.Chart.AppVersion (index . 2)) }}
{{- printf "%s:%s" $image.repository $tag }}
{{- with $image.digest }}@{{ . }}{{ end }}
{{- end }}

{{/* The CPU image (registry, CPU trainer and workers, helm test). */}}
{{- define "sparsecast.image" -}}
{{- include "sparsecast.imageRef" (list . .Values.image "cpu") }}
{{- end }}

{{/* The CPU or the CUDA image: include "sparsecast.imageFor" (list . gpu) */}}
{{- define "sparsecast.imageFor" -}}
{{- $root := index . 0 }}
{{- if index . 1 }}
{{- include "sparsecast.imageRef" (list $root $root.Values.cudaImage "cuda") }}
{{- else }}
{{- include "sparsecast.imageRef" (list $root $root.Values.image "cpu") }}
{{- end }}
{{- end }}

{{- define "sparsecast.registryUrl" -}}
{{- printf "http://%s-registry:%v" (include "sparsecast.fullname" .) .Values.registry.port }}
{{- end }}

{{- define "sparsecast.minioEndpoint" -}}
{{- printf "http://%s-minio:9000" (include "sparsecast.fullname" .) }}
{{- end }}

{{/* The store's plain options (ConfigMap): the bundled MinIO's, else store.options. */}}
{{- define "sparsecast.storeOptions" -}}
{{- if .Values.minio.bundled }}
{{- dict "endpoint" (include "sparsecast.minioEndpoint" .) "region" "us-east-1" "allow_http" "true" | toYaml }}
{{- else }}
{{- .Values.store.options | default dict | toYaml }}
{{- end }}
{{- end }}

{{/* Secret keys the registry reads: the store's credential options. */}}
{{- define "sparsecast.storeSecretKeys" -}}
{{- if .Values.minio.bundled }}
{{- list "SPARSECAST_STORE_OPTIONS__ACCESS_KEY_ID" "SPARSECAST_STORE_OPTIONS__SECRET_ACCESS_KEY" | toJson }}
{{- else }}
{{- $keys := list }}
{{- range $key, $_ := .Values.store.secretOptions }}
{{- $keys = append $keys (printf "SPARSECAST_STORE_OPTIONS__%s" (upper $key)) }}
{{- end }}
{{- $keys | toJson }}
{{- end }}
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

{{/* Environment every sparsecast container gets: the ConfigMap, plus named keys of the Secret,
     each as the variable of that name or as "VARIABLE=KEY".
     include "sparsecast.env" (list . "SPARSECAST_REDIS_URL" "SPARSECAST_API_TOKEN=ROLLOUT_API_TOKEN") */}}
{{- define "sparsecast.env" -}}
{{- $root := index . 0 }}
envFrom:
  - configMapRef:
      name: {{ include "sparsecast.fullname" $root }}-config
env:
{{- range $entry := rest . }}
{{- $parts := splitList "=" $entry }}
  - name: {{ first $parts }}
    valueFrom:
      secretKeyRef:
        name: {{ include "sparsecast.secretName" $root }}
        key: {{ last $parts }}
{{- end }}
{{- end }}

{{/* The writable paths besides /data under a read-only root filesystem: /tmp as an emptyDir.
     volumeMounts entry and volumes entry. */}}
{{- define "sparsecast.tmpMount" -}}
- name: tmp
  mountPath: /tmp
{{- end }}
{{- define "sparsecast.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
{{- end }}

{{/* OMP_NUM_THREADS from a container's CPU limit ("2", 2, "1500m"): whole cores, at least 1;
     empty without a CPU limit. include "sparsecast.ompThreads" .Values.trainer.resources */}}
{{- define "sparsecast.ompThreads" -}}
{{- $cpu := (.limits | default dict).cpu }}
{{- if $cpu }}
{{- $text := toString $cpu }}
{{- if hasSuffix "m" $text }}
{{- max 1 (div (trimSuffix "m" $text | atoi) 1000) }}
{{- else }}
{{- max 1 (int (float64 $text)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Pod annotations of a sparsecast service: restart on a changed ConfigMap or token Secret, and
     Prometheus scrape hints. include "sparsecast.podAnnotations" (list . port) */}}
{{- define "sparsecast.podAnnotations" -}}
{{- $root := index . 0 }}
checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
{{- if not $root.Values.auth.existingSecret }}
{{- /* The values the Secret is made of, not the rendered Secret: generated entries are random
       in every render until the release exists (lookup), and kept across upgrades after. */}}
{{- $v := $root.Values }}
{{- $inputs := list $v.auth $v.minio.rootUser $v.minio.rootPassword $v.redis.url $v.redis.password $v.store.secretOptions }}
checksum/secret: {{ $inputs | toJson | sha256sum }}
{{- end }}
{{- if $root.Values.metrics.scrapeAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ index . 1 | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{/* The trainer's model folder when model.source provisions one, else trainer.model. */}}
{{- define "sparsecast.trainerModel" -}}
{{- $source := .Values.model.source }}
{{- if eq $source "volume" }}
{{- printf "/models/%s" .Values.model.subPath | trimSuffix "/" }}
{{- else if $source }}
{{- print "/models/current" }}
{{- else }}
{{- .Values.trainer.model }}
{{- end }}
{{- end }}

{{/* A component's extraEnv, with OMP_NUM_THREADS from its CPU limit unless extraEnv gives it.
     include "sparsecast.threadsEnv" .Values.trainer */}}
{{- define "sparsecast.threadsEnv" -}}
{{- $threads := include "sparsecast.ompThreads" .resources }}
{{- $extra := .extraEnv | default list }}
{{- $given := false }}
{{- range $extra }}{{ if eq .name "OMP_NUM_THREADS" }}{{ $given = true }}{{ end }}{{ end }}
{{- if and $threads (not $given) }}
- name: OMP_NUM_THREADS
  value: {{ $threads | quote }}
{{- end }}
{{- with $extra }}
{{ toYaml . }}
{{- end }}
{{- end }}
