"""The ``fabriclite`` command line: ``fabriclite run`` starts a script on several processes or nodes,
``fabriclite plan`` dry-runs it as one rank (0 unless told) of the world it would have (``fabriclite.plan``),
``fabriclite consolidate`` merges a sharded checkpoint into one file, and ``fabriclite plot`` draws the metrics of
CSVLogger runs side by side.

``run`` checks every setting and exports the ones the script's ``Fabric()`` reads (see ``choices.apply_cli_settings``).
It starts and watches this machine's processes itself (``supervisor``: restarts with ``--max-restarts``,
preemption notices); across machines, one ``fabriclite run`` per node, kept in step through node 0's (``nodes``).
Signals reach it directly and a failed rank gives a non-zero exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

from fabriclite import __version__, choices
from fabriclite.choices import ENV_PREFIX, FABRIC_DEFAULTS, env_name

# Every setting of `fabriclite run`, as a flag (dashes) and as a --config key (underscores), with its help.
RUN_SETTINGS: dict[str, str] = {
    "accelerator": "Hardware for the script's Fabric(): cpu, cuda, gpu, mps or auto (default: auto).",
    "strategy": "Strategy for the script's Fabric(): auto, ddp, fsdp, single_device, or another name Fabric takes (default: auto).",
    "devices": "Processes per node: a count, 'auto' (CPU: 1; CUDA: every visible GPU), -1 (every GPU) or GPU "
    "indices such as 0,1 (default: auto).",
    "num_nodes": "Number of machines (default: 1). Start `fabriclite run` once on each, with its --node-rank.",
    "node_rank": "This machine's rank, 0 .. num_nodes-1 (default: 0).",
    "main_address": "Address of the node with rank 0, which every node can reach. Required with --num-nodes > 1; "
    "a single node uses a local rendezvous on a free port when neither this nor --main-port is given.",
    "main_port": "Port on the main node (default with several nodes: 29500, torchrun's default). With several "
    "nodes, node 0's `fabriclite run` hosts torch's c10d rendezvous on it.",
    "precision": "Precision for the script's Fabric(), e.g. 32-true, bf16-mixed, 16-mixed, bf16-true, fp8-mixed "
    "(default: Fabric's own, 32-true).",
    "state_dict_type": "Checkpoint format under --strategy fsdp (or a ModelParallelStrategy): sharded, a folder "
    "every process writes its shards into, or full, one consolidated file (FSDPStrategy's state_dict_type; "
    "default: the strategy's own, sharded).",
    "max_restarts": "How often every process is started again after one died, before giving up (default: 0). The "
    "script resumes with fabric.load_latest(folder, state).",
    "node_timeout": "Seconds the nodes wait for each other to join, at the start and after a restart: a node lost "
    "for that long ends the run (torch's rendezvous join timeout; default: 600; only with --num-nodes > 1).",
}
# What `fabriclite plan` takes of them: the settings the script's Fabric() reads (none about reaching other nodes).
PLAN_SETTINGS = ("accelerator", "strategy", "devices", "num_nodes", "precision", "state_dict_type")
_INT_SETTINGS = ("num_nodes", "node_rank", "main_port", "max_restarts", "node_timeout")
_STR_SETTINGS = ("accelerator", "strategy", "main_address", "state_dict_type")
_DEFAULT_MULTI_NODE_PORT = 29500

_RUN_EPILOG = """\
Settings come from --config FILE.yaml (the same names with underscores, e.g. `num_nodes: 2`), overridden by
the flags. accelerator, strategy, devices, num_nodes, precision and state_dict_type reach the script's Fabric()
through FABRICLITE_CLI_* environment variables: a Fabric argument (or the strategy's state_dict_type) left at its
default takes the CLI's value, the same value spelled differently is accepted, and a different value raises an
error naming both.

Options go before the script; everything after the script is passed to it unchanged.

`fabriclite run` starts and watches the processes of its machine itself; across machines, every node runs torch's
elastic agent (torchrun's) with the c10d rendezvous that node 0 hosts on --main-port. When one process fails, every
process on every node is stopped and, with --max-restarts N, all start again (up to N times); then every
`fabriclite run` exits with the failed process's exit code (128 + N when it died of signal N). A node lost for 600 s
(--node-timeout) ends the run.
SIGTERM or SIGUSR1 (a preemption notice) reaches every process and sets fabric.preempted; once they saved and
exited, `fabriclite run` exits with 75 ("preempted, resumable"), or requeues the SLURM job where allowed.

Examples:
  fabriclite run --accelerator cpu --devices 2 train.py --lr 0.1
  fabriclite run --config run.yaml --precision bf16-mixed train.py
  fabriclite run --devices 8 --strategy fsdp --state-dict-type full train.py
  # two machines; on the second one, --node-rank 1:
  fabriclite run --num-nodes 2 --node-rank 0 --devices 8 --main-address 10.0.0.1 train.py
"""


_PLAN_EPILOG = """\
The script runs as it would under `fabriclite run` with the same settings, until its optimizers stepped twice:
whatever it does before (reading data, making log folders) it does. Values it reads from tensors (a loss it
prints) are stand-ins. Exit code: 0 when the steps ran and fit --device-memory, 1 when the run would fail or not
fit, 2 for bad arguments.

Examples:
  fabriclite plan --devices 8 --num-nodes 128 --strategy fsdp --device-memory 80GiB train.py --batch-size 4
  fabriclite plan --devices 2 --json examples/gpt/train.py --quick
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``fabriclite`` command. Usage: ``build_parser().parse_args(["run", "x.py"])``."""
    parser = argparse.ArgumentParser(
        prog="fabriclite", description="Run fabriclite scripts on several processes or machines."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{run,plan,consolidate,plot}")

    run = commands.add_parser(
        "run",
        help="Start a script on every device of one or several machines.",
        description="Start SCRIPT once per device on this machine (and join the other machines of a multi-node "
        "run), watch the processes, and restart them all when one dies (--max-restarts).",
        epilog=_RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_settings(run, RUN_SETTINGS, "The Python script to run in every process.")
    run.set_defaults(handler=_run, subparser=run)

    plan = commands.add_parser(
        "plan",
        help="Dry-run a script as one rank of the run it would be: configuration, errors, memory per rank.",
        description="Run SCRIPT unchanged as global rank 0 (or --rank) of devices x num_nodes processes, in this "
        "one process, "
        "on fake tensors and torch's fake process group (no GPU, nothing started), through its first two "
        "optimizer steps; print the configuration fabriclite resolved, the error the real run would raise, and "
        "the rank's peak memory split into parameters, gradients, optimizer state and activations. docs/plan.md.",
        epilog=_PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_settings(plan, PLAN_SETTINGS, "The Python script to plan.")
    plan.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="The memory of one device, e.g. 80GiB or 141GB: the plan says whether the rank's peak fits in it "
        "(exit code 1 when it does not), the largest micro-batch per rank that fits (tracing the script again with "
        "its loaders' batch size changed), and what to change when not even 1 fits.",
    )
    plan.add_argument(
        "--rank",
        metavar="N",
        help="The global rank to plan as (default 0). The report lists the kinds of rank, ranks whose shards of "
        "the model differ (the last ranks of an uneven split, tensor-parallel positions); plan one of each.",
    )
    plan.add_argument(
        "--every-kind",
        action="store_true",
        help="Then plan the lowest rank of each other kind of rank too, one plan each (as long as the first), and "
        "print them all: exit code 0 only when every kind fits.",
    )
    plan.add_argument(
        "--json",
        action="store_true",
        help="Print the plan as one JSON object instead of text (with --every-kind, the other kinds' plans under "
        '"other_kinds").',
    )
    plan.set_defaults(handler=_plan, subparser=plan)

    consolidate = commands.add_parser(
        "consolidate",
        help="Merge a sharded (FSDP) checkpoint folder into one checkpoint file.",
        description="Merge the sharded checkpoint that fabric.save wrote under FSDP into a single file that "
        "torch.load (and a one-process Fabric) can read.",
    )
    consolidate.add_argument("sharded_dir", metavar="SHARDED_DIR", help="Folder of the sharded checkpoint.")
    consolidate.add_argument("out_file", metavar="OUT_FILE", help="The single checkpoint file to write.")
    consolidate.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="Skip checking the folder's files against the checksums in its manifest.json.",
    )
    consolidate.set_defaults(handler=_consolidate, subparser=consolidate)

    plot = commands.add_parser(
        "plot",
        help="Draw the metrics that CSVLogger wrote, one line per run, to compare runs.",
        description="Draw every metric of one or more CSVLogger runs (their metrics.csv) in its own subplot, with "
        "one line per run, into an image.",
        epilog="Examples:\n  fabriclite plot logs/gpt -o curves.png\n"
        "  fabriclite plot logs/gpt/version_0 logs/gpt/version_3 -o cmp.svg --metrics loss,accuracy",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plot.add_argument(
        "logdirs",
        nargs="+",
        metavar="LOGDIR",
        help="A metrics.csv file, a version_N folder, or any folder above: every metrics.csv below it is one run.",
    )
    plot.add_argument("-o", "--output", required=True, metavar="FILE", help="The image to write: .png, .pdf or .svg.")
    plot.add_argument("--metrics", help="Comma-separated metrics to draw (default: every numeric column).")
    plot.add_argument("--x", default="step", help="The column for the x axis (default: step).")
    plot.set_defaults(handler=_plot, subparser=plot)
    return parser


def _add_settings(command: argparse.ArgumentParser, keys: Any, script_help: str) -> None:
    # --config, one flag per setting in `keys`, then the script and everything after it (which the script gets).
    command.add_argument("--config", metavar="FILE.yaml", help="YAML file with any of the settings below.")
    for key in keys:
        flag = f"--{key.replace('_', '-')}"
        command.add_argument(flag, dest=key, type=int if key in _INT_SETTINGS else str, help=RUN_SETTINGS[key])
    command.add_argument("script", nargs="?", help=script_help)
    command.add_argument("script_args", nargs=argparse.REMAINDER, help="Arguments passed on to the script.")


def check_setting(key: str, value: Any) -> Any:
    """Return the canonical value of one ``fabriclite run`` setting, or raise a ``ValueError`` saying what is valid.

    Usage: ``check_setting("precision", "BF16-Mixed") == "bf16-mixed"``.
    """
    if key not in RUN_SETTINGS:
        valid = ", ".join(RUN_SETTINGS)
        raise ValueError(
            f"Unknown setting {key!r}. Valid settings: {valid}.{choices.did_you_mean(key, list(RUN_SETTINGS))}"
        )
    if key in _STR_SETTINGS and not isinstance(value, str):
        raise ValueError(f"{key}={value!r} must be a string.")
    if key in _INT_SETTINGS and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{key}={value!r} must be an integer.")
    if key == "strategy":  # the names live with the strategies
        from fabriclite.strategies import parse_strategy

        return parse_strategy(value)
    if key in choices.PARSERS:
        return choices.PARSERS[key](value)
    if key == "state_dict_type":
        return choices.parse_state_dict_type(value)
    if key == "main_address" and not value.strip():
        raise ValueError(f"main_address={value!r} must name the main node, e.g. 10.0.0.1 or node01.")
    if key == "main_port" and not 0 < value < 65536:
        raise ValueError(f"main_port={value} is not a TCP port: expected 1 .. 65535.")
    if key in ("node_rank", "max_restarts") and value < 0:
        raise ValueError(f"{key}={value} must be 0 or more.")
    if key == "node_timeout" and value < 1:
        raise ValueError(f"node_timeout={value} must be 1 second or more.")
    return value


def load_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check a ``--config`` YAML file; return its settings in canonical form.

    Usage: ``load_config("run.yaml") == {"devices": 2, "precision": "bf16-mixed"}``.
    """
    import yaml  # only `fabriclite run --config` needs it

    path = Path(path)
    try:
        content = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ValueError(f"--config {path}: cannot read it ({error.strerror or error}).") from None
    except yaml.YAMLError as error:
        raise ValueError(f"--config {path} is not valid YAML: {error}") from None
    if content is None:
        return {}
    if not isinstance(content, dict):
        raise ValueError(f"--config {path} must hold a mapping such as `devices: 2`, not {type(content).__name__}.")
    try:
        return {key: check_setting(key, value) for key, value in content.items()}
    except ValueError as error:
        raise ValueError(f"--config {path}: {error}") from None


def resolve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings of one ``fabriclite run``: the config file's, overridden by the flags given, all checked.

    Only settings somebody gave appear. Usage: ``resolve_settings(build_parser().parse_args(["run", "x.py"]))``.
    """
    settings = load_config(args.config) if args.config else {}
    for key in RUN_SETTINGS:
        value = getattr(args, key)
        if value is not None:
            settings[key] = check_setting(key, value)
    num_nodes = settings.get("num_nodes", 1)
    node_rank = settings.get("node_rank", 0)
    if node_rank >= num_nodes:
        raise ValueError(f"node_rank={node_rank} must be below num_nodes={num_nodes}.")
    if num_nodes > 1 and "main_address" not in settings:
        raise ValueError(
            f"num_nodes={num_nodes} needs --main-address: the address of the node with --node-rank 0, "
            "reachable from every node."
        )
    return settings


def fabric_environment(settings: dict[str, Any]) -> dict[str, str]:
    """The ``FABRICLITE_CLI_*`` variables that carry the settings to the script's ``Fabric()``.

    Usage: ``fabric_environment({"devices": [0, 1]}) == {"FABRICLITE_CLI_DEVICES": "0,1"}``.
    """
    env = {}
    for key in (*FABRIC_DEFAULTS, "state_dict_type"):
        if key not in settings:
            continue
        value = settings[key]
        if isinstance(value, list):  # "0," is the one-element list; "0" would be zero devices
            value = ",".join(str(index) for index in value) + ("," if len(value) == 1 else "")
        env[env_name(key)] = str(value)
    return env


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        settings = resolve_settings(args)
        if args.script is None:
            raise ValueError(
                "no script to run: name it after the options, e.g. `fabriclite run --devices 2 train.py --lr 0.1` "
                "(what follows the script goes to the script)."
            )
        if not Path(args.script).is_file():
            raise ValueError(f"script {args.script!r} does not exist (relative paths start at {os.getcwd()}).")
        from fabriclite.accelerators import select_accelerator

        # The devices of one node, chosen as the script's Fabric will choose them: one process per device.
        accelerator = select_accelerator(
            settings.get("accelerator", FABRIC_DEFAULTS["accelerator"]),
            settings.get("devices", FABRIC_DEFAULTS["devices"]),
        )
    except (ValueError, RuntimeError) as error:
        parser.error(str(error))  # exits with code 2; nothing was started
    processes = len(accelerator.device_indices)
    if accelerator.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        from fabriclite.plugins.environments import cpu_threads_per_process

        # torchrun would give every process 1 thread; share the cores out instead, as fabric.launch() does.
        os.environ["OMP_NUM_THREADS"] = str(cpu_threads_per_process(processes))
    for name in [name for name in os.environ if name.startswith(ENV_PREFIX)]:
        del os.environ[name]  # a run inside a run must not inherit the outer run's settings
    os.environ.update(fabric_environment(settings))
    command = [sys.executable, args.script, *args.script_args]
    address, port = settings.get("main_address", "127.0.0.1"), settings.get("main_port")
    if settings.get("num_nodes", 1) > 1:  # torch's elastic agent on every node; node 0 hosts the rendezvous
        from fabriclite.processes.nodes import JOIN_TIMEOUT_S, NodeRun

        return NodeRun(
            command,
            processes,
            settings["num_nodes"],
            settings.get("node_rank", 0),
            address,
            port or _DEFAULT_MULTI_NODE_PORT,
            max_restarts=settings.get("max_restarts", 0),
            join_timeout=settings.get("node_timeout", JOIN_TIMEOUT_S),
        ).run()
    from fabriclite.processes.supervisor import Supervisor

    return Supervisor(command, processes, settings.get("max_restarts", 0), port=port, address=address).run()


def _plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from fabriclite.plan import parse_bytes, plan_script

    try:
        settings = load_config(args.config) if args.config else {}
        unknown = sorted(set(settings) - set(PLAN_SETTINGS))
        if unknown:
            raise ValueError(f"--config {args.config}: {', '.join(unknown)} is for `fabriclite run`, not for plan.")
        for key in PLAN_SETTINGS:
            if getattr(args, key) is not None:
                settings[key] = check_setting(key, getattr(args, key))
        devices = settings.pop("devices", 1)
        if not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices={devices!r}: a plan needs a count of processes per node, e.g. --devices 8.")
        num_nodes = settings.pop("num_nodes", 1)
        memory = None if args.device_memory is None else parse_bytes(args.device_memory)
        rank = args.rank or "0"
        if not rank.isdigit() or int(rank) >= devices * num_nodes:
            raise ValueError(
                f"--rank {rank}: expected a global rank of the {devices} x {num_nodes} processes planned, "
                f"0 to {devices * num_nodes - 1}."
            )
        if args.script is None:
            raise ValueError(
                "no script to plan: name it after the options, e.g. `fabriclite plan --devices 8 train.py`."
            )
        if not Path(args.script).is_file():
            raise ValueError(f"script {args.script!r} does not exist (relative paths start at {os.getcwd()}).")
    except ValueError as error:
        parser.error(str(error))  # exits with code 2; nothing ran
    for name in [name for name in os.environ if name.startswith(ENV_PREFIX)]:
        del os.environ[name]  # a plan inside a run must not inherit the run's settings
    # With --json, what the script prints goes to stderr: stdout carries the JSON object alone.
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        environment = fabric_environment(settings)
        plans = [plan_script(args.script, args.script_args, devices, num_nodes, memory, environment, rank=int(rank))]
        others = [kind["ranks"][0] for kind in plans[0].kinds or () if int(rank) not in kind["ranks"]]
        for other in others if args.every_kind else ():
            plans.append(
                plan_script(args.script, args.script_args, devices, num_nodes, memory, environment, rank=other)
            )
    if args.json:
        import json

        found = plans[0].to_dict()
        if args.every_kind:
            found["other_kinds"] = [plan.to_dict() for plan in plans[1:]]
        print(json.dumps(found))
    else:
        print("\n\n".join(plan.format() for plan in plans))
    return 0 if all(plan.ok for plan in plans) else 1


def _consolidate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from fabriclite.checkpoint import CheckpointError, consolidate

    try:
        consolidate(args.sharded_dir, args.out_file, verify=args.verify)
    except CheckpointError as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    return 0


def _plot(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from fabriclite.plot import plot_runs

    metrics = None if args.metrics is None else [name.strip() for name in args.metrics.split(",") if name.strip()]
    try:
        plot_runs(args.logdirs, args.output, metrics=metrics, x=args.x)
    except ValueError as error:
        parser.error(str(error))  # exits with code 2, like every other bad argument
    except (ImportError, OSError) as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fabriclite`` command; returns the exit code.

    Usage: ``fabriclite run --devices 2 train.py`` in a shell, or ``main(["run", "--devices", "2", "train.py"])``.
    """
    args = build_parser().parse_args(argv)
    return args.handler(args.subparser, args)


if __name__ == "__main__":
    sys.exit(main())
