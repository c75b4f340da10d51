import pytest

from fabriclite import Fabric
from fabriclite.choices import parse_devices, parse_precision


@pytest.mark.parametrize(
    ("kwargs", "named", "suggestion"),
    [
        ({"accelerator": "cdua"}, "'cdua'", "Did you mean 'cuda'?"),
        ({"accelerator": "tpu"}, "'tpu'", "'mps'"),
        ({"strategy": "dpp"}, "'dpp'", "Did you mean 'ddp'?"),
        ({"strategy": "fdsp"}, "'fdsp'", "Did you mean 'fsdp'?"),
        ({"precision": "bf61-mixed"}, "'bf61-mixed'", "Did you mean 'bf16-mixed'?"),
        ({"precision": "8-true"}, "'8-true'", "'32-true'"),
        ({"precision": 8}, "8", "'16-mixed'"),
    ],
)
def test_an_unknown_choice_names_the_value_the_choices_and_the_closest_match(kwargs, named, suggestion):
    with pytest.raises(ValueError) as err:
        Fabric(**kwargs)
    message = str(err.value)
    assert named in message
    assert "Valid choices" in message
    assert suggestion in message


@pytest.mark.parametrize("devices", [0, -2, "x", "0,a", [0, 0], [-1], [], True, 1.5, None])
def test_invalid_devices_are_refused_with_the_value_in_the_message(devices):
    with pytest.raises(ValueError, match="devices="):
        Fabric(accelerator="cpu", devices=devices)


@pytest.mark.parametrize(
    ("value", "parsed"),
    [(1, 1), ("2", 2), ("-1", -1), (-1, -1), ("0,1", [0, 1]), ("1,", [1]), ([0, 2], [0, 2]), ("AUTO", "auto")],
)
def test_devices_accept_lightning_forms(value, parsed):
    assert parse_devices(value) == parsed


@pytest.mark.parametrize(
    ("value", "canonical"),
    [
        (None, "32-true"),
        (32, "32-true"),
        ("32", "32-true"),
        (64, "64-true"),
        ("64", "64-true"),
        (16, "16-mixed"),
        ("16", "16-mixed"),
        ("bf16", "bf16-mixed"),
        ("BF16-Mixed", "bf16-mixed"),
        ("16-true", "16-true"),
        ("bf16-true", "bf16-true"),
    ],
)
def test_precision_aliases_map_to_canonical_names(value, canonical):
    assert parse_precision(value) == canonical


def test_strings_are_case_insensitive():
    fabric = Fabric(accelerator="CPU", strategy="Single_Device", devices="1", precision="32-TRUE")
    assert fabric.device.type == "cpu"
    assert fabric.world_size == 1


def test_fsdp_selects_the_fsdp_strategy_also_on_one_process():
    from fabriclite.strategies import FSDPStrategy

    for devices in (1, 2):
        assert isinstance(Fabric(accelerator="cpu", strategy="FSDP", devices=devices).strategy, FSDPStrategy)


@pytest.mark.parametrize(
    ("strategy", "start_method", "ddp_kwargs"),
    [
        ("DDP", "subprocess", {}),
        ("ddp_spawn", "spawn", {}),
        ("auto", "subprocess", {}),
        ("ddp_fork", "fork", {}),
        ("ddp_notebook", "fork", {}),
        ("ddp_find_unused_parameters_true", "subprocess", {"find_unused_parameters": True}),
        ("ddp_find_unused_parameters_false", "subprocess", {"find_unused_parameters": False}),
        ("ddp_spawn_find_unused_parameters_true", "spawn", {"find_unused_parameters": True}),
        ("ddp_notebook_find_unused_parameters_false", "fork", {"find_unused_parameters": False}),
    ],
)
def test_ddp_names_select_ddp_with_their_start_method_and_ddp_settings(strategy, start_method, ddp_kwargs):
    from fabriclite.strategies import DDPStrategy

    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2)
    assert isinstance(fabric.strategy, DDPStrategy)
    assert fabric.strategy.start_method == start_method
    assert fabric.strategy.ddp_kwargs == ddp_kwargs
    assert fabric.world_size == 2 and fabric.global_rank == 0


def test_fsdp_cpu_offload_selects_fsdp_keeping_the_shards_in_cpu_memory():
    from fabriclite.strategies import FSDPStrategy

    strategy = Fabric(accelerator="cpu", strategy="fsdp_cpu_offload", devices=2).strategy
    assert isinstance(strategy, FSDPStrategy) and strategy.cpu_offload is True


def test_an_unknown_start_method_is_refused_with_the_valid_ones():
    from fabriclite.strategies import DDPStrategy

    with pytest.raises(
        ValueError, match="start_method='forkserver' is not supported. Valid choices: 'subprocess', 'popen'"
    ):
        DDPStrategy(start_method="forkserver")


def test_single_device_with_two_devices_is_refused():
    with pytest.raises(ValueError, match="single_device"):
        Fabric(accelerator="cpu", strategy="single_device", devices=2)


@pytest.mark.parametrize("num_nodes", [0, -1, "2", 1.0])
def test_invalid_num_nodes_is_refused(num_nodes):
    with pytest.raises(ValueError, match="num_nodes="):
        Fabric(accelerator="cpu", num_nodes=num_nodes)


def test_cpu_refuses_a_list_of_devices():
    with pytest.raises(ValueError, match="accelerator='cpu'"):
        Fabric(accelerator="cpu", devices=[0, 1])


def test_cuda_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        Fabric(accelerator="cuda")


def test_plugins_other_than_precision_are_refused():
    with pytest.raises(ValueError, match="plugins="):
        Fabric(accelerator="cpu", plugins=["something"])
