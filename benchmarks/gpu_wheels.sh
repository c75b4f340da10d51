#!/usr/bin/env bash
# Fetches here, into .whl/ (ignored by git), the wheels of what the GPU machine lacks, for a device run to carry
# (name .whl in the run's carry list; benchmarks/gpu_run.sh installs whatever .whl/ holds, offline):
#   torchao 0.17.0       fp8-mixed's rows (the release _versions.TORCHAO_FOR_TORCH gives the machine's torch 2.11)
#   liger-kernel 0.8.5   the kernels section's peer column (the H200 run of 2026-11-27 carried this one)
# About 4 MB. The machine runs Python 3.12 on x86-64 Linux; pip here needs the network (package registries).
#
# Usage: bash benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    --platform any -d .whl torchao==0.17.0 liger-kernel==0.8.5
ls -l .whl
