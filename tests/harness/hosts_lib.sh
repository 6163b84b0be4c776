# Shared by the test-host scripts (hosts_*_test.sh): the skip check, the temporary directory,
# the teardown trap and `fail`. Source it with `th` (scripts/testhosts.sh), `name` (the hosts'
# prefix) and `needs_etcd` (1 or 0) set; it defines `out` (a temporary directory).
if [ "$(id -u)" -ne 0 ] || ! "$th" supported; then
  echo "SKIP: this machine cannot create network namespaces (needs root and CAP_SYS_ADMIN)"
  exit 77
fi
if [ "${needs_etcd:-0}" -eq 1 ] && { ! command -v etcd >/dev/null || ! command -v etcdctl >/dev/null; }; then
  echo "SKIP: etcd or etcdctl is missing (scripts/install-deps.sh installs etcd-server, etcd-client)"
  exit 77
fi
out=$(mktemp -d)
cleanup() {
  "$th" down "$name"
  rm -rf "$out"
}
trap cleanup EXIT
# fail MESSAGE: prints it and the tail of every log, then exits 1 (the trap tears down).
fail() {
  echo "FAIL: $*"
  for f in "$out"/*.log; do
    [ -f "$f" ] && { echo "---- $f"; tail -15 "$f"; }
  done
  exit 1
}

metric() {  # metric HOST PORT NAME: NAME's value (summed over labels) on that host's /metrics
  local a
  a=$("$th" addr "$1")
  "$th" exec "$name" "$1" bash -c "exec 3<>/dev/tcp/$a/$2; \
    printf 'GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n' >&3; cat <&3" |
    awk -v m="$3" '{ split($1, k, "{") } k[1] == m { s += $2; seen = 1 } END { if (seen) print s + 0 }'
}

# etcd_setup CLIENT_HOST MEMBER_HOST...: a cluster of one etcd member per MEMBER_HOST (named
# e<host>), probed from CLIENT_HOST. Sets `endpoints` (JSON strings, for
# kv_connector_extra_config.etcd_endpoints) and defines start_etcd HOST (a member; its data
# survives a kill, so starting it again rejoins) and etcd_healthy (a write goes through).
etcd_setup() {
  etcd_client_host=$1
  shift
  cluster=""
  endpoints=""
  local i a
  for i in "$@"; do
    a=$("$th" addr "$i")
    cluster+="${cluster:+,}e$i=http://$a:2380"
    endpoints+="${endpoints:+,}\"http://$a:2379\""
  done
}
start_etcd() {
  local a
  a=$("$th" addr "$1")
  "$th" exec "$name" "$1" etcd --name "e$1" --data-dir "$out/e$1" \
    --listen-client-urls "http://$a:2379" --advertise-client-urls "http://$a:2379" \
    --listen-peer-urls "http://$a:2380" --initial-advertise-peer-urls "http://$a:2380" \
    --initial-cluster "$cluster" --initial-cluster-state new >>"$out/etcd$1.log" 2>&1 &
  disown
}
etcd_healthy() {
  "$th" exec "$name" "$etcd_client_host" etcdctl --endpoints "${endpoints//\"/}" \
    --command-timeout=2s put /kvferry-test/probe x >/dev/null 2>&1
}
# wait_etcd_healthy: up to 20 s (a first election, or a new leader after one was lost).
wait_etcd_healthy() {
  for _ in $(seq 1 100); do
    etcd_healthy && return 0
    sleep 0.2
  done
  return 1
}
