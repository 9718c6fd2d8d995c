#!/usr/bin/env bash
# Instructions per proxied request, counted by valgrind's callgrind: repeatable to a
# few percent whatever else the machine is doing, unlike CPU time. Runs the proxy on
# one thread in front of two stanch-mock upstreams, sends SMALL and then LARGE
# requests over 4 keep-alive connections, and prints (LARGE − SMALL) instructions
# divided by (LARGE − SMALL) requests, so start-up and shutdown cancel out.
#
#   scripts/bench-instructions.sh            # stanch-gateway
#   scripts/bench-instructions.sh bare       # the bare hyper proxy of stanch-bench
#
# STREAM=1 asks for streamed answers (SSE, 16 tokens) instead of whole ones.
# RUST_LOG sets the gateway's log level; the default is the shipped one (info: an access
# line a request); RUST_LOG=warn measures without the access log.
# KEEP=FILE keeps the larger run's profile for callgrind_annotate.
# GATEWAY=BIN measures another stanch-gateway binary (a build to compare with).
#
# Needs valgrind (Debian: valgrind) and python3. User-space instructions only: the
# kernel's share of a request (about half of its CPU here) is not counted.
set -euo pipefail
cd "$(dirname "$0")/.."
proxy="${1:-gateway}"
small="${SMALL:-2000}"
large="${LARGE:-6000}"
command -v valgrind >/dev/null || { echo "valgrind is not installed" >&2; exit 1; }
cargo build --release -q -p stanch-gateway -p stanch-mock -p stanch-bench

dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Sends $1 chat requests to 127.0.0.1:$2, a quarter on each of 4 connections.
send() {
  python3 - "$1" "$2" "${STREAM:-}" <<'PY'
import concurrent.futures, socket, sys
n, port, stream = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
body = (b'{"model":"qwen-72b","max_tokens":16,"stream":true,"messages":[{"role":"user","content":"hello there"}]}'
        if stream else
        b'{"model":"qwen-72b","max_tokens":8,"messages":[{"role":"user","content":"hello there"}]}')
request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
def connection(count):
    s = socket.create_connection(("127.0.0.1", port))
    f = s.makefile("rb")
    for _ in range(count):
        s.sendall(request)
        status = f.readline()
        if b" 200 " not in status:
            sys.exit(f"unexpected answer: {status!r}")
        length, chunked = 0, False
        while (line := f.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
            if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
                chunked = True
        if not chunked:
            f.read(length)
            continue
        while (size := int(f.readline().strip(), 16)) > 0:
            f.read(size + 2)
        f.read(2)
    s.close()
with concurrent.futures.ThreadPoolExecutor(4) as pool:
    list(pool.map(connection, [n // 4] * 4))
PY
}

# Runs the proxy under callgrind for $1 requests; prints the instructions it executed.
# It runs in a command substitution (a subshell), so it stops what it started itself.
count() {
  local requests="$1" up1 up2 port out pids=()
  trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
  up1="$(free_port)"; up2="$(free_port)"; port="$(free_port)"; out="$dir/callgrind.$requests"
  target/release/stanch-mock --listen "127.0.0.1:$up1" --model qwen-72b --instance a >/dev/null 2>&1 &
  pids+=($!)
  target/release/stanch-mock --listen "127.0.0.1:$up2" --model qwen-72b --instance b >/dev/null 2>&1 &
  pids+=($!)
  if [ "$proxy" = bare ]; then
    valgrind --tool=callgrind --callgrind-out-file="$out" target/release/stanch-bench bare-proxy \
      --listen "127.0.0.1:$port" --upstream "127.0.0.1:$up1" --upstream "127.0.0.1:$up2" 2>/dev/null &
  else
    cat >"$dir/gateway.yaml" <<EOF
models:
  qwen-72b:
    pools:
      - name: dc-a
        endpoints: [{url: 'http://127.0.0.1:$up1'}, {url: 'http://127.0.0.1:$up2'}]
EOF
    RUST_LOG="${RUST_LOG:-info}" valgrind --tool=callgrind --callgrind-out-file="$out" "${GATEWAY:-target/release/stanch-gateway}" \
      --config "$dir/gateway.yaml" --listen "127.0.0.1:$port" --worker-threads 1 2>/dev/null &
  fi
  local vg=$!
  pids+=("$vg")
  # Up when one request goes through (valgrind starts slowly).
  for _ in $(seq 1 150); do
    send 4 "$port" >/dev/null 2>&1 && break
    sleep 0.2
  done
  send "$requests" "$port"
  kill -TERM "$vg"
  wait "$vg" 2>/dev/null || true
  kill "${pids[@]}" 2>/dev/null || true
  grep '^summary:' "$out" | awk '{print $2}'
}

a="$(count "$small")"
b="$(count "$large")"
if [ -n "${KEEP:-}" ]; then cp "$dir/callgrind.$large" "$KEEP"; fi
echo "$proxy${STREAM:+ (streamed)}: $(( (b - a) / (large - small) )) instructions per request (callgrind; $small and $large requests: $a and $b)"
