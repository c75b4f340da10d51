"""The compile switch: Fabric(compile=...) and setup(..., compile=...), and the report of what the compiler did."""

import importlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from fabriclite import Fabric
from helpers import run_python

EAGER = {"backend": "aot_eager"}  # traces like inductor without compiling C++: fast enough for most tests


@pytest.fixture(autouse=True)
def _fresh_dynamo_cache():
    # A model runs graphs already compiled for the same code with equal arguments and counts none of them: each
    # test starts from an empty cache so its counts do not depend on the tests before it.
    torch._dynamo.reset()


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))


class Block(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.norm, self.fc, self.drop = nn.LayerNorm(8), nn.Linear(8, 8), nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.fc(nn.functional.gelu(self.norm(x))))


class Tower(nn.Module):
    """A transformer-shaped model: an input layer, three repeated blocks in a ModuleList, a head."""

    def __init__(self, dropout=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList(Block(dropout) for _ in range(3))

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Chatty(nn.Module):
    """Two layers with a graph break between them."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        x = self.a(x)
        print("", end="")  # dynamo cannot trace print: a graph break
        return self.b(x)


def train(fabric, steps=4, compile=None, shapes=None, model=None):
    model = model or net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer, compile=compile)
    torch.manual_seed(1)
    for step in range(steps):
        x = torch.randn(shapes[step] if shapes else 5, 6)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
    return model


def test_compile_true_with_inductor_trains_like_eager_and_reports_one_graph():
    eager = train(Fabric(accelerator="cpu"))
    fabric = Fabric(accelerator="cpu", compile=True)
    compiled = train(fabric)
    assert type(compiled._forward_module).__name__ == "OptimizedModule"
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    (report,) = fabric.compile_report()
    assert report["graphs"] == 1 and report["graph_breaks"] == 0 and report["recompiles"] == 0


@pytest.mark.torch_versions
def test_repeated_blocks_are_compiled_once_and_train_like_eager():
    eager = train(Fabric(accelerator="cpu"), model=Tower())
    fabric = Fabric(accelerator="cpu", compile=True)
    compiled = train(fabric, model=Tower())
    assert type(compiled._forward_module).__name__ != "OptimizedModule"  # compiled in place, block by block
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    (report,) = fabric.compile_report()
    assert report["compiled"] == "regional" and report["regions"] == ["blocks.0", "blocks.1", "blocks.2"]
    assert report["graphs"] == 1 and report["graph_breaks"] == 0 and report["recompiles"] == 0


@pytest.mark.torch_versions
def test_regional_false_and_models_without_repeated_blocks_compile_whole():
    fabric = Fabric(accelerator="cpu", compile={**EAGER, "regional": False})
    whole = train(fabric, steps=1, model=Tower())
    assert type(whole._forward_module).__name__ == "OptimizedModule"
    mlp = train(Fabric(accelerator="cpu"), steps=1, compile=EAGER)  # its repeated Linears are single layers
    assert type(mlp._forward_module).__name__ == "OptimizedModule"
    assert fabric.compile_report()[0]["compiled"] == "whole" and fabric.compile_report()[0]["regions"] == []


@pytest.mark.torch_versions
def test_partial_batches_and_new_eval_sizes_do_not_recompile():
    fabric = Fabric(accelerator="cpu", compile=EAGER)
    model = train(fabric, steps=3, shapes=[8, 8, 5], model=Tower())  # the last training batch is partial
    model.eval()
    with torch.no_grad():
        for size in (16, 16, 3, 11):  # a new evaluation batch size, then its partial last batch, then another
            model(torch.randn(size, 6))
    model.train()
    model(torch.randn(8, 6)).sum().backward()
    (report,) = fabric.compile_report()
    assert report["graphs"] == 1 and report["recompiles"] == 0


def test_evaluating_after_training_compiles_nothing_more_and_runs_like_the_eager_model_in_eval_mode():
    fabric = Fabric(accelerator="cpu", compile=EAGER)
    model = train(fabric, steps=2, model=Tower(dropout=0.5))
    eager = Tower(dropout=0.5)
    eager.load_state_dict(model.state_dict())
    x = torch.randn(7, 6)
    for _ in range(2):  # evaluation and back to training, twice
        model.eval(), eager.eval()
        with torch.no_grad():
            torch.testing.assert_close(model(x), eager(x))  # dropout off, as in the eager model
            torch.testing.assert_close(model(x), model(x))
        model.train()
        out = model(x)
        assert not torch.equal(out, model(x))  # training again: dropout on
        out.sum().backward()
    (report,) = fabric.compile_report()
    assert report["graphs"] == 1 and report["recompiles"] == 0


def test_an_inference_only_model_is_compiled_and_so_is_an_evaluation_before_training():
    fabric = Fabric(accelerator="cpu", compile=EAGER)
    model = fabric.setup(Tower(dropout=0.5))
    eager = Tower(dropout=0.5).eval()
    model.eval()
    x = torch.randn(5, 6)
    with torch.no_grad():
        torch.testing.assert_close(model(x), eager(x))
        model(torch.randn(9, 6))
    assert fabric.compile_report()[0]["graphs"] == 1  # inference compiled
    model.train()
    model(x).sum().backward()  # training after it compiles its own graph once
    model.eval()
    with torch.no_grad():
        model(x)  # and evaluation keeps its compiled graph
    assert fabric.compile_report()[0]["recompiles"] == 1


def test_dynamic_false_keeps_shapes_static_and_reports_the_recompiles():
    fabric = Fabric(accelerator="cpu", compile={**EAGER, "dynamic": False})
    train(fabric, steps=3, shapes=[8, 5, 3], model=Tower())
    assert fabric.compile_report()[0]["recompiles"] == 2


def test_the_vector_instruction_check_runs_once_per_cache_folder_and_later_processes_read_its_result(
    monkeypatch, tmp_path
):
    from fabriclite.compile import _vec_isa_option
    from fabriclite._versions import inductor_vec_isa_all_pass, inductor_vec_isa_fingerprint

    if inductor_vec_isa_fingerprint() is None:
        pytest.skip("off x86-64 Linux, or with TORCHINDUCTOR_VEC_ISA_OK set, Inductor's own check decides")
    passes = inductor_vec_isa_all_pass()  # in the default folder, where earlier compiles built the test programs
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert _vec_isa_option() == ({"cpp.vec_isa_ok": True} if passes else {})
    (record,) = (tmp_path / "fabriclite-compile").iterdir()
    assert record.read_text() == ("pass" if passes else "fail")
    record.write_text("fail" if passes else "pass")  # what a later process finds is what it tells Inductor
    assert _vec_isa_option() == ({} if passes else {"cpp.vec_isa_ok": True})


def test_the_vector_instruction_option_is_only_given_to_inductor_on_a_cpu_and_never_over_the_users():
    from torch._inductor import config

    from fabriclite.compile import _CountingBackend, _vec_isa_option

    expected = _vec_isa_option().get("cpp.vec_isa_ok")
    assert _CountingBackend({}, torch.device("cpu")).inner.config.get("cpp.vec_isa_ok") == expected
    mode = _CountingBackend({"mode": "max-autotune-no-cudagraphs"}, torch.device("cpu")).inner.config
    assert mode.get("cpp.vec_isa_ok") == expected and mode["max_autotune"]
    assert "cpp.vec_isa_ok" not in _CountingBackend({}, torch.device("cuda")).inner.config
    assert "options" not in _CountingBackend({"backend": "aot_eager"}, torch.device("cpu")).inner.kwargs
    mine = _CountingBackend({"options": {"cpp.vec_isa_ok": False}}, torch.device("cpu"))
    assert mine.inner.config["cpp.vec_isa_ok"] is False
    with config.patch({"cpp.vec_isa_ok": False}):  # TORCHINDUCTOR_VEC_ISA_OK=0: the user decides, no record
        assert "cpp.vec_isa_ok" not in _CountingBackend({}, torch.device("cpu")).inner.config


TOWERS = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc, self.scale = nn.LayerNorm(8), nn.Linear(8, 8), 1.0

    def forward(self, x):
        return x + self.scale * self.fc(nn.functional.gelu(self.norm(x)))


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def train(fabric, model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    torch.manual_seed(1)
    losses = []
    for _ in range(3):
        loss = model(torch.randn(5, 6)).pow(2).mean()
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    return losses
"""

WARM_SCRIPT = """
import json, sys, torch
from torch._dynamo.utils import counters
sys.path.insert(0, sys.argv[1])
from fabriclite import Fabric
from towers import Tower, train
fabric = Fabric(accelerator="cpu", compile=True)
model = fabric.setup(torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3)))
model(torch.randn(5, 6)).sum().backward()
cached = {**counters["inductor"], **counters["aot_autograd"]}
eager = train(Fabric(accelerator="cpu"), Tower())
compiled = train(fabric, Tower())
print(json.dumps({"cached": cached, "eager": eager, "compiled": compiled, "report": fabric.compile_report()[1]}))
"""


def precompile_supported():
    from fabriclite._versions import precompile_supported

    return precompile_supported()


@pytest.mark.torch_versions
def test_a_second_process_finds_every_graph_the_first_one_left_in_the_cache_folder_and_trains_the_same(tmp_path):
    # Two real processes sharing one empty Inductor cache folder. A whole model: the vector instruction option must
    # be the same in both (it is part of each cached graph's key), or the second process would compile everything
    # again. A model with blocks: where torch can save a compiled graph, the second process loads the blocks' graph.
    (tmp_path / "towers.py").write_text(TOWERS)
    folder = str(tmp_path / "inductor")
    first, second = (
        json.loads(
            run_python(
                "-c", WARM_SCRIPT, str(tmp_path), timeout=900, TORCHINDUCTOR_CACHE_DIR=folder
            ).stdout.splitlines()[-1]
        )
        for _ in range(2)
    )
    assert first["cached"].get("autograd_cache_miss", 0) >= 1 and first["cached"].get("autograd_cache_hit", 0) == 0
    assert second["cached"].get("autograd_cache_hit", 0) >= 1 and second["cached"].get("autograd_cache_miss", 0) == 0
    assert second["cached"].get("fxgraph_cache_miss", 0) == 0
    saved = ["compiled", "loaded"] if precompile_supported() else [None, None]
    assert [first["report"]["saved_graph"], second["report"]["saved_graph"]] == saved
    for run in (first, second):
        torch.testing.assert_close(run["compiled"], run["eager"], rtol=1e-5, atol=1e-6)
        assert (run["report"]["graphs"], run["report"]["recompiles"]) == (1, 0)
    assert second["compiled"] == first["compiled"]  # the very kernels the first process compiled
    # A script started in the cache folder imports the installed package: nothing there is a folder Python could take
    # for it (one named "fabriclite" did: "cannot import name 'Fabric' from 'fabriclite' (unknown location)" under
    # an editable install, which finds the package after the folders on the path).
    assert not any(entry.name.isidentifier() for entry in Path(folder).iterdir() if entry.name.startswith("fabriclite"))
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    started_there = subprocess.run(
        [sys.executable, "-c", "from fabriclite import Fabric"], cwd=folder, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert started_there.returncode == 0, started_there.stderr


@pytest.mark.torch_versions
@pytest.mark.skipif(not precompile_supported(), reason="fabriclite saves compiled graphs from torch 2.11 on")
def test_a_saved_graph_is_compiled_again_when_the_models_code_or_its_blocks_change(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.syspath_prepend(str(tmp_path))

    def towers(source):
        (tmp_path / "towers.py").write_text(source)
        sys.modules.pop("towers", None)  # a fresh import of the edited file, as a new process would do
        return importlib.import_module("towers")

    def run(module, scale=1.0, single=False):
        compiled, eager = module.Tower(), module.Tower()
        for block in [*compiled.blocks, *eager.blocks]:
            block.scale = scale
        fabric = Fabric(accelerator="cpu", compile=True)
        losses = module.train(fabric, compiled)
        torch.testing.assert_close(losses, module.train(Fabric(accelerator="cpu"), eager), rtol=1e-5, atol=1e-6)
        if single:  # a batch of 1: the saved graph's guards refuse it (Dynamo specializes size 1), compiled anew
            x = torch.randn(1, 6)
            torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-6)
            assert fabric.compile_report()[0]["recompiles"] == 1
        return fabric.compile_report()[0]["saved_graph"]

    monkeypatch.setitem(sys.modules, "towers", None)  # removed again after the test
    assert run(towers(TOWERS)) == "compiled"
    # Same class, same attributes, one line of its forward changed: Dynamo's guards would pass the old graph.
    relu = TOWERS.replace("nn.functional.gelu(self.norm(x))", "torch.relu(self.norm(x))")
    assert run(towers(relu)) == "compiled"
    assert run(towers(relu), single=True) == "loaded"
    assert run(towers(relu), scale=0.5) == "compiled"  # an attribute the graph was specialized on


def test_setup_compile_overrides_the_fabric_default():
    fabric = Fabric(accelerator="cpu", compile=EAGER)
    plain = train(fabric, compile=False)
    assert type(plain._forward_module).__name__ != "OptimizedModule"
    assert fabric.compile_report() == []
    compiled = train(Fabric(accelerator="cpu"), compile=EAGER)
    assert type(compiled._forward_module).__name__ == "OptimizedModule"


def test_state_dict_keys_stay_the_models_under_compile():
    model = net()
    keys = list(model.state_dict())
    wrapped = Fabric(accelerator="cpu", compile=EAGER).setup(model)
    assert list(wrapped.state_dict()) == keys


@pytest.mark.torch_versions
def test_a_model_compiled_by_the_user_keeps_working_and_is_not_compiled_twice():
    fabric = Fabric(accelerator="cpu", compile=EAGER)
    model = net()
    keys = list(model.state_dict())
    user_compiled = torch.compile(model, backend="aot_eager")
    wrapped = fabric.setup(user_compiled)
    assert wrapped._forward_module is user_compiled
    assert wrapped.module is model
    assert list(wrapped.state_dict()) == keys
    assert wrapped(torch.randn(2, 6)).shape == (2, 3)
    with pytest.raises(ValueError, match="should be passed only once"):
        fabric.setup(wrapped)


@pytest.mark.torch_versions
def test_graph_breaks_are_counted_with_their_reason():
    fabric = Fabric(accelerator="cpu", compile=EAGER)
    model = fabric.setup(Chatty())
    model(torch.randn(2, 6))
    (report,) = fabric.compile_report()
    assert report["graph_breaks"] >= 1 and report["graphs"] >= 2
    assert any("print" in reason or "builtin" in reason for reason in report["break_reasons"])


@pytest.mark.torch_versions
def test_each_model_reports_only_what_was_compiled_for_it():
    fabric = Fabric(accelerator="cpu", compile=EAGER)
    tower = fabric.setup(Tower())
    chatty = fabric.setup(Chatty())
    chatty(torch.randn(4, 6))  # compiled before the tower's first call: two graphs and a break, not the tower's
    tower(torch.randn(4, 6)).sum().backward()
    tower(torch.randn(1, 6)).sum().backward()  # the tower's one recompile: Dynamo specializes a batch of 1
    chatty(torch.randn(4, 6))
    tower_report, chatty_report = fabric.compile_report()
    assert (tower_report["graphs"], tower_report["graph_breaks"], tower_report["recompiles"]) == (1, 0, 1)
    assert (chatty_report["graphs"], chatty_report["graph_breaks"], chatty_report["recompiles"]) == (2, 1, 0)
    assert tower_report["break_reasons"] == [] and len(chatty_report["break_reasons"]) == 1


def test_a_second_model_of_the_same_code_runs_the_first_ones_graphs():
    fabric = Fabric(accelerator="cpu", compile=EAGER)
    first, second = fabric.setup(Tower()), fabric.setup(Tower())
    first(torch.randn(4, 6))
    second(torch.randn(4, 6))
    assert [report["graphs"] for report in fabric.compile_report()] == [1, 0]  # counted where it was compiled


def test_recompiling_every_step_warns_and_points_at_dynamic():
    fabric = Fabric(accelerator="cpu", compile={**EAGER, "dynamic": False})
    with pytest.warns(UserWarning, match="dynamic"):
        train(fabric, steps=5, shapes=[2, 3, 4, 5, 6])
    assert fabric.compile_report()[0]["recompiles"] >= 3


def test_fixed_shapes_do_not_warn():
    fabric = Fabric(accelerator="cpu", compile=EAGER)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(fabric, steps=5)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ({"mdoe": "max-autotune"}, ValueError, "Did you mean 'mode'"),
        (7, TypeError, "compile=7"),
        ("yes", TypeError, "compile='yes'"),
        ({"regional": "no"}, TypeError, "'regional' must be True or False, got 'no'"),
        ({"mode": "max-autotune", "options": {"trace.enabled": True}}, ValueError, "both 'mode' and 'options'"),
    ],
)
def test_bad_compile_arguments_are_refused(value, error, message):
    with pytest.raises(error, match=message):
        Fabric(accelerator="cpu", compile=value)


def test_fabriclite_never_patches_torch_compile():
    # Taken here, not at import: Lightning's wrappers module, which other tests import, replaces torch.compile.
    before = torch.compile
    train(Fabric(accelerator="cpu", compile=EAGER))
    assert torch.compile is before
    importing = "import torch; c = torch.compile; import fabriclite, fabriclite.kernels; print(torch.compile is c)"
    assert run_python("-c", importing, timeout=120).stdout.strip() == "True"


@pytest.mark.torch_versions
def test_compile_with_kernels_leaves_the_norms_to_inductor_and_says_so(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from fabriclite.kernels import _common

    fabric = Fabric(accelerator="cpu", kernels=True, compile=EAGER)
    before = _common.LAUNCHES.copy()
    with pytest.warns(UserWarning, match="under compile=True"):
        model = train(fabric, steps=2)
    assert type(model.module[2]) is nn.LayerNorm
    launched = {name for name, count in _common.LAUNCHES.items() if count > before.get(name, 0)}
    assert not launched, launched
    assert fabric.compile_report()[0]["graph_breaks"] == 0


WORKERS = """
import sys, torch
from torch._inductor.async_compile import AsyncCompile
from fabriclite import Fabric
from fabriclite._versions import warm_compile_workers

def started():  # whether this process has started Inductor's pool of compile workers (torch makes it once)
    return AsyncCompile.process_pool.cache_info().currsize > 0

class CudaStrategy:  # a stand-in: Fabric's CUDA branch, on a machine without a GPU
    root_device = torch.device("cuda", 0)
    setup_environment = announce = lambda self: None

fabric = Fabric(accelerator="cpu", compile=True)
print("cpu", started())
fabric._strategy = CudaStrategy()
fabric._compile = {"backend": "eager"}
fabric._join()
print("cuda eager", started())
if sys.argv[1] == "cuda inductor":
    fabric._compile = {}
    fabric._join()
else:
    warm_compile_workers()
print(sys.argv[1], started())
AsyncCompile.wait_pool_ready(timeout=240)  # and its workers come up (they import torch: a while when loaded)
print("ready", AsyncCompile.use_process_pool())
"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["cuda inductor", "direct"])
def test_a_process_that_will_compile_for_a_gpu_starts_inductors_workers_when_it_joins_the_run(how):
    # Without it the first compile's Triton kernels compile one by one in the process until the workers are up.
    # Only where Inductor compiles Triton for a GPU: not on a CPU (C++ in threads), not for another backend. Two
    # compile threads, as on any machine with more than one core (Inductor's default is one per core).
    done = run_python("-c", WORKERS, how, timeout=540, TORCHINDUCTOR_COMPILE_THREADS="2")
    assert done.stdout.splitlines() == ["cpu False", "cuda eager False", f"{how} True", "ready True"], (
        done.stdout + done.stderr
    )


def test_one_compile_thread_starts_no_workers():
    code = "from fabriclite._versions import warm_compile_workers; print(warm_compile_workers())"
    done = run_python("-c", code, TORCHINDUCTOR_COMPILE_THREADS="1", timeout=300)
    assert done.stdout.split() == ["False"], done.stdout
