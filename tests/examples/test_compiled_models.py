"""The GPU suite's models (examples/vit's ViT, examples/gpt's Llama-style GPT) train under
``Fabric(precision="bf16-mixed", compile=True)`` with TorchInductor itself, its kernels off and on, as the suite's
compiled rows train them, at tiny sizes on the CPU: the same losses as eager, one graph for the blocks, no graph
break. The suite's smoke run compiles with Dynamo alone, so a compile that breaks only under Inductor went unseen
(an H200 run of 2026-11-27: the GPT's compiled rows raised ``InductorError``). Each run starts with an empty
Inductor cache, as a user's first run does."""

import re
from pathlib import Path

import pytest
from helpers import run_python

SCRIPT = str(Path(__file__).with_name("compiled_steps.py"))

# Inductor differs from one torch to the next: on the other torch versions CI runs, the GPT compiled by Inductor
# alone (the row that raised InductorError on the H200); the kernels under compile are checked on each of them by
# tests/kernels/ and the GPU rows' code generation by tests/test_cuda_codegen.py.
CASES = [
    pytest.param("gpt", False, id="gpt-kernels off", marks=pytest.mark.torch_versions),
    pytest.param("gpt", True, id="gpt-kernels on"),
    pytest.param("vit", False, id="vit-kernels off"),
    pytest.param("vit", True, id="vit-kernels on"),
]


@pytest.mark.parametrize(("model", "kernels"), CASES)
def test_the_suites_models_train_compiled_by_inductor_like_eager(tmp_path, model, kernels):
    args = [SCRIPT, model, *(["--kernels"] if kernels else [])]
    out = run_python(
        *args, timeout=600, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), TRITON_INTERPRET="1" if kernels else "0"
    ).stdout
    steps = re.findall(r"^STEP \d+ eager=(\S+) compiled=(\S+)$", out, re.MULTILINE)
    assert len(steps) == 3, out
    for eager, compiled in steps:
        # bf16 autocast: Inductor fuses and rounds differently from eager, by about 1e-4 here.
        assert float(compiled) == pytest.approx(float(eager), abs=1e-2), out
    report = re.search(r"^REPORT (.*)$", out, re.MULTILINE).group(1)
    assert "'compiled': 'regional'" in report and "'graphs': 1," in report, report
    assert "'graph_breaks': 0," in report and "'recompiles': 0," in report, report
