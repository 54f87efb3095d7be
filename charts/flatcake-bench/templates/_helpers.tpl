{{- define "bench.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-<name>, or the release alone when it already contains the name, or fullnameOverride. */}}
{{- define "bench.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else if contains (include "bench.name" .) .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "bench.name" .) | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "bench.labels" -}}
app.kubernetes.io/name: {{ include "bench.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: flatcake
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* A pod template's metadata: podLabels and podAnnotations, under the chart's own labels (which
the selectors use, so they win). Called with (dict "root" $ "component" NAME). */}}
{{- define "bench.podMeta" -}}
{{- $own := merge (dict "app.kubernetes.io/component" .component) (include "bench.labels" .root | fromYaml) -}}
labels:
  {{- toYaml (merge $own (deepCopy .root.Values.podLabels)) | nindent 2 }}
{{- with .root.Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Pod spec fields every pod of the release shares. */}}
{{- define "bench.podOptions" -}}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Where a pod runs: the role's nodeSelector, tolerations and affinity where it sets them, else the
release's (GPU nodes are usually tainted nvidia.com/gpu). Called with (dict "root" $ "role" VALUES);
the operator's webhook ANDs its ready-node term into the affinity given here. */}}
{{- define "bench.placement" -}}
{{- $role := .role | default dict -}}
{{- range $field := list "nodeSelector" "tolerations" "affinity" }}
{{- with (get $role $field | default (get $.root.Values $field)) }}
{{ $field }}:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- end -}}

{{/* A container's env and envFrom: the release's, then the role's (e.g. a gated model's HF_TOKEN from a
Secret). Called with (dict "root" $ "role" VALUES). */}}
{{- define "bench.env" -}}
{{- $role := .role | default dict -}}
{{- range $field := list "env" "envFrom" }}
{{- with (concat (get $.root.Values $field | default list) (get $role $field | default list)) }}
{{ $field }}:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "bench.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The endpoint under test: the given URL, else this release's SGLang, vLLM or emulator Service. */}}
{{- define "bench.target" -}}
{{- if .Values.target.url -}}
{{ .Values.target.url }}
{{- else if .Values.sglang.enabled -}}
http://{{ include "bench.fullname" . }}-sglang:{{ .Values.sglang.port }}
{{- else if .Values.vllm.enabled -}}
http://{{ include "bench.fullname" . }}-vllm:{{ .Values.vllm.port }}
{{- else if .Values.emulator.enabled -}}
http://{{ include "bench.fullname" . }}-emulator:{{ .Values.emulator.port }}
{{- else -}}
{{ fail "target.url: set the endpoint to measure, or enable emulator, sglang or vllm in this release" }}
{{- end -}}
{{- end -}}

{{- define "bench.tracePath" -}}
{{- if and .Values.trace.configMap.name .Values.trace.pvc.claimName -}}
{{ fail "trace: set only one of trace.configMap.name and trace.pvc.claimName" }}
{{- else if .Values.trace.configMap.name -}}
/trace/{{ .Values.trace.configMap.key }}
{{- else if .Values.trace.pvc.claimName -}}
/trace/{{ .Values.trace.pvc.path }}
{{- else -}}
{{ fail "trace: set trace.configMap.name (kubectl create configmap NAME --from-file=trace.jsonl=FILE) or trace.pvc.claimName" }}
{{- end -}}
{{- end -}}

{{- define "bench.traceVolume" -}}
- name: trace
{{- if .Values.trace.configMap.name }}
  configMap:
    name: {{ .Values.trace.configMap.name }}
{{- else }}
  persistentVolumeClaim:
    claimName: {{ .Values.trace.pvc.claimName }}
    readOnly: true
{{- end }}
{{- end -}}

{{/* The flatcake loadgen staging arguments both roles share (see loadgen/bench/staging.py). */}}
{{- define "bench.commonArgs" -}}
- --host
- {{ include "bench.target" . }}
- --trace
- {{ include "bench.tracePath" . }}
- --system
- {{ .Values.system | quote }}
- --workers
- {{ .Values.workers | quote }}
- --master-port
- "5557"
- --limit
- {{ .Values.run.limit | quote }}
- --api
- {{ .Values.target.api }}
- --max-output
- {{ .Values.run.maxOutput | quote }}
- --users
- {{ .Values.run.users | quote }}
- --qps
{{- range .Values.run.qps }}
- {{ . | quote }}
{{- end }}
{{- end -}}
