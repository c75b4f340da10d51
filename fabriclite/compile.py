"""``torch.compile`` as one switch: which arguments it takes, what gets compiled, and a report of what the
compiler did.

What gets compiled (``compile_model``): by default each repeated block of the model (the transformer blocks of a
``nn.ModuleList``), in place, as torchtitan and PyTorch's regional-compilation recipe do. The blocks share one
code object, so Dynamo compiles the first and reuses its graph for the siblings: a 12-block model compiles about
as fast as one block. A model without repeated blocks, or ``compile={"regional": False}``, is compiled whole.
Unless ``dynamic`` is given, the batch dimension of each compiled call's tensor inputs is marked dynamic, so a
last partial batch or a new evaluation batch size runs the graph already compiled.

Evaluation compiles nothing more: the blocks are compiled for the way the model first runs. A model whose first
call trains (train mode, gradients on) runs its blocks eagerly whenever it does not train (``model.eval()``,
``torch.no_grad()``), as the uncompiled model would (dropout off in eval mode): switching to evaluation and back
compiles no second graph, at the price of an uncompiled evaluation. A model whose first call does not train (an
inference-only model, or an evaluation before training) compiles what it runs, once per mode.

Waiting less on a CPU: Inductor checks in every process which vector instruction sets the C++ compiler can build
and load (six child processes that each load libtorch: about a second of CPU here). ``compile_model`` runs that
check once per cache folder, torch, compiler and CPU, keeps the result in the cache folder, and where every set
passed tells Inductor so (``cpp.vec_isa_ok``) in every process from the first on, so that the cached graphs, whose
keys include that setting, keep matching. Even with every graph cached, a new process still imports Inductor's
compiler, hashes torch's sources for the cache keys and traces the block: where torch can save a compiled function
(2.11 and newer), ``_SavedGraph`` compiles the blocks' graph ahead of time on the first training call, keeps it in
the cache folder, and later processes load it, as long as the sources it was traced from and its guards still match.

The report counts what the compiler did for one model: each model is compiled through its own ``_CountingBackend``,
the backend ``torch.compile`` would build from the same arguments, which counts the graphs Dynamo hands it and the
graph breaks that split them (as ``torch._dynamo.explain`` does). TorchDynamo's own counters are the process's, so
two compiled models would report each other's graphs. Counting costs nothing per step: the backend runs only when
Dynamo compiles. It is a diagnosis, not a gate.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from fabriclite._blocks import repeated_blocks
from fabriclite._versions import (
    compile_backend,
    current_compile_id,
    default_compile_backend,
    inductor_cache_dir,
    inductor_options,
    inductor_vec_isa_all_pass,
    inductor_vec_isa_fingerprint,
    is_inductor_backend,
    maybe_mark_dynamic,
    module_call_hooks,
    precompile,
    precompile_supported,
    precompiled_from_bytes,
    precompiled_guards_pass,
    precompiled_sources,
    precompiled_to_bytes,
)

# After this many forward calls the watch stops: recompiling still then means shapes change every step.
_WATCHED_CALLS = 8
_RECOMPILES_BEFORE_WARNING = 3
# Kinds of inputs (dtypes, whether they need gradients) a class of blocks gets saved graphs for, at most.
_SAVED_KINDS = 4
# fabriclite's folder in Inductor's cache folder: not a name Python can import, so that a script started in the cache
# folder still imports the installed package (a folder named "fabriclite" there shadowed an editable install).
_CACHE_FOLDER = "fabriclite-compile"


# fabriclite's own keys in a compile dict, next to torch.compile's arguments.
_OWN_KEYS = ("regional",)


def compile_kwargs(value: Any, where: str = "compile") -> dict[str, Any] | None:
    """Turn ``compile=False | True | dict`` into keyword arguments for ``torch.compile`` plus fabriclite's own
    ``regional`` (None: don't compile).

    Usage: ``compile_kwargs({"mode": "max-autotune"}) == {"mode": "max-autotune"}``.
    """
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, dict):
        if not isinstance(value.get("regional", True), bool):
            raise TypeError(f"{where}: 'regional' must be True or False, got {value['regional']!r}.")
        valid = [name for name in inspect.signature(torch.compile).parameters if name != "model"] + list(_OWN_KEYS)
        unknown = [key for key in value if key not in valid]
        if unknown:
            from fabriclite.choices import did_you_mean

            raise ValueError(
                f"{where}={value!r} has keys torch.compile does not take: {unknown}. Valid keys: "
                f"{', '.join(valid)}.{did_you_mean(unknown[0], valid)}"
            )
        if value.get("mode") is not None and value.get("options") is not None:
            raise ValueError(
                f"{where}={value!r} gives both 'mode' and 'options'; torch.compile takes one of them. Put the mode's "
                "settings into 'options' (torch._inductor.list_mode_options(mode) lists them), or drop 'options'."
            )
        return dict(value)
    raise TypeError(f"{where}={value!r} is not valid: expected False, True or a dict of torch.compile arguments.")


def compile_model(
    forward_module: torch.nn.Module, original: torch.nn.Module, strategy: Any, options: dict[str, Any]
) -> tuple[torch.nn.Module, CompileWatch]:
    """Compile ``original``'s repeated blocks in place, or, without them or with ``regional=False``, the whole
    ``forward_module`` through the strategy (around DDP; per FSDP unit, then the root). Returns the module that
    runs and the watch that counts what the compiler did for this model.

    Usage: ``forward_module, watch = compile_model(ddp_model, model, strategy, {"mode": "max-autotune"})``.
    """
    options = dict(options)
    regional = options.pop("regional", True)
    backend = _CountingBackend(options, strategy.root_device)  # takes backend, mode and options out of ``options``
    options["backend"] = backend
    blocks = _regions(original) if regional else []
    if not blocks:
        watch = CompileWatch(type(original).__name__, backend)
        return strategy.compile_module(forward_module, options), watch
    mark_batch = options.get("dynamic") is None
    names = {id(module): name for name, module in original.named_modules()}
    first_call = _FirstCall()
    # One saved graph per block class (an encoder's blocks and a decoder's are two graphs, as under Dynamo).
    can_save = _can_save(options, mark_batch, backend, strategy, blocks)
    saved = {type(block): _SavedGraph(backend) for block in blocks} if can_save else {}
    for block in blocks:
        _compile_in_place(block, options, mark_batch, first_call, saved.get(type(block)))
    regions = [names[id(block)] for block in blocks]
    return forward_module, CompileWatch(type(original).__name__, backend, regions, list(saved.values()))


class _CountingBackend:
    """The backend ``torch.compile`` builds from ``backend``, ``mode`` and ``options`` (see torch/__init__.py),
    counting the graphs Dynamo hands it and the graph breaks that split them, as ``torch._dynamo.explain``'s
    ``ExplainWithBackend`` does. One per compiled model: the counts are that model's alone.

    Two counting backends around equal torch backends compare equal, so Dynamo lets a second model of the same
    code and arguments run the graphs compiled for the first (as it does without counting); those count where
    they were compiled.
    """

    def __init__(self, options: dict[str, Any], device: torch.device) -> None:
        backend = options.pop("backend", None)
        if backend is None:
            backend = default_compile_backend()
        mode, inductor_options = options.pop("mode", None), options.pop("options", None)
        if inductor_options is not None:
            inductor_options = dict(inductor_options)
            # What torch.compile reads out of ``options`` itself, before building its backend.
            if "guard_filter_fn" in inductor_options:
                options["options"] = {"guard_filter_fn": inductor_options.pop("guard_filter_fn")}
            use_aoti = inductor_options.pop("use_aoti", False)
        else:
            use_aoti = False
            if mode is None:
                mode = "default"
        if backend == "inductor" and device.type == "cpu" and "cpp.vec_isa_ok" not in (inductor_options or {}):
            inductor_options = {**(inductor_options or {}), **_vec_isa_option()}
        dynamic, name = options.get("dynamic"), options.get("name")
        self.inner = compile_backend(backend, mode, inductor_options, dynamic, name, use_aoti)
        self.__name__ = getattr(self.inner, "compiler_name", "backend")  # what Dynamo's logs call the backend
        self.graphs = 0
        self.break_reasons: list[str] = []
        self._compile_ids: set[Any] = set()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable[..., Any]:
        # DDP's optimizer splits one Dynamo graph into buckets, each handed over on its own within one compile.
        compile_id = current_compile_id()
        if compile_id is None or compile_id not in self._compile_ids:
            if compile_id is not None:
                self._compile_ids.add(compile_id)
            self.graphs += 1
        reason = getattr(gm, "compile_subgraph_reason", None)
        if reason is not None and reason.graph_break and not reason.reason.startswith("DDPOptimizer"):
            self.break_reasons.append(reason.reason.splitlines()[0])
        return self.inner(gm, example_inputs, **kwargs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _CountingBackend) and self.inner == other.inner

    __hash__ = object.__hash__

    def __getattr__(self, name: str) -> Any:
        # What Dynamo asks of torch's backend (reset, get_compiler_config, compiler_name).
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _vec_isa_option() -> dict[str, bool]:
    """``{"cpp.vec_isa_ok": True}`` where Inductor's check of the CPU's vector instruction sets passed on this
    machine, torch and compiler, else ``{}`` (Inductor checks in each process, as without fabriclite).

    The check runs here, in setup, the first time (what the first compile would have spent on it), and its result
    is kept in Inductor's cache folder, so later processes skip it. The option is part of the key of every cached
    graph, so it is given from the first process on, never only once the result is known.
    """
    fingerprint = inductor_vec_isa_fingerprint()
    if fingerprint is None:  # not x86-64 Linux, an older torch, or the user set cpp.vec_isa_ok: Inductor decides
        return {}
    name = "vec-isa-" + hashlib.sha256(fingerprint.encode()).hexdigest()[:24]
    record = Path(inductor_cache_dir(), _CACHE_FOLDER, name)
    try:
        passed = record.read_text() == "pass"
    except OSError:
        passed = inductor_vec_isa_all_pass()
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            partial = record.with_name(f"{record.name}.{os.getpid()}")
            partial.write_text("pass" if passed else "fail")
            os.replace(partial, record)  # whole or absent, for the other processes of a launch
        except OSError:  # a cache folder we cannot write to: the next process checks again
            pass
    return {"cpp.vec_isa_ok": True} if passed else {}


def _regions(module: torch.nn.Module) -> list[torch.nn.Module]:
    # A repeated single layer (the Linears of an nn.Sequential MLP) is not worth a region: the rest would run eager.
    return [block for block in repeated_blocks(module) if next(block.children(), None) is not None]


def _can_save(
    options: dict[str, Any], mark_batch: bool, backend: _CountingBackend, strategy: Any, blocks: list[torch.nn.Module]
) -> bool:
    # Where the saved graph is known to be the graph Dynamo would compile: Inductor with its default arguments
    # (mode and options taken), one process on a CPU, blocks without hooks of their own (their forward is all
    # that runs) and with plain tensors (no DTensor, no FSDP).
    return (
        set(options) <= {"backend", "fullgraph", "name"}
        and mark_batch
        and is_inductor_backend(backend.inner)
        and strategy.root_device.type == "cpu"
        and getattr(strategy, "world_size", 1) == 1
        and all(_plain_block(block) for block in blocks)
        and precompile_supported()
    )


def _plain_block(block: torch.nn.Module) -> bool:
    tensors = list(block.parameters()) + list(block.buffers())
    return (
        not module_call_hooks(block)
        and type(block).__call__ is torch.nn.Module.__call__
        and "forward" not in vars(block)  # the class's forward, which takes the block as its first argument
        and all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)
    )


class _SavedGraph:
    """The graphs of one class of a model's blocks, compiled ahead of time on the training calls that need one and
    kept in Inductor's cache folder (``fabriclite-compile/graphs/``), so that the next process that trains the same blocks
    loads them instead of tracing and compiling. Shared by the blocks of the class, as Dynamo's graphs are.

    A saved graph is used only where nothing it was made from changed: the file's name is a hash of torch, Python,
    the block's class, Inductor's options, the kinds of the inputs, the thread count and autocast; every module
    whose code was traced (the model's file, torch's layers) must read exactly as when it was saved; and Dynamo's
    guards (shapes, dtypes, grad mode, the block's attributes such as its number of heads) must pass on each call.
    Otherwise the block is compiled again and the file replaced. A call whose inputs are of a kind seen before but
    that no saved graph's guards accept (a batch of 1), and anything that fails on the way, is left to
    ``torch.compile``, as before.
    """

    def __init__(self, backend: _CountingBackend) -> None:
        self.backend = backend
        self.functions: list[Any] = []
        self.origins: list[str] = []  # "loaded" or "compiled", one per function
        self._kinds_seen: set[Any] = set()

    def find(self, block: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The saved graph for this training call (loaded, or compiled and saved, for inputs of a new kind), or
        None: then the caller compiles just in time."""
        for function in self.functions:
            if precompiled_guards_pass(function, (block, *args), kwargs):
                return function
        try:
            kinds = _input_kinds(args, kwargs)
        except TypeError:  # inputs no key can name
            return None
        if kinds in self._kinds_seen or len(self._kinds_seen) >= _SAVED_KINDS:
            return None
        self._kinds_seen.add(kinds)
        path = self._path(block, kinds)
        function, origin = self._load(path, block, args, kwargs), "loaded"
        if function is None:
            function, origin = self._compile_and_save(path, block, args, kwargs), "compiled"
        if function is not None:
            self.functions.append(function)
            self.origins.append(origin)
            self.backend.graphs += 1  # what Dynamo would have handed the backend
        return function

    def _path(self, block: torch.nn.Module, kinds: Any) -> Path:
        key = repr(
            (
                1,  # this file's format
                torch.__version__,
                torch.__file__,
                sys.version,
                type(block).__module__,
                type(block).__qualname__,
                sorted((name, repr(value)) for name, value in self.backend.inner.config.items()),
                kinds,
            )
        )
        return Path(inductor_cache_dir(), _CACHE_FOLDER, "graphs", hashlib.sha256(key.encode()).hexdigest()[:32])

    def _load(self, path: Path, block: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        try:
            data = path.read_bytes()
        except OSError:
            return None
        try:
            with inductor_options(self.backend.inner.config):
                function = precompiled_from_bytes(data, type(block).forward.__globals__)
            if not _sources_unchanged(function) or not precompiled_guards_pass(function, (block, *args), kwargs):
                return None
        except Exception:  # a file another torch or a broken write left: compile again
            return None
        return function

    def _compile_and_save(self, path: Path, block: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        _mark_batch(args)  # saved graphs are made only where the batch dimension is dynamic (no ``dynamic`` given)
        try:
            function = precompile(block.forward, args, kwargs, self.backend.inner)
            if not any(name == type(block).__module__ for name, _ in precompiled_sources(function)):
                return None  # the block's own code has no source to check later (defined in a string)
            if not precompiled_guards_pass(function, (block, *args), kwargs):
                return None
            data = precompiled_to_bytes(function)
        except Exception:  # a graph break, or code that cannot be saved: torch.compile as before
            return None
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial.write_bytes(data)
            os.replace(partial, path)  # whole or absent for a process reading at the same time
        except OSError:  # a cache folder we cannot write to (or a full disk): this process runs what it compiled
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
        return function


def _input_kinds(args: tuple, kwargs: dict[str, Any]) -> tuple:
    # What a saved graph's key says about a call: each tensor's dtype, device, number of dimensions and whether it
    # needs gradients, the other arguments' values, and the thread count and autocast (both guarded too: scripts
    # that differ only there keep a graph each).
    def kind(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return (str(value.dtype), value.device.type, value.dim(), value.requires_grad)
        if value is None or isinstance(value, (bool, int, float, str)):
            return repr(value)
        raise TypeError(f"no key for {type(value).__name__}")

    named = tuple(sorted((name, kind(value)) for name, value in kwargs.items()))
    return tuple(kind(arg) for arg in args), named, torch.get_num_threads(), torch.is_autocast_enabled("cpu")


def _sources_unchanged(function: Any) -> bool:
    for name, source in precompiled_sources(function):
        module = sys.modules.get(name)
        try:
            if module is None or inspect.getsource(module) != source:
                return False
        except (OSError, TypeError):
            return False
    return True


class _FirstCall:
    """Whether a model's first compiled call trained (train mode, gradients on); None before it. Shared by the
    model's blocks: the first block's call decides for all of them."""

    trains: bool | None = None


def _compile_in_place(
    block: torch.nn.Module,
    options: dict[str, Any],
    mark_batch: bool,
    first_call: _FirstCall,
    saved: _SavedGraph | None,
) -> None:
    # What nn.Module.compile does (the module stays the same object: state_dict keys, hooks and FSDP units keep
    # working), plus marking the batch dimension dynamic before each call, outside the traced code (Dynamo
    # refuses mark_dynamic inside it). A batch of 1 still compiles once more: Dynamo specializes sizes 0 and 1.
    # A model that trained first runs eagerly when it does not train: evaluation would otherwise compile a second
    # graph (Dynamo guards on the grad mode and on ``training``), for a loop that runs far less often.
    # With ``saved``, a training model's blocks run the graphs compiled ahead of time (or loaded from the cache
    # folder) wherever their guards pass; the rest (a batch of 1) is compiled just in time, as before.
    compiled = torch.compile(block._call_impl, **options)
    eager = block._call_impl

    def call(*args: Any, **kwargs: Any) -> Any:
        trains = block.training and torch.is_grad_enabled()
        if first_call.trains is None:
            first_call.trains = trains
        elif first_call.trains and not trains:
            return eager(*args, **kwargs)
        if saved is not None and first_call.trains:  # a model that trained first, training now
            # No batch marking before a saved graph: its guards check that a tensor carries none.
            function = saved.find(block, args, kwargs)
            if function is not None:
                return function(block, *args, **kwargs)
        if mark_batch:
            _mark_batch(args)
        return compiled(*args, **kwargs)

    block._compiled_call_impl = call


def _mark_batch(args: tuple) -> None:
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() > 0:
            maybe_mark_dynamic(arg, 0)


class CompileWatch:
    """What the compiler did for one compiled model, read from its counting backend, and a warning when it
    recompiles on every one of the first steps.

    ``regions``: the names of the compiled blocks (empty: the whole model was compiled). Usage: made by
    ``fabric.setup(..., compile=True)``; read through ``fabric.compile_report()``.
    """

    def __init__(
        self,
        name: str,
        backend: _CountingBackend,
        regions: list[str] | None = None,
        saved: list[_SavedGraph] | None = None,
    ) -> None:
        self.name = name
        self.regions = regions or []
        self._saved = saved or []
        self.calls = 0
        self._backend = backend
        self._graphs_after_first: int | None = None
        self._last_graphs = 0
        self._growth_streak = 0
        self.recompiling_every_step = False

    def wrap(self, forward: Callable[..., Any], stop: Callable[[], None]) -> Callable[..., Any]:
        """``forward`` with counting around it, calling ``stop`` once the watch has seen enough calls."""

        def watched(*args: Any, **kwargs: Any) -> Any:
            output = forward(*args, **kwargs)
            self._after_call()
            if self.calls >= _WATCHED_CALLS:
                stop()
            return output

        return watched

    def _after_call(self) -> None:
        self.calls += 1
        graphs = self._backend.graphs
        if self.calls == 1:
            self._graphs_after_first = graphs
        else:
            self._growth_streak = self._growth_streak + 1 if graphs > self._last_graphs else 0
            if self._growth_streak >= _RECOMPILES_BEFORE_WARNING and not self.recompiling_every_step:
                self.recompiling_every_step = True
                warnings.warn(
                    f"torch.compile recompiled {self.name} on each of the last {self._growth_streak} steps: the input "
                    "shapes probably change every step. Pass compile={'dynamic': True} (or pad inputs to fixed shapes).",
                    UserWarning,
                    stacklevel=4,
                )
        self._last_graphs = graphs

    def report(self) -> dict[str, Any]:
        """This model's graphs after its first forward call, graph breaks so far (with the first line of each
        distinct reason), recompiles since the first call (train/eval switches, new shapes), and the compiled
        regions. Other compiled models in the process do not count here."""
        base = {"model": self.name, "compiled": "regional" if self.regions else "whole", "regions": self.regions}
        # "loaded" where every saved graph was, "compiled" where this process saved one, None for neither.
        origins = {origin for graph in self._saved for origin in graph.origins}
        base["saved_graph"] = "compiled" if "compiled" in origins else "loaded" if origins else None
        if self._graphs_after_first is None:
            return {**base, "calls": 0, "graphs": 0, "graph_breaks": 0, "recompiles": 0, "break_reasons": []}
        reasons = self._backend.break_reasons
        return {
            **base,
            "calls": self.calls,
            "graphs": self._graphs_after_first,
            "graph_breaks": len(reasons),
            "recompiles": self._backend.graphs - self._graphs_after_first,
            "break_reasons": list(dict.fromkeys(reasons)),
        }
