{{/* The model volume of a pod (engines and the gateway's tokenizer copy) */}}
{{- define "dpd.modelVolume" -}}
{{- $s := .Values.model.source -}}
- name: model
{{- if eq $s.type "pvc" }}
  persistentVolumeClaim: {claimName: {{ $s.pvc.claimName | quote }}, readOnly: true}
{{- else if eq $s.type "hostPath" }}
  hostPath: {path: {{ $s.hostPath.path | quote }}, type: Directory}
{{- else }}
  emptyDir: {sizeLimit: {{ $s.s3.sizeLimit | quote }}}
{{- end }}
{{- end -}}

{{/* S3: an init container copies the model (or, with files, only those)
     into the pod's emptyDir */}}
{{- define "dpd.s3Init" -}}
{{- $s := .root.Values.model.source.s3 -}}
- name: {{ .name }}
  image: {{ include "dpd.image" $s.image }}
  imagePullPolicy: IfNotPresent
  command: [/bin/sh, -ec]
  args:
    - |
      {{- if .files }}
      for f in {{ join " " .files }}; do
        aws s3 cp --only-show-errors "${MODEL_URI%/}/$f" "{{ .dest }}/$f"
      done
      {{- else }}
      aws s3 sync --only-show-errors "$MODEL_URI" "{{ .dest }}"
      {{- end }}
  env:
    - {name: MODEL_URI, value: {{ $s.uri | quote }}}
  {{- if $s.credentialsSecret }}
  envFrom:
    - secretRef: {name: {{ $s.credentialsSecret | quote }}}
  {{- end }}
  resources:
    requests: {cpu: 500m, memory: 512Mi}
    limits: {memory: 2Gi}
  volumeMounts:
    - {name: {{ .volume }}, mountPath: {{ .dest | quote }}}
{{- end -}}
