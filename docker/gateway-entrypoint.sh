#!/bin/sh
# dpd-gateway entrypoint: nginx's `resolver` (for `server NAME resolve;`)
# must name an address; in a pod that is the cluster DNS from
# /etc/resolv.conf.  Written to /etc/nginx/dpd-resolver.conf, which
# nginx.conf includes, then the command runs (nginx by default).
#   DPD_RESOLVER        the address(es) instead of /etc/resolv.conf's
#   DPD_RESOLVER_VALID  how long an answer is kept (default 5s): how soon a
#                       new or removed pod is seen
#   DPD_RESOLV_CONF, DPD_RESOLVER_CONF  the files read and written (tests)
set -eu
conf=${DPD_RESOLVER_CONF:-/etc/nginx/dpd-resolver.conf}
resolv=${DPD_RESOLV_CONF:-/etc/resolv.conf}
ns=${DPD_RESOLVER:-}
if [ -z "$ns" ] && [ -r "$resolv" ]; then
    ns=$(awk '$1 == "nameserver" {
                  printf "%s%s", sep, ($2 ~ /:/ ? "[" $2 "]" : $2); sep = " "
              }' "$resolv")
fi
if [ -z "$ns" ]; then
    echo "dpd-gateway: no nameserver in $resolv: set DPD_RESOLVER" >&2
    exit 1
fi
echo "resolver $ns valid=${DPD_RESOLVER_VALID:-5s};" > "$conf"
exec "$@"
