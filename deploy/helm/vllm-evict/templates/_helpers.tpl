{{/* Names and labels ------------------------------------------------------------------------------ */}}

{{- define "vllm-evict.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "vllm-evict.fullname" -}}
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

{{- define "vllm-evict.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "vllm-evict.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vllm-evict.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "vllm-evict.labels" -}}
helm.sh/chart: {{ include "vllm-evict.chart" . }}
{{ include "vllm-evict.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: vllm-evict
{{- end }}

{{/* The eviction policy; unset (null) means "none": plain vLLM. */}}
{{- define "vllm-evict.policy" -}}
{{- .Values.eviction.policy | default "none" }}
{{- end }}

{{- define "vllm-evict.servedModelName" -}}
{{- default .Values.model.path .Values.model.servedModelName }}
{{- end }}

{{- define "vllm-evict.pvcName" -}}
{{- default (printf "%s-models" (include "vllm-evict.fullname" .)) .Values.model.pvc.existingClaimName }}
{{- end }}

{{/* The model volume comes from a claim unless an init container fills a pod-local emptyDir. */}}
{{- define "vllm-evict.modelOnClaim" -}}
{{- if or (eq .Values.model.source "pvc") .Values.model.initContainer.persistent }}true{{ end }}
{{- end }}

{{/* GPUs a container asks for: its nvidia.com/gpu limit, else its request, else 0. */}}
{{- define "vllm-evict.gpus" -}}
{{- $limits := .limits | default dict }}
{{- $requests := .requests | default dict }}
{{- int (index $limits "nvidia.com/gpu" | default (index $requests "nvidia.com/gpu") | default 0) }}
{{- end }}

{{/* The arguments of `vllm-evict serve` (the image's ENTRYPOINT), one YAML list item each. */}}
{{- define "vllm-evict.serverArgs" -}}
- {{ .Values.model.path | quote }}
- --served-model-name
- {{ include "vllm-evict.servedModelName" . | quote }}
- --host
- "0.0.0.0"
- --port
- {{ .Values.containerPort | int | quote }}
- --tensor-parallel-size
- {{ .Values.vllmConfig.tensorParallelSize | int | quote }}
{{- if .Values.ray.enabled }}
- --distributed-executor-backend
- ray
{{- end }}
{{- with .Values.vllmConfig.maxModelLen }}
- --max-model-len
- {{ . | int | quote }}
{{- end }}
{{- with .Values.vllmConfig.gpuMemoryUtilization }}
- --gpu-memory-utilization
- {{ . | toString | quote }}
{{- end }}
{{- if and .Values.vllmConfig.dtype (ne .Values.vllmConfig.dtype "auto") }}
- --dtype
- {{ .Values.vllmConfig.dtype | quote }}
{{- end }}
{{- if .Values.vllmConfig.enforceEager }}
- --enforce-eager
{{- end }}
{{- if ne (include "vllm-evict.policy" .) "none" }}
- --kv-eviction
- {{ include "vllm-evict.policy" . | quote }}
- --kv-budget
- {{ .Values.eviction.budget | int | quote }}
{{- if .Values.eviction.config }}
- --kv-eviction-config
- {{ .Values.eviction.config | toJson | quote }}
{{- end }}
{{- end }}
{{- range .Values.vllmConfig.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* Pod volumes shared by the server and the Ray workers: the model and /dev/shm. */}}
{{- define "vllm-evict.volumes" -}}
- name: models
{{- if include "vllm-evict.modelOnClaim" . }}
  persistentVolumeClaim:
    claimName: {{ include "vllm-evict.pvcName" . }}
{{- else }}
  emptyDir: {}
{{- end }}
- name: shm
  emptyDir:
    medium: Memory
    {{- with .Values.shmSize }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end }}

{{- define "vllm-evict.volumeMounts" -}}
- name: models
  mountPath: {{ .Values.model.mountPath }}
- name: shm
  mountPath: /dev/shm
{{- end }}

{{/* The init container that writes the model (model.source: initContainer). */}}
{{- define "vllm-evict.initContainers" -}}
{{- if eq .Values.model.source "initContainer" }}
{{- with .Values.model.initContainer }}
initContainers:
  - name: model
    image: {{ .image | quote }}
    imagePullPolicy: {{ $.Values.image.pullPolicy }}
    {{- with .command }}
    command:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with .args }}
    args:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    env:
      - name: MODEL_PATH
        value: {{ $.Values.model.path | quote }}
      {{- with .env }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    {{- with $.Values.securityContext }}
    securityContext:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with .resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    volumeMounts:
      - name: models
        mountPath: {{ $.Values.model.mountPath }}
{{- end }}
{{- end }}
{{- end }}

{{/* Pod-level settings shared by the server and the Ray workers. */}}
{{- define "vllm-evict.podSettings" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
{{- end }}

{{/* Checks across values that values.schema.json cannot express; each message says what to change. */}}
{{- define "vllm-evict.validate" -}}
{{- $mount := trimSuffix "/" .Values.model.mountPath }}
{{- if not (hasPrefix (printf "%s/" $mount) .Values.model.path) }}
{{- fail (printf "model.path %q is not under model.mountPath %q, where the model volume is mounted: put the model below it" .Values.model.path .Values.model.mountPath) }}
{{- end }}
{{- $managed := list "--model" "--host" "--port" "--served-model-name" "--tensor-parallel-size" "-tp" "--distributed-executor-backend" "--kv-eviction" "--kv-budget" "--kv-eviction-config" "--max-model-len" "--gpu-memory-utilization" "--dtype" "--enforce-eager" }}
{{- range .Values.vllmConfig.extraArgs }}
{{- $flag := first (splitList "=" .) }}
{{- if has $flag $managed }}
{{- fail (printf "vllmConfig.extraArgs must not contain %s: the chart sets it from its values (eviction.*, vllmConfig.*, model.*, containerPort, ray.enabled); set it there" $flag) }}
{{- end }}
{{- end }}
{{- $tp := int .Values.vllmConfig.tensorParallelSize }}
{{- $gpus := int (include "vllm-evict.gpus" .Values.resources) }}
{{- if .Values.ray.enabled }}
{{- if ne (int .Values.replicaCount) 1 }}
{{- fail (printf "ray.enabled needs replicaCount 1 (one Ray head runs the server), got %d" (int .Values.replicaCount)) }}
{{- end }}
{{- if lt $tp 2 }}
{{- fail "ray.enabled spreads tensor-parallel ranks over pods: set vllmConfig.tensorParallelSize to 2 or more (or turn ray.enabled off)" }}
{{- end }}
{{- $workerGpus := int (include "vllm-evict.gpus" (.Values.ray.workerResources | default .Values.resources)) }}
{{- $total := add $gpus (mul (int .Values.ray.workers) $workerGpus) }}
{{- if and (gt $total 0) (gt $tp $total) }}
{{- fail (printf "vllmConfig.tensorParallelSize %d needs %d GPUs, but the Ray cluster has %d (head %d + %d workers x %d): raise ray.workers or the nvidia.com/gpu resources" $tp $tp $total $gpus (int .Values.ray.workers) $workerGpus) }}
{{- end }}
{{- if and (include "vllm-evict.modelOnClaim" .) (not .Values.model.pvc.existingClaimName) (not (has "ReadOnlyMany" .Values.model.pvc.accessModes)) (not (has "ReadWriteMany" .Values.model.pvc.accessModes)) }}
{{- fail "ray.enabled: every Ray pod loads the model from model.path, so the model claim must be shared: set model.pvc.accessModes to [ReadOnlyMany] or [ReadWriteMany], use model.pvc.existingClaimName, or use model.source initContainer without persistent" }}
{{- end }}
{{- else if and (gt $gpus 0) (gt $tp $gpus) }}
{{- fail (printf "vllmConfig.tensorParallelSize %d needs %d GPUs in the pod, but resources ask for %d nvidia.com/gpu: raise it, or set ray.enabled to span pods" $tp $tp $gpus) }}
{{- end }}
{{- end }}
