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
{{- if .Values.plugin.install }}
- name: vllm-evict-plugin
  emptyDir: {}
{{- with .Values.plugin.wheelConfigMap }}
- name: vllm-evict-wheel
  configMap:
    name: {{ . }}
{{- end }}
{{- end }}
{{- if .Values.compileCache.enabled }}
- name: compile-cache
{{- if eq .Values.compileCache.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ include "vllm-evict.cachePvcName" . }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}
{{- end }}

{{- define "vllm-evict.volumeMounts" -}}
- name: models
  mountPath: {{ .Values.model.mountPath }}
- name: shm
  mountPath: /dev/shm
{{- if .Values.plugin.install }}
- name: vllm-evict-plugin
  mountPath: {{ .Values.plugin.path }}
  readOnly: true
{{- end }}
{{- if .Values.compileCache.enabled }}
- name: compile-cache
  mountPath: {{ .Values.compileCache.mountPath }}
{{- end }}
{{- end }}

{{/* What every container running vLLM adds to its environment: the package's folder on PYTHONPATH
(plugin.install) and the compile caches on their volume (compileCache). */}}
{{- define "vllm-evict.runtimeEnv" -}}
{{- if .Values.plugin.install }}
- name: PYTHONPATH
  value: {{ .Values.plugin.path | quote }}
{{- end }}
{{- if .Values.compileCache.enabled }}
{{- $root := trimSuffix "/" .Values.compileCache.mountPath }}
- name: XDG_CACHE_HOME
  value: {{ $root | quote }}
- name: TORCH_EXTENSIONS_DIR
  value: {{ printf "%s/torch_extensions" $root | quote }}
- name: TRITON_CACHE_DIR
  value: {{ printf "%s/triton" $root | quote }}
- name: VLLM_CACHE_ROOT
  value: {{ printf "%s/vllm" $root | quote }}
{{- end }}
{{- end }}

{{/* The server command: the image's `vllm-evict serve`, or the module of the package installed at pod start. */}}
{{- define "vllm-evict.serveCommand" -}}
{{- if .Values.plugin.install }}python3 -m vllm_evict serve{{ else }}vllm-evict serve{{ end }}
{{- end }}

{{- define "vllm-evict.cachePvcName" -}}
{{- default (printf "%s-compile-cache" (include "vllm-evict.fullname" .)) .Values.compileCache.pvc.existingClaimName }}
{{- end }}

{{/* Ray's token authentication (ray.auth): the Secret with the token, and what every Ray pod (head and
workers) adds to its env, volume mounts and volumes so that all of them present the same token. */}}
{{- define "vllm-evict.rayAuthSecret" -}}
{{- .Values.ray.auth.existingSecret | default (printf "%s-ray-auth" (include "vllm-evict.fullname" .)) }}
{{- end }}

{{- define "vllm-evict.rayAuthEnv" -}}
- name: RAY_AUTH_MODE
  value: {{ .Values.ray.auth.mode | quote }}
{{- if eq .Values.ray.auth.mode "token" }}
- name: RAY_AUTH_TOKEN_PATH
  value: /etc/vllm-evict/ray-auth/token
{{- end }}
{{- end }}

{{- define "vllm-evict.rayAuthMounts" -}}
{{- if eq .Values.ray.auth.mode "token" }}
- name: ray-auth
  mountPath: /etc/vllm-evict/ray-auth
  readOnly: true
{{- end }}
{{- end }}

{{- define "vllm-evict.rayAuthVolumes" -}}
{{- if eq .Values.ray.auth.mode "token" }}
- name: ray-auth
  secret:
    secretName: {{ include "vllm-evict.rayAuthSecret" . }}
    items:
      - key: {{ .Values.ray.auth.secretKey }}
        path: token
{{- end }}
{{- end }}

{{/* The init containers: the package's install into the plugin volume (plugin.install), then the model's
(model.source: initContainer). */}}
{{- define "vllm-evict.initContainers" -}}
{{- if or .Values.plugin.install (eq .Values.model.source "initContainer") }}
initContainers:
{{- end }}
{{- if .Values.plugin.install }}
  - name: vllm-evict-install
    image: "{{ .Values.image.repository }}:{{ .Values.image.tag }}"
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    # pip install into the plugin volume (no dependencies: vLLM's image has them), then import the plugin.
    command: ["sh", "-c"]
    args:
      - {{ printf "python3 -m pip install --no-cache-dir --no-deps --disable-pip-version-check --upgrade --target \"$VLLM_EVICT_SITE\" \"$@\"%s && PYTHONPATH=\"$VLLM_EVICT_SITE\" python3 -c 'import vllm_evict.plugin'" (ternary " /opt/vllm-evict/wheel/*.whl" "" (not (empty .Values.plugin.wheelConfigMap))) | quote }}
      - pip-install
      {{- range .Values.plugin.pipArgs }}
      - {{ . | quote }}
      {{- end }}
      {{- if not .Values.plugin.wheelConfigMap }}
      - {{ .Values.plugin.package | quote }}
      {{- end }}
    env:
      - name: VLLM_EVICT_SITE
        value: {{ .Values.plugin.path | quote }}
    {{- with $.Values.securityContext }}
    securityContext:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    volumeMounts:
      - name: vllm-evict-plugin
        mountPath: {{ .Values.plugin.path }}
      {{- if .Values.plugin.wheelConfigMap }}
      - name: vllm-evict-wheel
        mountPath: /opt/vllm-evict/wheel
        readOnly: true
      {{- end }}
{{- end }}
{{- if eq .Values.model.source "initContainer" }}
{{- with .Values.model.initContainer }}
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
{{- if and .Values.plugin.install (not .Values.plugin.wheelConfigMap) (not .Values.plugin.package) }}
{{- fail "plugin.install needs the package: set plugin.wheelConfigMap (a ConfigMap holding the wheel) or plugin.package (a wheel URL or a requirement your index serves)" }}
{{- end }}
{{- if and .Values.compileCache.enabled (eq .Values.compileCache.source "pvc") (not .Values.compileCache.pvc.existingClaimName) (not (has "ReadWriteMany" .Values.compileCache.pvc.accessModes)) (or .Values.ray.enabled (gt (int .Values.replicaCount) 1)) }}
{{- fail "compileCache.source pvc: several pods (replicas or Ray workers) mount the cache claim: set compileCache.pvc.accessModes to [ReadWriteMany], use compileCache.pvc.existingClaimName, or use source emptyDir" }}
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
