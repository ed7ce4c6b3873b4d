{{/* kv_agent (protocol kv_agent, and the gateway's notify receiver for
     lmcache).  Node ids are pod names: the pools and, with kv_agent, the
     gateway are StatefulSets, so every name is known here and each link's
     key file is "<a>+<b>.key" (a < b).  The config is one template per role
     in a ConfigMap; an init container fills in the pod's own name and IP
     (@POD_NAME@, @POD_IP@) from the downward API. */}}

{{- define "dpd.kvNodes" -}}
{{- $root := .root -}}
{{- $nodes := list -}}
{{- $name := include "dpd.name" (dict "root" $root "part" .role) -}}
{{- $n := int (ternary $root.Values.gateway.replicas (index $root.Values .role | default dict).replicas (eq .role "gateway")) -}}
{{- if and (eq $root.Values.kvAgent.peers "dns") (gt (int $root.Values.kvAgent.keysForReplicas) $n) -}}
{{- $n = int $root.Values.kvAgent.keysForReplicas -}}
{{- end -}}
{{- range $i := until $n -}}
{{- $nodes = append $nodes (printf "%s-%d" $name $i) -}}
{{- end -}}
{{- join " " $nodes -}}
{{- end -}}

{{/* the roles a role links with */}}
{{- define "dpd.kvPeerRoles" -}}
{{- if eq . "prefill" }}decode gateway{{ else if eq . "decode" }}prefill gateway{{ else }}prefill decode{{ end -}}
{{- end -}}

{{- define "dpd.kvRole" -}}
{{- ternary "router" . (eq . "gateway") -}}
{{- end -}}

{{/* every key file a pod of this role needs, one per line */}}
{{- define "dpd.kvLinks" -}}
{{- $root := .root -}}
{{- $mine := splitList " " (include "dpd.kvNodes" (dict "root" $root "role" .role)) -}}
{{- range $pr := splitList " " (include "dpd.kvPeerRoles" .role) -}}
{{- range $peer := splitList " " (include "dpd.kvNodes" (dict "root" $root "role" $pr)) -}}
{{- range $me := $mine -}}
{{- $pair := sortAlpha (list $me $peer) }}
{{ printf "%s+%s.key" (index $pair 0) (index $pair 1) }}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* the config template of a role: @POD_NAME@ and @POD_IP@ are filled in
     per pod; the key of a link is found by both names, so the template
     lists, for each peer, the key file named with @POD_NAME@ */}}
{{- define "dpd.kvConfig" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $peers := list -}}
{{- range $pr := splitList " " (include "dpd.kvPeerRoles" .role) -}}
{{- $svc := printf "%s-peers.%s" (include "dpd.name" (dict "root" $root "part" $pr)) (include "dpd.svcDomain" $root) -}}
{{- range $peer := splitList " " (include "dpd.kvNodes" (dict "root" $root "role" $pr)) -}}
{{- $e := dict "id" $peer "role" (include "dpd.kvRole" $pr) "ctrl" (printf "%s.%s:%d" $peer $svc (int $v.kvAgent.port)) "key_file" (printf "/etc/kv_agent/keys/@KEY:%s@" $peer) -}}
{{- if ne $pr "gateway" -}}
{{- $_ := set $e "http" (printf "%s.%s:8000" $peer $svc) -}}
{{- end -}}
{{- $peers = append $peers $e -}}
{{- end -}}
{{- end -}}
{{- $c := dict "node_id" "@POD_NAME@" "role" (include "dpd.kvRole" .role) "listen" (printf "0.0.0.0:%d" (int $v.kvAgent.port)) "peers" $peers "state_path" "/dev/shm/dpd_state" -}}
{{- if eq $v.kvAgent.peers "dns" -}}
{{- /* one peers_dns entry per pool: its headless Service; the key file
       of a link is "<a>+<b>.key" sorted, and pools sort by their names
       ("<release>-decode" < "<release>-gateway" < "<release>-prefill"), so
       the pattern puts {peer} on the pool's side; a peer's "http" is what
       it announces (its POD_IP) */ -}}
{{- $me := include "dpd.name" (dict "root" $root "part" .role) -}}
{{- $dns := list -}}
{{- range $pr := splitList " " (include "dpd.kvPeerRoles" .role) -}}
{{- $pn := include "dpd.name" (dict "root" $root "part" $pr) -}}
{{- $kf := ternary "@POD_NAME@+{peer}.key" "{peer}+@POD_NAME@.key" (eq (first (sortAlpha (list $me $pn))) $me) -}}
{{- $dns = append $dns (dict "name" (printf "%s-peers.%s" $pn (include "dpd.svcDomain" $root)) "port" (int $v.kvAgent.port) "role" (include "dpd.kvRole" $pr) "key_file" (printf "/etc/kv_agent/keys/%s" $kf) "resolve_ms" (int $v.kvAgent.resolveMs)) -}}
{{- end -}}
{{- $_ := set $c "peers" list -}}
{{- $_ := set $c "peers_dns" $dns -}}
{{- /* outbound links leave from the pod's IP, the one the answers
       name: a peer accepts a discovered node only from there */ -}}
{{- $_ := set $c "listen" (printf "@POD_IP@:%d" (int $v.kvAgent.port)) -}}
{{- end -}}
{{- if ne .role "gateway" -}}
{{- $p := index $v .role -}}
{{- $_ := set $c "http" "@POD_IP@:8000" -}}
{{- $_ := set $c "provider" $v.kvAgent.provider -}}
{{- $_ := set $c "rails" "auto" -}}
{{- $_ := set $c "api_socket" "/run/kv_agent/api.sock" -}}
{{- $pool := $v.kvAgent.pool -}}
{{- $_ := set $c "pool" (dict "layers" (int $pool.layers) "regions" (int $pool.regions) "block_bytes" (int $pool.blockBytes) "blocks" (int $pool.blocks) "memory" $pool.memory "ranks" (int $p.tensorParallelSize)) -}}
{{- else if eq (include "dpd.prefixMode" $root) "events" -}}
{{- include "dpd.prefixEvents" (dict "root" $root "c" $c) -}}
{{- end -}}
{{- toPrettyJson $c -}}
{{- end -}}

{{/* the gateway's agent for lmcache and/or prefix-cache events (no
     peers, no keys: a router that only receives LMCache's notices and
     subscribes to the engines' KV events has no link to authenticate;
     kv_agent's config.c requires "node_id", "role" and "listen", nothing
     else) */}}
{{- define "dpd.kvConfigGateway" -}}
{{- $v := .Values -}}
{{- /* no peers: "listen" is required, so loopback only */ -}}
{{- $c := dict "node_id" "gateway" "role" "router" "listen" (printf "127.0.0.1:%d" (int $v.kvAgent.port)) "state_path" "/dev/shm/dpd_state" -}}
{{- if eq $v.protocol "lmcache" -}}
{{- $_ := set $c "lmcache_notify" (dict "listen" (printf "0.0.0.0:%d" (int $v.lmcache.notifyPort)) "allow" $v.lmcache.notifyAllow) -}}
{{- end -}}
{{- if eq (include "dpd.prefixMode" .) "events" -}}
{{- include "dpd.prefixEvents" (dict "root" . "c" $c) -}}
{{- end -}}
{{- toPrettyJson $c -}}
{{- end -}}

{{/* init container: config.json for this pod from the role's template */}}
{{- define "dpd.kvAgentConfigInit" -}}
{{- $v := .root.Values -}}
- name: kv-agent-config
  image: {{ include "dpd.image" $v.kvAgent.image }}
  imagePullPolicy: {{ $v.kvAgent.image.pullPolicy }}
  command: [/bin/sh, -ec]
  args:
    - |
      # @KEY:<peer>@ -> "<a>+<b>.key" with a < b (the names sorted)
      sed -e "s/@POD_NAME@/$POD_NAME/g" -e "s/@POD_IP@/$POD_IP/g" \
          /etc/kv_agent/template/{{ .role }}.json > /tmp/c.json
      for peer in $(sed -n 's/.*@KEY:\([^@]*\)@.*/\1/p' /tmp/c.json); do
        if [ "$POD_NAME" \< "$peer" ]; then k="$POD_NAME+$peer.key"
        else k="$peer+$POD_NAME.key"; fi
        sed -i "s/@KEY:$peer@/$k/" /tmp/c.json
      done
      mv /tmp/c.json /etc/kv_agent/run/config.json
  env:
    {{- include "dpd.podEnv" . | nindent 4 }}
  resources:
    requests: {cpu: 50m, memory: 32Mi}
    limits: {memory: 64Mi}
  volumeMounts:
    - {name: kv-agent-template, mountPath: /etc/kv_agent/template, readOnly: true}
    - {name: kv-agent-config, mountPath: /etc/kv_agent/run}
{{- end -}}

{{- define "dpd.kvAgentContainer" -}}
{{- $v := .root.Values -}}
- name: kv-agent
  image: {{ include "dpd.image" $v.kvAgent.image }}
  imagePullPolicy: {{ $v.kvAgent.image.pullPolicy }}
  args: [run, --config, /etc/kv_agent/run/config.json]
  env:
    {{- include "dpd.podEnv" . | nindent 4 }}
    - {name: NVIDIA_VISIBLE_DEVICES, value: all}
    {{- if gt (int .res.efa) 0 }}
    - {name: FI_PROVIDER, value: efa}
    - {name: FI_EFA_USE_DEVICE_RDMA, value: "1"}
    {{- with $v.kvAgent.efaLibfabricHostPath }}
    - {name: LD_LIBRARY_PATH, value: {{ printf "%s/lib64:%s/lib" . . | quote }}}
    {{- end }}
    {{- end }}
  ports:
    - {name: kv-agent, containerPort: {{ $v.kvAgent.port }}}
  securityContext:
    capabilities: {add: [IPC_LOCK]}
  {{- /* the agent opens the engine's CUDA IPC handles: it sees the
         pod's GPUs without holding them (NVIDIA container runtime) */}}
  resources:
    requests:
      cpu: {{ .res.cpu | quote }}
      memory: {{ .res.memory | quote }}
      {{- with include "dpd.extended" .res | trim }}{{ . | nindent 6 }}{{ end }}
    limits:
      memory: {{ .res.memory | quote }}
      {{- with include "dpd.extended" .res | trim }}{{ . | nindent 6 }}{{ end }}
  volumeMounts:
    - {name: shm, mountPath: /dev/shm}
    - {name: kv-agent-run, mountPath: /run/kv_agent}
    - {name: kv-agent-config, mountPath: /etc/kv_agent/run, readOnly: true}
    - {name: kv-agent-keys, mountPath: /etc/kv_agent/keys, readOnly: true}
    {{- if .res.hugepages2Mi }}
    - {name: hugepages, mountPath: /dev/hugepages}
    {{- end }}
    {{- if and (gt (int .res.efa) 0) $v.kvAgent.efaLibfabricHostPath }}
    - {name: efa-libfabric, mountPath: {{ $v.kvAgent.efaLibfabricHostPath | quote }}, readOnly: true}
    {{- end }}
{{- end -}}

{{- define "dpd.kvAgentVolumes" -}}
{{- $root := .root -}}
- name: kv-agent-template
  configMap: {name: {{ include "dpd.name" (dict "root" $root "part" "kv-agent") }}}
- name: kv-agent-config
  emptyDir: {sizeLimit: 1Mi}
- name: kv-agent-run
  emptyDir: {sizeLimit: 1Mi}
{{- if and (ne .role "gateway") (gt (int (index $root.Values .role).resources.efa) 0) $root.Values.kvAgent.efaLibfabricHostPath }}
- name: efa-libfabric
  hostPath: {path: {{ $root.Values.kvAgent.efaLibfabricHostPath | quote }}, type: Directory}
{{- end }}
{{- if eq $root.Values.kvAgent.peers "dns" }}
- name: kv-agent-keys     # every link: pods come and go without a render
  secret:
    secretName: {{ $root.Values.kvAgent.keysSecret | quote }}
    defaultMode: 0400
{{- else }}
- name: kv-agent-keys     # only this role's links; a missing one stops the pod
  secret:
    secretName: {{ $root.Values.kvAgent.keysSecret | quote }}
    defaultMode: 0400
    items:
      {{- range $k := compact (splitList "\n" (include "dpd.kvLinks" .)) | uniq }}
      - {key: {{ $k | quote }}, path: {{ $k | quote }}}
      {{- end }}
{{- end }}
{{- end -}}
