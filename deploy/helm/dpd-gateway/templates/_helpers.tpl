{{/* Names: <release>-prefill, <release>-decode, <release>-gateway.  The
     pools' names are their headless Services' names, which nginx resolves
     and the kv_agent peers name; keep them short (a Service name is a
     DNS-1035 label of at most 63 characters). */}}
{{- define "dpd.name" -}}
{{- printf "%s-%s" .root.Release.Name .part | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dpd.labels" -}}
app.kubernetes.io/name: dpd-gateway
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .part }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "dpd.selector" -}}
app.kubernetes.io/name: dpd-gateway
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .part }}
{{- end -}}

{{- define "dpd.image" -}}
{{- printf "%s:%s" .repository (toString .tag) -}}
{{- end -}}

{{/* The DNS suffix of the cluster: pods are <pod>.<service>.<ns>.svc.<domain> */}}
{{- define "dpd.svcDomain" -}}
{{- printf "%s.svc.%s" .Release.Namespace (.Values.clusterDomain | default "cluster.local") -}}
{{- end -}}

{{/* Per-pod identity from the downward API */}}
{{- define "dpd.podEnv" -}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
{{- end -}}

{{/* Values the chart refuses, with the reason, before anything renders */}}
{{- define "dpd.check" -}}
{{- $v := .Values -}}
{{- if not (has $v.protocol (list "nixl" "lmcache" "kv_agent")) -}}
{{- fail (printf "protocol: %q is not one of nixl, lmcache, kv_agent" $v.protocol) -}}
{{- end -}}
{{- if not (has $v.nixl.backend (list "UCX" "LIBFABRIC")) -}}
{{- fail (printf "nixl.backend: %q is not UCX or LIBFABRIC" $v.nixl.backend) -}}
{{- end -}}
{{- if not (has $v.model.source.type (list "pvc" "s3" "hostPath")) -}}
{{- fail (printf "model.source.type: %q is not pvc, s3 or hostPath" $v.model.source.type) -}}
{{- end -}}
{{- if eq $v.protocol "lmcache" -}}
{{- if gt (int $v.gateway.replicas) 1 -}}
{{- fail "protocol lmcache: gateway.replicas must be 1 (LMCache's prefill sends its ProxyNotif to one pd_proxy_host, so the gateway that routed the request must be the one that receives it)" -}}
{{- end -}}
{{- $tp := int $v.decode.tensorParallelSize -}}
{{- if or (ne (len $v.lmcache.initPorts) $tp) (ne (len $v.lmcache.allocPorts) $tp) -}}
{{- fail (printf "lmcache.initPorts and lmcache.allocPorts: one port per decode TP rank (%d), got %d and %d" $tp (len $v.lmcache.initPorts) (len $v.lmcache.allocPorts)) -}}
{{- end -}}
{{- end -}}
{{- range $role := list "prefill" "decode" -}}
{{- $r := (index $v $role).resources -}}
{{- if and $r.hugepages2Mi (not (or $r.cpu $r.memory)) -}}
{{- fail (printf "%s.resources: hugepages2Mi needs cpu or memory as well (the API server refuses hugepages alone)" $role) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* GPUs, EFA devices and hugepages: the same in requests and limits */}}
{{- define "dpd.extended" -}}
{{- if gt (int .gpus) 0 }}
nvidia.com/gpu: {{ int .gpus }}
{{- end }}
{{- if gt (int .efa) 0 }}
vpc.amazonaws.com/efa: {{ int .efa }}
{{- end }}
{{- if .hugepages2Mi }}
hugepages-2Mi: {{ .hugepages2Mi | quote }}
{{- end }}
{{- end -}}
