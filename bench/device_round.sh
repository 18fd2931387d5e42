#!/bin/bash
# A GPU round of the serve and decode benches, in as many device calls as it takes: each call
# runs the next stages not yet done (markers in work/round/, kept while the machine stays
# warm) while its time lasts, and copies every figure to $OUT. Prepare first with
# bench/prepare_device_bench.sh; then call, carrying .devrun and peers, until it says done:
#   bash bench/device_round.sh            (BUDGET=seconds per call, default 575;
#   WAYS2048, WAYS256: bench_serve's --ways for the two replays; ARGS2048, ARGS256: more
#   bench_serve arguments, shell-quoted, e.g. ARGS2048="--variant 'p8=--max-prefills 8'"
#   (default: the nofold variant, serve --fold-prompts off, and for s256 also onebyone,
#   serve --no-coalesce, front1, serve --http-workers 1, and stallauto, serve --max-prefills 16
#   --prefill-stall auto);
#   STAGES: which stages after the compile, in order, default "serve2048 serve256 decode sampler";
#   serve256open is the s256 release at open-loop Poisson rates (RATES256, default 400/s;
#   OPEN_REQUESTS requests, default 1500; REQUESTS256: the closed loop's, default 4000: with
#   300 (0.45 s of replay) its p99 was the opening burst's and its echo, not a steady state,
#   and at 2000 the burst's 32 requests are still 1.6 % of them, so the p99 is one of theirs
#   (twenty-seventh round); LONE256: the lone way's, default 1000, ~17 s);
#   CLIENT_PROCS: the replays' client processes (default 4: with one, its GIL added 15-26 ms
#   to the client's p99 TTFT beyond the server's write, twenty-third round);
#   serve256pinned: serve256 with the server on SERVER_CPUS (0-7), the clients on CLIENT_CPUS
#   (8-15); ROUNDS256: the s256 replays' rounds (default 1), the servers' rounds in turn
#   (bench_serve --interleave-servers: every server up at once) unless INTERLEAVE256='';
#   parity (the s256 release against the fp32 eager model, mixed graphs included) is one more,
#   and firstload (bench/profile_first_load.py: a process's first package load, step by step);
#   each call first times its first CUDA context and keeps one idle process holding it (gpu.txt);
#   LONG_BATCHES='' compiles the s256 release alone, for STAGES=serve256; STAGES may also
#   name pull (bench_pull.py at 16 GiB, PULLS its variants) and pulltls (the same over TLS,
#   PULLS_TLS its variants), which need no compile, so
#   STAGES=pull SKIP_COMPILE=1 runs it alone). A compile cut short goes on at the next call
#   (finished buckets are reused, the others start again): on an H100 host (2026-12-05) the
#   six buckets of both releases had not all compiled in one call (b8_s256, b32_s256 and
#   b32_s2048 still running at 530 s), so with little device time left, LONG_BATCHES='' first.
#   SKIP_ALONE=1: the replays without each prompt's answer alone first (bench_serve
#   --skip-alone: the s256 replay's 52,626 answer tokens one request at a time are about a
#   minute at the b1 step's 1.1 ms, by arithmetic; in bf16 about half of the answers differ
#   from it anyway, near ties under other batch shapes, so on a device it only counts them).
#   PACK_GRAPHS=1 brings the compiled graphs back (bench/carry_graphs.py, pieces in $OUT);
#   copied into .devrun/graphs/, the next session's compile only prepares the weights.
unset CXX  # the device image's wrapper breaks AOTInductor packages
T0=$(date +%s); BUDGET=${BUDGET:-575}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .devrun/whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# bytecode, as pip writes it into the pull image (ci/Dockerfile.pull): installed with
# --no-compile here, every process compiled its imports from source (the pull's imports took
# 0.69-0.99 s on 2026-12-07's hosts against 0.30-0.41 s on 2026-12-03's)
python3 -m compileall -q -j 0 /tmp/site pipeline >/dev/null 2>&1
R=work/round; mkdir -p "$R"
D=work/bench-cuda/models/bench-llama-3.2-1b-decode
L=work/bench-cuda/models/bench-llama-3.2-1b-prefill
PEER=(--peer peers/hf-continuous-batching/peer_serve.py --trace peers/AzureLLMInferenceTrace_conv.csv)
[ -n "${NO_PEER:-}" ] && PEER=()  # NO_PEER=1: the serve256 stage without the peer
# by default both replays also run serve without prompts folded into steps (the mixed
# graphs' comparison in the same run), and the s256 replay serve with one event per token
# (--no-coalesce: the baseline of coalescing, the default since 2026-12-06) and with one HTTP
# process (--http-workers 1: the baseline of auto, the default since 2026-12-07);
# ARGS2048='' or ARGS256='' leaves them out
NOFOLD="--variant 'nofold=--fold-prompts off'"
ONEBYONE="--variant 'onebyone=--no-coalesce'"
FRONT1="--variant 'front1=--http-workers 1'"
# a larger admission per iteration within a stall budget: ahead in every column on the
# simulated device at 4,000 requests (bench/RESULTS.md, 2026-12-07), not yet on a device
STALLAUTO="--variant 'stallauto=--max-prefills 16 --prefill-stall auto'"
eval "more2048=(${ARGS2048-$NOFOLD})"
eval "more256=(${ARGS256-$NOFOLD $ONEBYONE $FRONT1 $STALLAUTO})"
left() { echo $((BUDGET - ($(date +%s) - T0))); }
# Each stage ends with pkill -f "from pipeline.cli import main" (servers it started): a device
# command line holding that text is killed with them, output and all (2026-12-06).
stage() {  # name, least seconds it needs, command...: false when this call is out of time
  local name=$1 min=$2; shift 2
  [ -e "$R/$name.done" ] && return 0
  local l; l=$(left)
  if [ "$l" -lt "$min" ]; then echo "== $name: $l s left < $min: call again"; return 1; fi
  echo "== $name ($l s left) $(date -u +%T)"
  timeout -s INT -k 10 "$l" "$@" >"$R/$name.log" 2>&1; local rc=$?
  pkill -f "from pipeline.cli import main" 2>/dev/null; pkill -f peer_serve.py 2>/dev/null
  echo "== $name rc=$rc $(date -u +%T)"; tail -30 "$R/$name.log"
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then return 1; fi  # cut short: again next call
  touch "$R/$name.done"
}
run() {
  # the serve figures first, each stage in a call as the budget allows: compile (~460 s),
  # then STAGES in order (default: serve2048, serve256 (its peer last: a cut-short stage
  # keeps what its JSON already has), decode, sampler)
  # graphs a session brought back (PACK_GRAPHS below) make the compile weights-only
  if [ -z "${SKIP_COMPILE:-}" ] && [ ! -e "$R/compile.done" ] && [ -e .devrun/graphs/graphs.tar.xz.00 ]; then
    python3 bench/carry_graphs.py unpack .devrun/graphs work/bench-cuda/store \
      || echo "== carried graphs not unpacked: compiling them"
  fi
  [ -n "${SKIP_COMPILE:-}" ] || stage compile 120 python3 bench/bench_cuda_decode.py --skip-hf --skip-parity \
    --long-batches "${LONG_BATCHES-1,8,32}" --compile-only --out "$R/compile.json" || return
  for s in ${STAGES:-serve2048 serve256 decode sampler}; do "stage_$s" || return; done
  echo "== done"
}
stage_serve2048() {
  # NEED2048 overrides the seconds it needs (fewer ways need less)
  stage serve2048 "${NEED2048:-300}" python3 bench/bench_serve.py "$L" --requests 200 --concurrency 32,64 \
    --client-procs "${CLIENT_PROCS:-4}" \
    --ways "${WAYS2048:-lone,serve,thread}" --tolerate-mismatch ${SKIP_ALONE:+--skip-alone} "${more2048[@]}" \
    --json "$R/serve-s2048.json"
}
serve256() {  # stage name, its JSON's name, then more bench_serve arguments
  # at 4000 requests the default ways (six servers, ~10-15 s each to start since the
  # twenty-sixth round, the lone way's 1000 ~17 s, the static way ~25 s) and the peer
  # (~290 tok/s: ~190 s) need most of a call: begun later, it is cut (NEED256 overrides:
  # fewer ways need less)
  local name=$1 json=$2; shift 2
  local need=250; [ ${#PEER[@]} -gt 0 ] && need=450; need=${NEED256:-$need}
  [ -n "${INTERLEAVE256-1}" ] && set -- --interleave-servers "$@"
  stage "$name" "$need" python3 bench/bench_serve.py "$D" --requests "${REQUESTS256:-4000}" --concurrency 32 \
    --lone-requests "${LONE256:-1000}" \
    --client-procs "${CLIENT_PROCS:-4}" --rounds "${ROUNDS256:-1}" \
    --ways "${WAYS256:-lone,serve,thread,static}" --tolerate-mismatch ${SKIP_ALONE:+--skip-alone} \
    "${more256[@]}" "${PEER[@]}" \
    "$@" --json "$R/$json.json"
}
stage_serve256() { serve256 serve256 serve-s256; }
# the same with the server's processes and the clients on CPUs of their own (SERVER_CPUS,
# CLIENT_CPUS), as on a pod whose clients are other machines: whether the front's late loop
# (twenty-sixth round) was the clients' doing
stage_serve256pinned() {
  serve256 serve256pinned serve-s256-pinned --server-cpus "${SERVER_CPUS:-0-7}" --client-cpus "${CLIENT_CPUS:-8-15}"
}
stage_serve256open() {  # open loop: Poisson arrivals at each of RATES256 requests a second
  local r
  for r in ${RATES256:-400}; do
    stage "serve256open$r" 120 python3 bench/bench_serve.py "$D" --requests "${OPEN_REQUESTS:-1500}" \
      --rate "$r" --concurrency 64 --ways lone,serve --tolerate-mismatch \
      --client-procs "${CLIENT_PROCS:-4}" \
      --json "$R/serve-s256-open$r.json" \
      || return
  done
}
stage_decode() {  # LONG_BATCHES='': the s256 release alone beside gpt-fast (no s2048 compile)
  stage decode 250 python3 bench/bench_cuda_decode.py --skip-hf --skip-parity \
    --long-batches "${LONG_BATCHES-1,8,32}" --out "$R/cuda-decode.json"
}
stage_sampler() { stage sampler 60 python3 bench/bench_sampler.py; }
stage_firstload() {  # a process's first package load, step by step (a GPU server's start)
  stage firstload 60 python3 bench/profile_first_load.py "$D" --json "$R/first-load.json"
}
stage_parity() {  # the s256 release (mixed graphs included) against the fp32 eager model
  stage parity 90 python3 -c "from pipeline.cli import main; main()" parity "$D" \
    --reference cuda --checkpoint work/bench-cuda/llama-3.2-1b-random --json
  cp "$R/parity.log" "$R/parity.json" 2>/dev/null
}
stage_pull() {  # issue 32 at 16 GiB; PULLS: bench_pull's --pulls (experiments included)
  stage pull 240 python3 bench/bench_pull.py --gib 16 --shapes 4,64 \
    --pulls "${PULLS:-lean,lean-procs4:64,lean-procs8:64,lean-lowat}" \
    --skip curl,boto3,gil,stages --best-of 1 --nginx .devrun/bin/nginx-wrap \
    --s5cmd .devrun/bin/s5cmd --out "$R/pull16.json"
}
# the same over TLS, as S3 is reached (the certificate in .devrun/tls, made by
# prepare_device_bench.sh: the device image may lack openssl); by default the pull as it is
# (a worker per CPU over https, 64 in flight on 16 CPUs, each range streamed a MiB at a time,
# hashed and written while in cache) beside 32 in flight (the default before the
# thirty-third round; lean-buffered, the landing before streaming, was measured in the
# thirty-second and thirty-third), the CLI and s5cmd, best of PULL_BEST rounds (default 3:
# one run's spread was +-10-20 %, thirty-second round; the methods take turns within a
# round since the thirty-fourth), shapes PULL_SHAPES (default 64,4: many files first, the
# shape issue 32 still misses), skipping PULL_SKIP (default: the per-call timings and the
# unverified runs (stages); s5cmd + sha256sum runs in the first round only, ~20 s, as issue
# 32 asks for it beside the pull in the same run: PULL_SKIP=curl,boto3,gil,stages,sha256sum
# leaves it out); NEED_PULL: the seconds it needs (default 280; one shape needs less)
stage_pulltls() {
  stage pulltls "${NEED_PULL:-280}" python3 bench/bench_pull.py --gib 16 --shapes "${PULL_SHAPES:-64,4}" \
    --pulls "${PULLS_TLS:-lean,lean:32}" --tls --tls-dir .devrun/tls \
    --skip "${PULL_SKIP:-curl,boto3,gil,stages}" --best-of "${PULL_BEST:-3}" \
    --nginx .devrun/bin/nginx-wrap --s5cmd .devrun/bin/s5cmd --out "$R/pull16-tls.json"
}
# How long this host's first CUDA call takes, and whether the driver stays initialised
# between processes (persistence mode): a GPU server's start was 32.8 s in its first
# bucket's load (twenty-fourth round), which may be the driver's own initialisation. One
# idle process holding a CUDA context keeps the driver up for the call's servers without
# changing a setting; it goes with the script.
nvidia-smi --query-gpu=name,persistence_mode --format=csv,noheader >"$R/gpu.txt" 2>&1
df -T /tmp /dev/shm >>"$R/gpu.txt" 2>&1  # where bench_pull lands (tmpfs zeroes what is reserved)
# How fast this host runs single-threaded Python, and how loaded it is: the twenty-sixth
# round's host ran the pull's imports 1.8-2.3x slower than others and its server's event
# loop was late by tens of ms, so rounds on different hosts are compared by this line too
# (the 2-core VM: 0.18 s).
python3 -c "
import os, time
runs = []
for _ in range(3):
    t = time.perf_counter(); sum(range(10_000_000)); runs.append(time.perf_counter() - t)
print(f'host python: sum(range(1e7)) best of 3 {min(runs):.3f} s; load average', os.getloadavg())
" >>"$R/gpu.txt" 2>&1
python3 -c "
import os, sys, time; t = time.perf_counter()
import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()
print(f'first CUDA context in this call: {time.perf_counter() - t:.1f} s', flush=True)
while os.getppid() == int(sys.argv[1]):  # ends with the script, however it ends
    time.sleep(1)" $$ >>"$R/gpu.txt" 2>&1 &
HOLDER=$!
trap 'kill $HOLDER 2>/dev/null' EXIT
trap 'exit 143' TERM; trap 'exit 129' HUP; trap 'exit 130' INT  # so that EXIT runs
run
cat "$R/gpu.txt"; cp "$R/gpu.txt" "$OUT/" 2>/dev/null
# the figures, not the logs of every server (the copy back has a file count limit); of
# those, each server's start-up lines (each bucket's load, its prefill cost table, ready) in
# one file, to tell an outlier way by its table
cp "$R"/*.json "$R"/sampler.log "$OUT"/ 2>/dev/null
grep -H -E "prefill calls of|packages and weights|^ready:|error" "$R"/*.serve-*.log >"$OUT/server-startup.txt" 2>/dev/null
# and what a compile left out or fell back on (a mixed graph not built leaves a bucket without
# folding: the serve figures then say so only by their speed)
grep -H -E "not built|attends the whole bucket|prefills one prompt per call" \
  work/bench-cuda/compile/*/logs/*.log >"$OUT/compile-notes.txt" 2>/dev/null
# and the compiled packages' sizes: whether a session could carry the graphs to the next one
# and compile only the weights (the s256 compile is 283-509 s of a session's 1,800; $OUT
# brings back 8 files of 16 MiB at most, a carry is 64 MiB with the tree)
find work/bench-cuda/compile -path '*/buckets/*' -name '*.pt2' -printf '%s %p\n' 2>/dev/null | sort -k2 \
  | awk '{print; t += $1} END {if (NR) printf "%d packages, %.1f MiB\n", NR, t / 2^20}' \
  >>"$OUT/compile-notes.txt"
# PACK_GRAPHS=1: the compiled graphs themselves, in pieces of 15 MiB, for the next session:
# copy the pieces into .devrun/graphs/ and carry .devrun whole (the s256 release's 56.7 MiB
# of packages and their cache entries packed into one piece of 2.5 MB on 2026-12-08, so
# .devrun with nginx and s5cmd stays under the 64 MiB a call carries). There the compile
# finds every bucket's graphs in its cache and only prepares the weights. $OUT brings back
# 8 files in all: the fewer stages, the more room.
if [ -n "${PACK_GRAPHS:-}" ] && [ -e "$R/compile.done" ]; then
  python3 bench/carry_graphs.py pack work/bench-cuda/store/*/ --out "$OUT" --max-mib 15
fi
ls "$R"
