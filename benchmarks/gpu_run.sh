#!/usr/bin/env bash
# The GPU measurements in one command, at most 9 minutes on one H100/H200 with the install, inside the 10 minutes a lent
# machine's command may run. Each step has a limit of its own (about 1.3x what it took on an H200, 2026-11-27) and
# none runs past the deadline, 540 s from the start; a step that fails or runs out of time leaves the others' files:
#
#   | step         | limit | H200 11-27 | what, and its files in OUT                                                   |
#   |--------------|-------|------------|------------------------------------------------------------------------------|
#   | install      |   -   |    ~5 s    | pip install -e . offline, and the wheels in .whl/ if any (gpu_wheels.sh): pip.log |
#   | kernel-tests |  110  |    71 s    | tests/kernels compiled for the GPU (TRITON_INTERPRET=0): kernel-tests-compiled.log |
#   | host-cost    |   25  |    16 s    | one kernel call's host cost next to torch's: host-cost.md                    |
#   | models       |  120  |    85 s    | gpu_suite.py's models section: the kernels inside ViT-B/16 and the Llama GPT, eager and compiled: suite/models.csv (MEASURED_WINS in kernels/swap.py comes from it) |
#   | kernels      |  100  |   136 s    | gpu_suite.py --quick's kernels section, its budget 90 s, the open goals first (norm backward tiles against the row loop, linear cross-entropy, cross-entropy; the residual-add norms as time allows): suite/kernels.csv |
#   | talk-cold    |   90  |    75 s    | examples/vit/10_talk_vit_b16.py --synthetic, empty caches: talk-cold.log     |
#   | talk-warm    |   75  |    69 s    | the same with the caches the first run left: talk-warm.log                   |
#
# --talk runs instead the talk's run against raw PyTorch on the same machine in one session (the talk issue's ratio),
# 345 s of limits: talk.md has the table and the goals (gpu_summary.py --talk).
#
#   | step         | limit | H200 11-27 | what, and its files in OUT                                                   |
#   |--------------|-------|------------|------------------------------------------------------------------------------|
#   | raw-eager    |   80  |  ~59 s (a) | benchmarks/talk_raw.py --synthetic --no-compile: raw-eager.log               |
#   | talk-cold    |   90  |    75 s    | as above: talk-cold.log                                                      |
#   | talk-warm    |   75  |    69 s    | as above: talk-warm.log                                                      |
#   | raw-compile  |  100  |  not run   | benchmarks/talk_raw.py --synthetic --compile, empty caches of its own: raw-compile.log |
#   (a) that session's e2e.py, timed from the first step: ../shared/gpu/h200-2026-11-27/first-step-async-raw.txt
#
# Everything ends up in OUT, also packed as OUT/results.tar.gz. The last line is the verdict (gpu_summary.py
# --verdict): "GPU CHECKS PASSED", or "GPU CHECKS FAILED:" and what failed: a step that did not end 0 or did not
# start, a kernel test, a models or kernels row with an error, a talk's run without its RESULT line.
#
# --smoke runs the same steps on the CPU at tiny sizes (kernels under Triton's interpreter, the talk's CI shape) to
# check the script; its files say so and are never GPU results.
#
# Usage: bash benchmarks/gpu_run.sh OUT [--talk] [--smoke]   (on the GPU machine: it installs fabriclite itself, offline)
set -uo pipefail
python3() { command "${PYTHON:-python3}" "$@"; }  # PYTHON: another interpreter (the tests pass theirs)
cd "$(dirname "$0")/.."
out=${1:?usage: bash benchmarks/gpu_run.sh OUT [--talk] [--smoke]}
shift
smoke="" mode=checks
for option in "$@"; do
    case $option in
        --smoke) smoke=--smoke ;;
        --talk) mode=talk ;;
        *) echo "gpu_run.sh: unknown option '$option' (expected --talk or --smoke)" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/run.log"
cache=$(mktemp -d)  # one compile cache for both talk runs, empty at the start
export TORCHINDUCTOR_CACHE_DIR="$cache/inductor" TRITON_CACHE_DIR="$cache/triton"

deadline=540  # seconds from the start: 9 minutes, a minute under what one command may run on a lent machine
if [ "$smoke" = "--smoke" ]; then deadline=850; fi  # a loaded 2-core CI machine, under the test's 900 s
step() {  # step NAME SECONDS COMMAND...: run it with a time limit (never past the deadline), log how it ended, go on
    local name=$1 limit=$2
    shift 2
    local began=$SECONDS left=$((deadline - SECONDS - 10))  # 10 s for the kill and the packing at the end
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
    if [ "$limit" -lt 5 ]; then
        echo "===== $name: skipped, ${deadline} s deadline reached" | tee -a "$log"
        return
    fi
    echo "===== $name (limit ${limit} s): $*" | tee -a "$log"
    timeout --kill-after=5 "$limit" "$@"
    echo "===== $name: exit $? after $((SECONDS - began)) s" | tee -a "$log"
}

if [ "$smoke" != "--smoke" ]; then  # the GPU machine's python3 has torch and no network: install fabriclite alone
    python3 -m pip install -q --no-deps --no-build-isolation --break-system-packages -e . >"$out/pip.log" 2>&1 ||
        python3 -m pip install -q --no-deps -e . >>"$out/pip.log" 2>&1
    # What the machine lacks travels as wheels in .whl/ (benchmarks/gpu_wheels.sh; the run carries .whl): torchao for
    # the fp8 rows, Liger-Kernel for the kernels' peer column. Installed beside, not into, the machine's packages.
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$cache/site" \
            .whl/*.whl >>"$out/pip.log" 2>&1 && export PYTHONPATH="$cache/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
python3 - <<'EOF' | tee -a "$log"
import importlib.metadata, torch, triton
def version(name):
    try:
        return f"{name} {importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return f"no {name}"
gpu = torch.cuda.is_available() and torch.cuda.get_device_name()
print("torch", torch.__version__, "triton", triton.__version__, "cuda", gpu, version("torchao"), version("liger-kernel"))
EOF
raw_caches=(env TORCHINDUCTOR_CACHE_DIR="$cache/raw-inductor" TRITON_CACHE_DIR="$cache/raw-triton")
if [ "$mode" = talk ] && [ "$smoke" = "--smoke" ]; then
    export CUDA_VISIBLE_DEVICES=""
    talk=(--synthetic --image-size 32 --dim 64 --depth 2 --train-size 256 --test-size 128 --batch-size 32 --epochs 1
          --workers 0 --precision 32-true)
    step raw-eager 120 python3 benchmarks/talk_raw.py "${talk[@]}" --no-compile >"$out/raw-eager.log" 2>&1
    step talk-cold 120 python3 examples/vit/10_talk_vit_b16.py "${talk[@]}" --no-compile >"$out/talk-cold.log" 2>&1
    step talk-warm 120 python3 examples/vit/10_talk_vit_b16.py "${talk[@]}" --no-compile >"$out/talk-warm.log" 2>&1
    step raw-compile 300 "${raw_caches[@]}" python3 benchmarks/talk_raw.py "${talk[@]}" --compile \
        >"$out/raw-compile.log" 2>&1
elif [ "$mode" = talk ]; then
    # The limits add up to 345 s (the second table above).
    step raw-eager 80 python3 benchmarks/talk_raw.py --synthetic --no-compile >"$out/raw-eager.log" 2>&1
    step talk-cold 90 python3 examples/vit/10_talk_vit_b16.py --synthetic >"$out/talk-cold.log" 2>&1
    step talk-warm 75 python3 examples/vit/10_talk_vit_b16.py --synthetic >"$out/talk-warm.log" 2>&1
    step raw-compile 100 "${raw_caches[@]}" python3 benchmarks/talk_raw.py --synthetic --compile \
        >"$out/raw-compile.log" 2>&1
elif [ "$smoke" = "--smoke" ]; then
    export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1
    step host-cost 120 python3 benchmarks/kernels.py --host-cost --ops layer_norm rms_norm >"$out/host-cost.md"
    step models 400 python3 benchmarks/gpu_suite.py --smoke --out "$out/suite" --sections models --budget 360 \
        >"$out/models.log" 2>&1
    talk=(--image-size 32 --dim 64 --depth 2 --train-size 256 --test-size 128 --batch-size 32 --epochs 1
          --workers 0 --precision 32-true --no-compile)
    step talk-cold 120 python3 examples/vit/10_talk_vit_b16.py --synthetic "${talk[@]}" >"$out/talk-cold.log" 2>&1
    step talk-warm 120 python3 examples/vit/10_talk_vit_b16.py --synthetic "${talk[@]}" >"$out/talk-warm.log" 2>&1
else
    # The limits add up to 520 s (the table above).
    export TRITON_INTERPRET=0  # the tests' own default is the interpreter
    step kernel-tests 110 python3 -m pytest tests/kernels -n 8 -q -p no:cacheprovider \
        >"$out/kernel-tests-compiled.log" 2>&1
    step host-cost 25 python3 benchmarks/kernels.py --host-cost >"$out/host-cost.md" 2>&1
    step models 120 python3 benchmarks/gpu_suite.py --out "$out/suite" --sections models --budget 110 \
        >"$out/models.log" 2>&1
    step kernels 100 python3 benchmarks/gpu_suite.py --quick --out "$out/suite" --sections kernels --budget 90 \
        >"$out/kernels.log" 2>&1
    step talk-cold 90 python3 examples/vit/10_talk_vit_b16.py --synthetic >"$out/talk-cold.log" 2>&1
    step talk-warm 75 python3 examples/vit/10_talk_vit_b16.py --synthetic >"$out/talk-warm.log" 2>&1
fi
rm -rf "$cache"
if [ "$mode" = talk ]; then python3 benchmarks/gpu_summary.py --talk "$out" $smoke >"$out/talk.md"; fi
verdict=$(python3 benchmarks/gpu_summary.py --verdict "$out" $smoke)
status=$?
echo "$verdict ($SECONDS s)" >>"$log"
tar -czf "$out/results.tar.gz" -C "$out" --exclude results.tar.gz .
echo "files in $out: $(ls "$out" | tr '\n' ' ')"
echo "$verdict ($SECONDS s)"
exit "$status"
