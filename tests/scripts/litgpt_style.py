"""A small finetuning program in the shape of LitGPT's (``litgpt/finetune/full.py`` and ``utils.load_checkpoint``),
written against Lightning Fabric's names with ``fabriclite`` imported in their place: ``L.Fabric(...)``,
``FSDPStrategy`` with LitGPT's keyword arguments (FSDP1's ``limit_all_gathers``, ``cpu_offload``), an empty init on
several processes, the pretrained weights loaded with ``fabric.load_raw`` (or ``_lazy_load`` on one process),
gradient accumulation under ``no_backward_sync``, clipping, ``CSVLogger`` and a full final checkpoint.

``python litgpt_style.py OUT DEVICES`` writes ``OUT/losses-DEVICES.json`` and ``OUT/final-DEVICES.pth``; the base
checkpoint ``OUT/lit_model.pth`` is made by the first run. On 2 processes it also runs LitGPT's
``test_no_backward_sync[fsdp]`` with fabriclite's documented gradients (DTensors of the parameter's full shape) and
prints "PASS <rank> <name>".
"""

import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "gpt"))
from model import GPT, Block, GPTConfig  # noqa: E402

import fabriclite as L  # noqa: E402  (LitGPT: import lightning as L)
from fabriclite.loggers import CSVLogger  # noqa: E402
from fabriclite.strategies import FSDPStrategy, ModelParallelStrategy  # noqa: E402
from fabriclite.utilities.load import _lazy_load as lazy_load  # noqa: E402

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
MICRO_BATCH, ACCUMULATION, ITERS = 4, 2, 6


def load_checkpoint(fabric, model, checkpoint_path, strict=True):
    """LitGPT's ``utils.load_checkpoint``, its FSDP branch and its one-device branch."""
    if isinstance(fabric.strategy, FSDPStrategy):
        fabric.load_raw(checkpoint_path, model, strict=strict)
    elif isinstance(fabric.strategy, ModelParallelStrategy):
        raise AssertionError("ModelParallelStrategy is not FSDPStrategy here: LitGPT has its own branch for it")
    else:
        state_dict = lazy_load(checkpoint_path)
        state_dict = state_dict.get("model", state_dict)
        model.load_state_dict(state_dict, strict=strict)


def batches():
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, CONFIG.vocab_size, (ITERS, MICRO_BATCH, CONFIG.block_size + 1), generator=generator)
    return [(row[:, :-1], row[:, 1:]) for row in data]


def main(fabric, out):
    fabric.seed_everything(1337)  # same seed for every process to init model (FSDP)
    with fabric.init_module(empty_init=(fabric.world_size > 1)):
        model = GPT(CONFIG)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0))
    load_checkpoint(fabric, model, out / "lit_model.pth")

    losses = []
    for iter_num, (x, y) in enumerate(batches(), 1):
        # Each rank takes its share of the micro-batch, as a distributed sampler would.
        x, y = x[fabric.global_rank :: fabric.world_size], y[fabric.global_rank :: fabric.world_size]
        is_accumulating = iter_num % ACCUMULATION != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            loss = model(x, y)
            fabric.backward(loss / ACCUMULATION)
        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        fabric.log_dict({"loss": losses[-1], "iter": iter_num}, step=iter_num)

    fabric.save(out / f"final-{fabric.world_size}.pth", {"model": model})
    if fabric.global_rank == 0:
        (out / f"losses-{fabric.world_size}.json").write_text(json.dumps(losses))
    if fabric.world_size > 1:
        no_backward_sync_as_litgpt_tests_it(fabric)


def no_backward_sync_as_litgpt_tests_it(fabric):
    """LitGPT's tests/test_distributed.py::test_no_backward_sync[fsdp], reading the gradient as fabriclite shows it:
    a DTensor of the parameter's full shape, whose local slice is LitGPT's one element."""
    model = torch.nn.Linear(1, fabric.world_size, bias=False, device=fabric.device)
    model = fabric.setup(model)
    for i, enabled in enumerate((True, True, False, True, True, False), 1):
        x = torch.tensor([i * (fabric.local_rank + 1)], device=fabric.device, dtype=torch.float32)
        with fabric.no_backward_sync(model, enabled):
            y = model(x)
            fabric.backward(y.sum())
        if not enabled:
            grad = model.weight.grad
            expected = 9.0 if i == 3 else 22.5
            passed = (
                isinstance(grad, DTensor)
                and grad.shape == model.weight.shape
                and grad.to_local().shape.numel() == 1
                and grad.to_local().item() == expected
                and torch.equal(grad.full_tensor(), torch.full((fabric.world_size, 1), expected))
            )
            if not passed:
                raise AssertionError(f"iteration {i}: gradient {grad!r}")
            model.weight.grad = None
    print(f"PASS {fabric.global_rank} no_backward_sync accumulates and syncs as in LitGPT's test", flush=True)


if __name__ == "__main__":
    out, devices = Path(sys.argv[1]), int(sys.argv[2])
    if devices > 1:
        strategy = FSDPStrategy(
            auto_wrap_policy={Block},
            activation_checkpointing_policy={Block},
            state_dict_type="full",
            limit_all_gathers=True,
            cpu_offload=False,
        )
    else:
        strategy = "auto"
        torch.manual_seed(0)
        torch.save(GPT(CONFIG).state_dict(), out / "lit_model.pth")  # the "pretrained" weights
    logger = CSVLogger(out, name=f"finetune-{devices}", flush_logs_every_n_steps=1)
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy, precision="32-true", loggers=logger)
    fabric.launch(main, out)
