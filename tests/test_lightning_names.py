"""Every name Lightning Fabric user code imports (from its docs and examples) resolves at the same path under
fabriclite, and the strategy strings such code passes are understood: "change only the import" holds for them.
Where Lightning is installed, each path is also checked to exist there, so the list stays Lightning's."""

import importlib

import pytest

from fabriclite import Fabric
from fabriclite.strategies import parse_strategy

NAMES = [
    ("", "Fabric"),
    ("", "seed_everything"),
    ("", "is_wrapped"),
    ("accelerators", "Accelerator"),
    ("accelerators", "CPUAccelerator"),
    ("accelerators", "CUDAAccelerator"),
    ("accelerators", "MPSAccelerator"),
    ("accelerators", "find_usable_cuda_devices"),
    ("accelerators.cuda", "CUDAAccelerator"),
    ("accelerators.cuda", "find_usable_cuda_devices"),
    ("accelerators.mps", "MPSAccelerator"),
    ("strategies", "Strategy"),
    ("strategies", "SingleDeviceStrategy"),
    ("strategies", "DataParallelStrategy"),
    ("strategies", "DDPStrategy"),
    ("strategies", "FSDPStrategy"),
    ("strategies", "ModelParallelStrategy"),
    ("plugins", "Precision"),
    ("plugins", "MixedPrecision"),
    ("plugins", "HalfPrecision"),
    ("plugins", "DoublePrecision"),
    ("plugins", "FSDPPrecision"),
    ("plugins", "CheckpointIO"),
    ("plugins", "TorchCheckpointIO"),
    ("plugins", "BitsandbytesPrecision"),
    ("plugins.precision.bitsandbytes", "BitsandbytesPrecision"),
    ("plugins.precision.bitsandbytes", "_BITSANDBYTES_AVAILABLE"),
    ("plugins", "TransformerEnginePrecision"),
    ("plugins.precision.transformer_engine", "TransformerEnginePrecision"),
    ("plugins.precision.transformer_engine", "_TRANSFORMER_ENGINE_AVAILABLE"),
    ("plugins.collectives", "Collective"),
    ("plugins.collectives", "TorchCollective"),
    ("plugins.collectives", "SingleDeviceCollective"),
    ("plugins.collectives.collective", "CollectibleGroup"),
    ("plugins.collectives.torch_collective", "TorchCollective"),
    ("plugins.environments", "ClusterEnvironment"),
    ("plugins.environments", "LightningEnvironment"),
    ("plugins.environments", "SLURMEnvironment"),
    ("plugins.environments", "TorchElasticEnvironment"),
    ("loggers", "Logger"),
    ("loggers", "CSVLogger"),
    ("loggers", "TensorBoardLogger"),
    ("wrappers", "is_wrapped"),
    ("wrappers", "_unwrap_objects"),
    ("utilities", "rank_zero_only"),
    ("utilities", "move_data_to_device"),
    ("utilities", "AttributeDict"),
    ("utilities", "suggested_max_num_workers"),
    ("utilities", "measure_flops"),
    ("utilities", "Throughput"),
    ("utilities", "ThroughputMonitor"),
    ("utilities.rank_zero", "rank_zero_only"),
    ("utilities.rank_zero", "rank_zero_info"),
    ("utilities.rank_zero", "rank_zero_warn"),
    ("utilities.rank_zero", "rank_zero_deprecation"),
    ("utilities.seed", "seed_everything"),
    ("utilities.seed", "reset_seed"),
    ("utilities.seed", "pl_worker_init_function"),
    ("utilities.apply_func", "apply_to_collection"),
    ("utilities.apply_func", "move_data_to_device"),
    ("utilities.apply_func", "convert_to_tensors"),
    ("utilities.apply_func", "convert_tensors_to_scalars"),
    ("utilities.data", "AttributeDict"),
    ("utilities.data", "suggested_max_num_workers"),
    ("utilities.data", "has_len"),
    ("utilities.data", "has_iterable_dataset"),
    ("utilities.warnings", "PossibleUserWarning"),
    ("utilities.throughput", "measure_flops"),
    ("utilities.throughput", "Throughput"),
    ("utilities.throughput", "ThroughputMonitor"),
    ("utilities.types", "Optimizable"),
    ("utilities.types", "Steppable"),
    ("utilities.types", "_Stateful"),
    ("utilities.types", "CollectibleGroup"),
    ("utilities.types", "ReduceOp"),
    ("utilities.types", "RedOpType"),
    ("utilities.types", "ProcessGroup"),
    ("utilities.types", "_PATH"),
    ("utilities.types", "_DEVICE"),
    ("utilities.types", "_MAP_LOCATION_TYPE"),
    ("utilities.types", "_PARAMETERS"),
    # LitGPT's imports, beyond the documented API
    ("utilities.load", "_lazy_load"),
    ("utilities.load", "_NotYetLoadedTensor"),
    ("utilities.init", "_materialize_meta_tensors"),
    ("utilities.imports", "_IS_WINDOWS"),
    ("utilities.imports", "_TORCH_GREATER_EQUAL_2_3"),
    ("utilities.testing", "_runif_reasons"),
]
STRATEGY_STRINGS = [
    "ddp",
    "ddp_spawn",
    "ddp_fork",
    "ddp_notebook",
    "ddp_find_unused_parameters_true",
    "ddp_find_unused_parameters_false",
    "fsdp",
    "fsdp_cpu_offload",
    "dp",
    "single_device",
]


def _resolve(package: str, module: str, name: str):
    return getattr(importlib.import_module(package + ("." + module if module else "")), name)


@pytest.mark.parametrize(("module", "name"), NAMES, ids=[f"{m or 'fabric'}.{n}" for m, n in NAMES])
def test_a_name_lightning_code_imports_resolves_at_the_same_path(module, name):
    assert _resolve("fabriclite", module, name) is not None
    lightning = pytest.importorskip("lightning.fabric") and "lightning.fabric"
    assert _resolve(lightning, module, name) is not None, "not a Lightning name: drop it from the list"


def test_the_public_fabric_methods_of_lightning_exist_on_ours():
    lightning = pytest.importorskip("lightning.fabric")
    theirs = {name for name in dir(lightning.Fabric) if not name.startswith("_")}
    assert sorted(theirs - set(dir(Fabric))) == []


@pytest.mark.parametrize("strategy", STRATEGY_STRINGS)
def test_a_strategy_string_lightning_code_passes_is_understood(strategy):
    assert parse_strategy(strategy) is not None


def test_is_wrapped_knows_what_setup_returned():
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    from fabriclite import is_wrapped

    fabric = Fabric(accelerator="cpu")
    module, optimizer = nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    loader = DataLoader(range(4), batch_size=2)
    assert not any(is_wrapped(obj) for obj in (module, optimizer, loader))
    model, wrapped_optimizer = fabric.setup(module, optimizer)
    assert is_wrapped(model) and is_wrapped(wrapped_optimizer) and is_wrapped(fabric.setup_dataloaders(loader))
    assert is_wrapped(torch.compile(model)) and not is_wrapped(torch.compile(module))


def test_find_usable_cuda_devices_without_cuda_asks_for_none_or_says_there_are_none():
    import torch

    from fabriclite.accelerators import find_usable_cuda_devices

    assert find_usable_cuda_devices(0) == []
    if torch.cuda.is_available():
        assert len(find_usable_cuda_devices(1)) == 1
        return
    with pytest.raises(ValueError, match="more CUDA devices than this machine shows \\(0\\)"):
        find_usable_cuda_devices(1)
    with pytest.raises(ValueError, match="num_devices=-2 must be"):
        find_usable_cuda_devices(-2)


@pytest.mark.parametrize("root", ["fabriclite", "lightning.fabric"])
def test_the_data_helpers_answer_as_lightnings_do(root):
    from torch.utils.data import DataLoader, IterableDataset

    if root != "fabriclite":
        pytest.importorskip(root)
    data = importlib.import_module(root + ".utilities.data")
    warning = importlib.import_module(root + ".utilities.warnings").PossibleUserWarning

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    class SizedStream(Stream):
        def __len__(self):
            return 3

    assert issubclass(warning, UserWarning)
    assert data.has_len(DataLoader(range(4))) and not data.has_iterable_dataset(DataLoader(range(4)))
    assert not data.has_len(DataLoader(Stream())) and data.has_iterable_dataset(DataLoader(Stream()))
    assert not data.has_iterable_dataset(range(3))  # no .dataset at all
    with pytest.warns(UserWarning, match="returned 0 length"):
        assert data.has_len([])
    with pytest.warns(UserWarning, match="`IterableDataset` has `__len__` defined"):
        assert data.has_len(DataLoader(SizedStream()))


@pytest.mark.parametrize("root", ["fabriclite", "lightning.fabric"])
def test_convert_tensors_to_scalars_walks_collections_and_refuses_a_tensor_of_many(root):
    import torch

    if root != "fabriclite":
        pytest.importorskip(root)
    convert = importlib.import_module(root + ".utilities.apply_func").convert_tensors_to_scalars
    out = convert({"loss": torch.tensor(0.5), "parts": [torch.tensor([2]), 3], "name": "x"})
    assert out == {"loss": 0.5, "parts": [2, 3], "name": "x"} and type(out["parts"][0]) is int
    with pytest.raises(ValueError, match="does not contain a single element, thus it cannot be converted to a scalar"):
        convert({"acc": [torch.ones(2)]})


def test_single_device_strategy_takes_lightnings_device_argument_and_refuses_what_is_not_one():
    import torch

    from fabriclite.plugins import TorchCheckpointIO
    from fabriclite.strategies import SingleDeviceStrategy

    assert SingleDeviceStrategy(device="cuda:1").root_device == torch.device("cuda", 1)  # not its checkpoint_io
    assert SingleDeviceStrategy("cpu").root_device == torch.device("cpu")
    io = TorchCheckpointIO()
    assert SingleDeviceStrategy(checkpoint_io=io).checkpoint_io is io
    fabric = Fabric(accelerator="cpu", strategy=SingleDeviceStrategy(device="cpu"))
    assert fabric.device == torch.device("cpu") and fabric.setup(torch.nn.Linear(1, 1)).device == fabric.device
    with pytest.raises(TypeError, match=r"device=3\.5\) expects a device"):
        SingleDeviceStrategy(3.5)
    with pytest.raises(TypeError, match=r"checkpoint_io='x'\) expects a CheckpointIO"):
        SingleDeviceStrategy(checkpoint_io="x")
    with pytest.raises(ValueError, match=r"device='nowhere'\) is not a device"):
        SingleDeviceStrategy("nowhere")
    with pytest.raises(ValueError, match=r"device='cuda:1'\) is a cuda device, but the accelerator is 'cpu'"):
        Fabric(accelerator="cpu", strategy=SingleDeviceStrategy("cuda:1"))


def test_setup_warns_once_when_the_models_parameters_sit_on_different_devices():
    import warnings

    import torch
    from torch import nn

    from fabriclite.utilities.warnings import PossibleUserWarning

    fabric = Fabric(accelerator="cpu")
    split = nn.Sequential(nn.Linear(1, 2), nn.Linear(2, 2, device="meta"))  # the only second device a CPU has
    match = r"has 2 parameters on different devices \(for example '1.weight' on meta and '0.weight' on cpu\)"
    with pytest.warns(PossibleUserWarning, match=match), pytest.raises(NotImplementedError, match="meta tensor"):
        fabric.setup(split)  # the warning comes before the move that cannot be done
    with warnings.catch_warnings():
        warnings.simplefilter("error", PossibleUserWarning)
        fabric.setup(nn.Sequential(nn.Linear(1, 2), nn.Linear(2, 2, device="meta")), move_to_device=False)
        model = fabric.setup(nn.Linear(1, 2))
        model(torch.ones(1, 1))  # nothing is checked per step


@pytest.mark.parametrize("root", ["fabriclite", "lightning.fabric"])
def test_bitsandbytes_precision_without_the_package_names_it_and_how_to_install_it(root):
    if root != "fabriclite":
        pytest.importorskip(root)
    module = importlib.import_module(root + ".plugins.precision.bitsandbytes")
    if importlib.util.find_spec("bitsandbytes") is not None:
        pytest.skip("bitsandbytes is installed here")
    assert not module._BITSANDBYTES_AVAILABLE
    assert str(module._BITSANDBYTES_AVAILABLE) == (
        "Requirement 'bitsandbytes' not met. HINT: Try running `pip install -U 'bitsandbytes'`"
    )
    with pytest.raises(ModuleNotFoundError, match="Requirement 'bitsandbytes' not met"):
        module.BitsandbytesPrecision("nf4")


@pytest.mark.parametrize("root", ["fabriclite", "lightning.fabric"])
def test_lazy_load_gives_the_saved_tensors_and_refuses_a_missing_file(root, tmp_path):
    import torch

    if root != "fabriclite":
        pytest.importorskip(root)
    load = importlib.import_module(root + ".utilities.load")
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}
    torch.save({"model": state}, tmp_path / "ckpt.pth")
    loaded = load._lazy_load(tmp_path / "ckpt.pth")["model"]
    assert sorted(loaded) == ["b", "w"] and loaded["w"].shape == (2, 3) and loaded["b"].dtype == torch.bfloat16
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])
    assert not isinstance(torch.ones(1), load._NotYetLoadedTensor)
    with pytest.raises(FileNotFoundError):
        load._lazy_load(tmp_path / "missing.pth")


def test_lazy_load_leaves_the_tensors_in_the_file(tmp_path):
    import sys

    import torch

    from fabriclite.utilities.load import _lazy_load

    if not sys.platform.startswith("linux"):
        pytest.skip("reads the process's memory map from /proc")

    def mapped_from(path, tensor):  # the tensor's bytes lie in a mapping of the file, not in fresh memory
        for line in open("/proc/self/maps"):
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if len(fields) == 6 and fields[5] == str(path) and start <= tensor.data_ptr() < end:
                return True
        return False

    torch.save({"w": torch.randn(4, 4)}, tmp_path / "ckpt.pth")
    torch.save({"w": torch.randn(4, 4)}, tmp_path / "old.pth", _use_new_zipfile_serialization=False)
    assert mapped_from(tmp_path / "ckpt.pth", _lazy_load(tmp_path / "ckpt.pth")["w"])
    assert not mapped_from(tmp_path / "old.pth", _lazy_load(tmp_path / "old.pth")["w"])  # the old format: read whole


@pytest.mark.parametrize("root", ["fabriclite", "lightning.fabric"])
def test_materialize_meta_tensors_fills_meta_modules_and_refuses_one_without_reset_parameters(root):
    import torch
    from torch import nn

    if root != "fabriclite":
        pytest.importorskip(root)
    materialize = importlib.import_module(root + ".utilities.init")._materialize_meta_tensors
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    materialize(model, torch.device("cpu"))
    assert all(t.device.type == "cpu" for t in model.state_dict().values())
    assert torch.equal(model[1].weight, torch.ones(4)) and model[0].weight.abs().max() <= 3**-0.5

    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.empty(2, device="meta"))

    with pytest.raises(TypeError, match="`Bare.reset_parameters` method is implemented"):
        materialize(Bare(), torch.device("cpu"))


@pytest.mark.parametrize("root", ["fabriclite", "lightning.fabric"])
def test_runif_reasons_name_what_this_machine_lacks(root, monkeypatch):
    import sys

    import torch

    if root != "fabriclite":
        pytest.importorskip(root)
    reasons_for = importlib.import_module(root + ".utilities.testing")._runif_reasons
    monkeypatch.delenv("PL_RUN_STANDALONE_TESTS", raising=False)
    assert reasons_for() == ([], {})
    gpus = torch.cuda.device_count()
    reasons, kwargs = reasons_for(min_cuda_gpus=gpus + 1, standalone=True, min_torch="99.0", max_torch="1.0")
    assert reasons == [
        f"GPUs>={gpus + 1}",
        f"torch>=99.0, {torch.__version__} installed",
        f"torch<1.0, {torch.__version__} installed",
        "Standalone execution",
    ]
    assert kwargs == {"min_cuda_gpus": True, "standalone": True}
    monkeypatch.setenv("PL_RUN_STANDALONE_TESTS", "1")
    assert reasons_for(standalone=True, min_python=f"{sys.version_info.major}.{sys.version_info.minor}") == (
        [],
        {"standalone": True},
    )


@pytest.mark.parametrize("root", ["fabriclite", "lightning.fabric"])
def test_unwrap_objects_gives_back_what_setup_wrapped(root):
    import torch
    from torch.utils.data import DataLoader

    if root != "fabriclite":
        pytest.importorskip(root)
    package = importlib.import_module(root)
    unwrap = importlib.import_module(root + ".wrappers")._unwrap_objects
    fabric = package.Fabric(accelerator="cpu", devices=1)
    module = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    loader = DataLoader(range(4), batch_size=2)
    model, wrapped_optimizer = fabric.setup(module, optimizer)
    wrapped_loader = fabric.setup_dataloaders(loader)
    assert unwrap(model) is module and unwrap(wrapped_optimizer) is optimizer and unwrap(wrapped_loader) is loader
    assert unwrap({"m": [model], "x": 3}) == {"m": [module], "x": 3} and unwrap(module) is module
    assert unwrap(torch.compile(model)) is module


@pytest.mark.parametrize("root", ["fabriclite", "lightning.fabric"])
def test_the_structural_types_recognise_what_lightnings_do(root):
    import torch

    if root != "fabriclite":
        pytest.importorskip(root)
    types = importlib.import_module(root + ".utilities.types")
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert isinstance(optimizer, types.Optimizable) and isinstance(optimizer, types.Steppable)
    assert isinstance(model, types._Stateful) and isinstance(optimizer, types._Stateful)
    assert not isinstance(model, types.Optimizable) and not isinstance(object(), types._Stateful)
    assert types.ReduceOp.SUM == torch.distributed.ReduceOp.SUM and isinstance(types.ReduceOp.SUM, types.RedOpType)
