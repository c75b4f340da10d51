"""fp8-mixed against bf16-mixed inside the examples' Llama-style GPT (issue 46): the same model and batches trained
through ``Fabric(precision=...)`` in both, compiled (``compile=True``, regional) and eager, at widths 2048 and 4096
(4 layers, 2048-token windows, a 32768-token vocabulary, 2 sequences per batch). The two precisions of one width
and mode run interleaved (in_model.py's rounds), each with its own model and optimizer from the same seed. A row
per variant: the median step time, tokens/s, the ratio to bf16-mixed round by round (above 1: fp8 is faster), the
peak memory, the first step's time (compiling), and the loss after the timed steps.

The issue's goal: at width 4096, compiled, fp8 at least 1.25x bf16-mixed's tokens/s (torchao's headline for 8 GPUs
at 8B parameters). Not measured here: the loss after 200 steps within 1% of bf16-mixed's (too long for the suite).

Usage (from gpu_suite.py's ``fp8`` section): ``run_fp8(table.write, "full", clock.out)``.
"""

from __future__ import annotations

import gc
import statistics
from dataclasses import replace
from typing import Any, Callable

import torch
from in_model import MODEL_SIZES, Variant, measure_group

# (n_embd, n_head) of each width measured; the smoke run's tiny GPT instead.
WIDTHS = {"full": ((2048, 16), (4096, 32)), "quick": ((4096, 32),), "smoke": ((32, 2),)}
GPT = {"block_size": 2048, "vocab_size": 32768, "n_layer": 4}
SMOKE_GPT = {"block_size": 16, "vocab_size": 64, "n_layer": 2}
PRECISIONS = ("bf16-mixed", "fp8-mixed")


def run_fp8(write: Callable[..., None], run: str, out_of_time: Callable[[], bool]) -> None:
    """Measure both precisions at each width, compiled first (the goal's mode), then eager, writing a row per
    variant through ``write(**row)`` (gpu_suite.py's Table)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    for compiled in (True, False):
        for width, heads in WIDTHS[run]:
            gpt = {**(SMOKE_GPT if run == "smoke" else GPT), "n_embd": width, "n_head": heads}
            sizes = replace(MODEL_SIZES[run], gpt=gpt, gpt_batch=2)
            mode = "compiled" if compiled else "eager"
            group = [Variant(f"{mode} {precision}", compiled, (), precision) for precision in PRECISIONS]
            base = {"model": "gpt", "width": width, "compiled": compiled}
            if out_of_time():
                for variant in group:
                    write(**base, variant=variant.name, precision=variant.precision, error="skipped: out of time")
                continue
            measure(write, base, group, sizes, run, device, out_of_time)


def measure(
    write: Callable[..., None],
    base: dict[str, Any],
    group: list[Variant],
    sizes: Any,
    run: str,
    device: torch.device,
    out_of_time: Callable[[], bool],
) -> None:
    runners, results, errors = measure_group("gpt", group, run, device, sizes, out_of_time)
    bf16 = results.get(group[0].name) if group[0].name not in errors else None
    for runner in runners:
        name = runner.variant.name
        if name in errors:
            continue
        times = results[name]["ms"]
        ms = statistics.median(times)
        # fp8's speed-up round by round (both ran back to back in each round), then the median.
        per_round = [b / m for m, b in zip(times, bf16["ms"])] if bf16 else []
        write(**base, variant=name, precision=runner.variant.precision, rounds=len(times),
              steps_per_round=sizes.steps, step_ms=ms, tokens_per_s=1e3 * runner.samples / ms,
              speedup_vs_bf16=statistics.median(per_round) if per_round else "",
              first_step_s=results[name]["first_s"], peak_mib=results[name]["peak_mib"], loss=runner.last_loss(),
              graph_breaks=runner.graph_breaks(), error="")  # fmt: skip
    for name, error in errors.items():
        variant = next(v for v in group if v.name == name)
        write(**base, variant=name, precision=variant.precision, error=error)
    del runners, results
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
