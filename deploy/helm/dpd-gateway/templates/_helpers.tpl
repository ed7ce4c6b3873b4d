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
{{- $pc := include "dpd.prefixMode" . -}}
{{- if not (has $pc (list "off" "approximate" "events")) -}}
{{- fail (printf "routing.prefixCache: %q is not off, approximate or events" $pc) -}}
{{- end -}}
{{- if ne $pc "off" -}}
{{- range $a := concat $v.model.extraArgs $v.prefill.extraArgs $v.decode.extraArgs -}}
{{- if hasPrefix "--block-size" (toString $a) -}}
{{- fail (printf "extraArgs: %q with routing.prefixCache %s: set routing.blockSize instead (the engines' block size and the gateway's must agree)" $a $pc) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if eq $pc "events" -}}
{{- $n := int $v.routing.events.slots -}}
{{- if or (lt $n 1024) (ne (int (mod $n 1024)) 0) (ne (len (trimAll "0" (toString (printf "%b" $n)))) 1) -}}
{{- fail (printf "routing.events.slots: %d is not a power of two >= 1024" $n) -}}
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


{{/* routing.prefixCache as a word: YAML 1.1 reads a bare `off` as false */}}
{{- define "dpd.prefixMode" -}}
{{- $m := .Values.routing.prefixCache -}}
{{- if or (kindIs "bool" $m) (not $m) -}}off{{- else -}}{{ $m }}{{- end -}}
{{- end -}}

{{/* vLLM's --kv-events-config (vllm/config/kv_events.py KVEventsConfig,
     vllm-project/vllm main): the engine binds PUB and replay on every
     address of the pod, the gateway's kv_agent connects */}}
{{- define "dpd.kvEventsConfig" -}}
{{- $e := .Values.routing.events -}}
{{- toJson (dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%d" (int $e.port)) "replay_endpoint" (printf "tcp://*:%d" (int $e.replayPort)) "topic" $e.topic) -}}
{{- end -}}

{{/* routing.prefixCache events: adds to the gateway's kv_agent config
     (.c, a router's) one "kv_events" DNS source per pool, its headless
     "-peers" Service (every pod, ready or not: a pod that is briefly
     unready keeps its index entries), node = IP:8000 as nginx's
     `server ... resolve` names the peer, and the "prefix_index" nginx's
     `dpd_prefix_cache events file=` reads */}}
{{- define "dpd.prefixEvents" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $e := $v.routing.events -}}
{{- $src := list -}}
{{- range $pr := list "prefill" "decode" -}}
{{- $src = append $src (dict "dns" (printf "%s-peers.%s" (include "dpd.name" (dict "root" $root "part" $pr)) (include "dpd.svcDomain" $root)) "port" (int $e.port) "replay_port" (int $e.replayPort) "http_port" 8000 "topic" $e.topic "model" ($v.model.servedModelName | default $v.model.name) "resolve_ms" (int $e.resolveMs)) -}}
{{- end -}}
{{- $_ := set .c "kv_events" $src -}}
{{- $_ := set .c "prefix_index" (dict "path" "/dev/shm/dpd_prefix" "slots" (int $e.slots) "block" (int $v.routing.blockSize)) -}}
{{- end -}}
