import pickle

import pytest
import torch
from torch import nn

from fabriclite import Fabric


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.flag = False

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))

    def describe(self):
        return "net"


@pytest.fixture
def fabric():
    return Fabric(accelerator="cpu")


def test_setup_returns_the_module_alone_without_optimizers(fabric):
    model = fabric.setup(Net())
    assert isinstance(model, nn.Module)
    assert not isinstance(model, tuple)


def test_setup_returns_a_tuple_with_optimizers_and_scheduler(fabric):
    net = Net()
    opt1, opt2 = torch.optim.SGD(net.body.parameters(), lr=0.1), torch.optim.Adam(net.head.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt1, step_size=1)
    out = fabric.setup(net, opt1, opt2, scheduler=scheduler)
    assert len(out) == 4 and out[3] is scheduler
    assert isinstance(out[1], torch.optim.SGD) and isinstance(out[2], torch.optim.Adam)


def test_state_dict_keys_are_the_original_models(fabric):
    net = Net()
    model = fabric.setup(net)
    assert list(model.state_dict()) == list(net.state_dict())
    model.load_state_dict({k: torch.zeros_like(v) for k, v in net.state_dict().items()})
    assert torch.count_nonzero(net.body.weight) == 0


def test_attribute_access_and_assignment_pass_through(fabric):
    net = Net()
    model = fabric.setup(net)
    assert model.describe() == "net"
    assert model.body is net.body
    model.flag = True
    assert net.flag is True
    assert model.module is net


def test_wrapped_optimizer_is_an_instance_of_the_users_class_and_shares_state(fabric):
    net = Net()
    raw = torch.optim.AdamW(net.parameters(), lr=0.5)
    _, opt = fabric.setup(net, raw)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups is raw.param_groups
    assert opt.optimizer is raw
    opt.param_groups[0]["lr"] = 0.25
    assert raw.param_groups[0]["lr"] == 0.25


@pytest.mark.parametrize("built_on", ["raw", "wrapped"])
def test_a_scheduler_on_either_optimizer_drives_the_same_groups(fabric, built_on):
    net = Net()
    raw = torch.optim.SGD(net.parameters(), lr=1.0)
    model, opt = fabric.setup(net, raw)
    scheduler = torch.optim.lr_scheduler.StepLR(raw if built_on == "raw" else opt, step_size=1, gamma=0.5)
    for _ in range(3):
        fabric.backward(model(torch.randn(2, 4)).sum())
        opt.step()
        opt.zero_grad()
        scheduler.step()
    assert raw.param_groups[0]["lr"] == pytest.approx(0.125)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.125)


def test_scheduler_keeps_driving_the_optimizer_after_load_state_dict(fabric):
    net = Net()
    raw = torch.optim.SGD(net.parameters(), lr=1.0)
    _, opt = fabric.setup(net, raw)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.load_state_dict(raw.state_dict())  # replaces param_groups on the inner optimizer
    opt.step()
    scheduler.step()
    assert raw.param_groups[0]["lr"] == pytest.approx(0.5)


def test_setting_up_a_wrapped_model_again_is_refused(fabric):
    model = fabric.setup(Net())
    with pytest.raises(ValueError, match="should be passed only once"):
        fabric.setup(model)


def test_setting_up_the_same_optimizer_twice_is_refused(fabric):
    net = Net()
    _, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="should be passed only once"):
        fabric.setup_optimizers(opt)


def test_setup_refuses_what_is_not_a_module_or_optimizer(fabric):
    with pytest.raises(TypeError, match="torch.nn.Module"):
        fabric.setup("model")
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        fabric.setup(Net(), "optimizer")


def test_setup_optimizers_returns_one_or_a_tuple(fabric):
    net = Net()
    one = fabric.setup_optimizers(torch.optim.SGD(net.parameters(), lr=0.1))
    assert isinstance(one, torch.optim.SGD)
    two = fabric.setup_optimizers(
        torch.optim.SGD(net.body.parameters(), lr=0.1), torch.optim.SGD(net.head.parameters(), lr=0.1)
    )
    assert isinstance(two, tuple) and len(two) == 2


def test_optimizer_state_dict_round_trips_through_the_wrapper(fabric):
    net = Net()
    _, opt = fabric.setup(net, torch.optim.Adam(net.parameters()))
    net(torch.randn(3, 4)).sum().backward()
    opt.step()
    state = opt.state_dict()
    assert state["state"], "Adam keeps moments after a step"
    fresh_net = Net()
    _, fresh = Fabric(accelerator="cpu").setup(fresh_net, torch.optim.Adam(fresh_net.parameters()))
    fresh.load_state_dict(state)
    assert torch.equal(fresh.state[fresh_net.body.weight]["exp_avg"], opt.state[net.body.weight]["exp_avg"])


def test_wrapped_optimizer_pickles_as_its_state(fabric):
    net = Net()
    _, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert "param_groups" in opt.__getstate__()
    pickle.dumps(opt.state_dict())


def test_no_backward_sync_needs_the_wrapped_model(fabric):
    net = Net()
    model = fabric.setup(net)
    with fabric.no_backward_sync(model):
        pass
    with pytest.raises(TypeError, match="fabric.setup"), fabric.no_backward_sync(net):
        pass


def test_hooks_registered_on_the_wrapped_model_run(fabric):
    net = Net()
    model = fabric.setup(net)
    seen = []
    handle = model.register_forward_hook(lambda module, args, out: seen.append(module))
    model.register_forward_pre_hook(lambda module, args: seen.append("pre"))
    model(torch.randn(2, 4))
    assert seen == ["pre", net]
    handle.remove()
    model(torch.randn(2, 4))
    assert seen == ["pre", net, "pre"]
