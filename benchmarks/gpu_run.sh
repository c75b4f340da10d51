#!/usr/bin/env bash
# Issue 40's GPU measurements in one command, about 8 minutes on one H100/H200 (each step has its own time limit,
# and a step that fails or runs out of time leaves the others' files):
#   1. the kernel tests compiled for the GPU (TRITON_INTERPRET=0): kernel-tests-compiled.log
#   2. the host cost of one kernel call, Triton's launches included, next to torch's: host-cost.md
#   3. gpu_suite.py's models section: the kernels inside ViT-B/16 and the Llama-style GPT, eager and compiled, off,
#      all on and each alone, interleaved: suite/models.csv (what MEASURED_WINS in kernels/swap.py is filled from)
#   4. gpu_suite.py's kernels section, --quick: the norms (rms_norm and layer_norm first, at 16384x4096, 16384x8192
#      and 25216x768: the backward in tiles next to the row loop it replaced, wall time and the GPU's kernel time),
#      linear cross-entropy (vocabulary chunks next to row chunks) and cross-entropy, against eager, torch.compile and
#      Liger when installed; the residual-add norms last, as time allows: suite/kernels.csv
#   5. the talk's run (examples/vit/10_talk_vit_b16.py --synthetic) with empty caches, then again with the caches the
#      first run left (one TORCHINDUCTOR_CACHE_DIR): talk-cold.log, talk-warm.log
# Everything ends up in OUT, also packed as OUT/results.tar.gz.
#
# --smoke runs the same steps on the CPU at tiny sizes (kernels under Triton's interpreter, the talk's CI shape) to
# check the script; its files say so and are never GPU results.
#
# Usage: bash benchmarks/gpu_run.sh OUT [--smoke]   (on the GPU machine: it installs fabriclite itself, offline)
set -uo pipefail
python3() { command "${PYTHON:-python3}" "$@"; }  # PYTHON: another interpreter (the tests pass theirs)
cd "$(dirname "$0")/.."
out=${1:?usage: bash benchmarks/gpu_run.sh OUT [--smoke]}
smoke=${2:-}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/run.log"
cache=$(mktemp -d)  # one compile cache for both talk runs, empty at the start
export TORCHINDUCTOR_CACHE_DIR="$cache/inductor" TRITON_CACHE_DIR="$cache/triton"

step() {  # step NAME SECONDS COMMAND...: run it with a time limit, log how it ended, go on either way
    local name=$1 limit=$2
    shift 2
    local began=$SECONDS
    echo "===== $name (limit ${limit} s): $*" | tee -a "$log"
    timeout --kill-after=10 "$limit" "$@"
    echo "===== $name: exit $? after $((SECONDS - began)) s" | tee -a "$log"
}

if [ "$smoke" != "--smoke" ]; then  # the GPU machine's python3 has torch and no network: install fabriclite alone
    python3 -m pip install -q --no-deps --no-build-isolation --break-system-packages -e . >"$out/pip.log" 2>&1 ||
        python3 -m pip install -q --no-deps -e . >>"$out/pip.log" 2>&1
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())" | tee -a "$log"
if [ "$smoke" = "--smoke" ]; then
    export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1
    step host-cost 120 python3 benchmarks/kernels.py --host-cost --ops layer_norm rms_norm >"$out/host-cost.md"
    step models 400 python3 benchmarks/gpu_suite.py --smoke --out "$out/suite" --sections models --budget 360 \
        >"$out/models.log" 2>&1
    talk=(--image-size 32 --dim 64 --depth 2 --train-size 256 --test-size 128 --batch-size 32 --epochs 1
          --workers 0 --precision 32-true --no-compile)
    step talk-cold 120 python3 examples/vit/10_talk_vit_b16.py --synthetic "${talk[@]}" >"$out/talk-cold.log" 2>&1
    step talk-warm 120 python3 examples/vit/10_talk_vit_b16.py --synthetic "${talk[@]}" >"$out/talk-warm.log" 2>&1
else
    export TRITON_INTERPRET=0  # the tests' own default is the interpreter
    step kernel-tests 100 python3 -m pytest tests/kernels -n 8 -q -p no:cacheprovider \
        >"$out/kernel-tests-compiled.log" 2>&1
    step host-cost 45 python3 benchmarks/kernels.py --host-cost >"$out/host-cost.md" 2>&1
    step models 185 python3 benchmarks/gpu_suite.py --out "$out/suite" --sections models --budget 175 \
        >"$out/models.log" 2>&1
    # models took 77 s on an H200 (2026-11-26); the kernels' two designs side by side want the time
    step kernels 175 python3 benchmarks/gpu_suite.py --quick --out "$out/suite" --sections kernels --budget 165 \
        >"$out/kernels.log" 2>&1
    step talk-cold 110 python3 examples/vit/10_talk_vit_b16.py --synthetic >"$out/talk-cold.log" 2>&1
    step talk-warm 90 python3 examples/vit/10_talk_vit_b16.py --synthetic >"$out/talk-warm.log" 2>&1
fi
rm -rf "$cache"
tar -czf "$out/results.tar.gz" -C "$out" --exclude results.tar.gz .
echo "files in $out: $(ls "$out" | tr '\n' ' ')" | tee -a "$log"
