"""Checkpoints nobody can corrupt, poison or leak: damage is detected before anything loads, a sharded folder cannot
run code or read outside itself, every failure is one ``CheckpointError``, files follow the umask, a full disk says
so and leaves nothing behind, and killed saves do not leak partial files."""

import io
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
import zlib

import pytest
import torch
from helpers import SCRIPTS, assert_passed, python_env, run_on_small_disk, run_python
from torch import nn
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from fabriclite import Fabric
from fabriclite import checkpoint as ckpt
from fabriclite.checkpoint import CheckpointError, atomic_save, consolidate
from fabriclite.checkpoint.files import partial_path, remove_stale_partials

MARKER_ENV = "FABRICLITE_TEST_MARKER"


class Payload:
    """Unpickling it creates the file named by $FABRICLITE_TEST_MARKER: proof that a checkpoint ran code."""

    def __reduce__(self):
        return (exec, (f"open(__import__('os').environ[{MARKER_ENV!r}], 'w').write('ran')",))


def linear(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(256, 256)


def save_sharded(path, model):
    """A sharded folder as FSDP writes it (DCP shards, structure.pt, manifest.json), here from one process."""
    fabric = Fabric(accelerator="cpu")
    ckpt.save(path, ckpt.to_checkpoint({"model": model, "step": 7}), fabric.strategy, sharded=True)


def flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def rewrite_manifest(folder):
    """What an attacker who edits a folder does next: recompute the checksums (with zlib, not fabriclite)."""
    import json

    manifest = json.loads((folder / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        data = (folder / name).read_bytes()
        entry.update({"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"})
    (folder / "manifest.json").write_text(json.dumps(manifest))


def read_metadata(folder):
    with open(folder / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own, trusted folder


def write_metadata(folder, metadata):
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def weight_key(metadata):
    return next(key for key in metadata.state_dict_metadata if key.endswith("model/weight"))


def raises_checkpoint_error(reason, path, fn):
    with pytest.raises(CheckpointError) as caught:
        fn()
    assert caught.value.reason == reason, str(caught.value)
    assert str(path) in str(caught.value)
    assert isinstance(caught.value, Exception)
    return caught.value


# ---------------------------------------------------------------------- 1. integrity
def test_a_flipped_bit_in_a_checkpoint_file_is_refused_before_the_model_changes(tmp_path):
    path = tmp_path / "last.ckpt"
    fabric = Fabric(accelerator="cpu")
    fabric.save(path, {"model": linear(0)})
    flip_byte(path, path.stat().st_size // 2)  # inside the 256 KB weight
    model = linear(1)
    before = model.weight.detach().clone()
    error = raises_checkpoint_error("corrupt", path, lambda: fabric.load(path, {"model": model}))
    assert "data/0" in str(error) and "verify=False" in str(error)
    assert torch.equal(model.weight, before)
    fabric.load(path, {"model": model}, verify=False)  # the user's choice: load it anyway
    assert 0 < (model.weight - linear(0).weight).abs().max() < 1


def test_a_flipped_bit_in_a_plain_torch_save_file_is_refused_by_load_raw(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save(linear(0).state_dict(), path)
    flip_byte(path, path.stat().st_size // 2)
    raises_checkpoint_error("corrupt", path, lambda: Fabric(accelerator="cpu").load_raw(path, linear(1)))


def test_a_flipped_bit_in_a_shard_is_refused_naming_the_shard(tmp_path):
    path = tmp_path / "last.ckpt"
    save_sharded(path, linear(0))
    shard = path / "__0_0.distcp"
    flip_byte(shard, shard.stat().st_size // 2)
    model = linear(1)
    before = model.weight.detach().clone()
    error = raises_checkpoint_error("corrupt", path, lambda: Fabric(accelerator="cpu").load(path, {"model": model}))
    assert "__0_0.distcp" in str(error)
    assert torch.equal(model.weight, before)


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("delete shard", "incomplete"),
        ("cut shard", "truncated"),
        ("cut metadata", "truncated"),
        ("delete manifest", "incomplete"),
    ],
)
def test_a_damaged_sharded_folder_raises_an_exception_that_except_exception_catches(tmp_path, damage, reason):
    path = tmp_path / "last.ckpt"
    save_sharded(path, linear(0))
    target = path / {"delete shard": "__0_0.distcp", "cut shard": "__0_0.distcp"}.get(damage, ".metadata")
    if damage == "delete manifest":
        (path / "manifest.json").unlink()
    elif damage.startswith("delete"):
        target.unlink()
    else:
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    fabric = Fabric(accelerator="cpu")
    raises_checkpoint_error(reason, path, lambda: fabric.load(path, {"model": linear(1)}))
    if damage != "delete manifest":  # without the checksums, DCP's own error must still become a CheckpointError
        with pytest.raises(CheckpointError, match=str(path)):
            fabric.load(path, {"model": linear(1)}, verify=False)


def test_an_intact_sharded_folder_loads_with_and_without_verification(tmp_path):
    path = tmp_path / "last.ckpt"
    save_sharded(path, linear(0))
    for verify in (True, False):
        model = linear(1)
        remainder = Fabric(accelerator="cpu").load(path, {"model": model}, verify=verify)
        assert torch.equal(model.weight, linear(0).weight) and remainder == {"step": 7}


def test_a_saved_file_carries_every_records_crc_where_any_zip_reader_checks_it(tmp_path):
    import zipfile

    path = tmp_path / "c.ckpt"
    atomic_save({"w": torch.randn(300, 300), "empty": torch.zeros(0), "note": "x"}, path)
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None  # Python's own reader recomputes every CRC-32
        records = archive.infolist()
        assert all(r.CRC == zlib.crc32(archive.read(r)) for r in records)
        assert sum(r.CRC != 0 for r in records) >= len(records) - 1  # filled in, not left at zero


def test_the_crc_of_chunks_checked_in_parallel_combines_to_zlibs(tmp_path):
    from fabriclite.checkpoint import integrity

    data = os.urandom(3 * (1 << 20) + 12345)
    (tmp_path / "blob").write_bytes(data)
    chunk = integrity._CHUNK
    integrity._CHUNK = 1 << 20  # several chunks, so the combination is exercised
    try:
        crcs = integrity.crc32_of_ranges(tmp_path / "blob", [(0, len(data)), (17, 2_000_000), (len(data), 0)])
    finally:
        integrity._CHUNK = chunk
    assert crcs == [zlib.crc32(data), zlib.crc32(data[17:2_000_017]), 0]


def test_under_fsdp_on_two_processes_damage_and_rank_zero_failures_raise_on_every_rank(tmp_path):
    result = run_python(str(SCRIPTS / "fsdp_damaged.py"), str(tmp_path), timeout=300)
    assert_passed(
        result.stdout,
        [
            "a flipped byte in another rank's shard is refused",
            "the error names the damaged shard",
            "no weight changed",
            "a save failing on rank 0 raises on every rank",
        ],
    )


# ---------------------------------------------------------------------- 2. safe sharded loading
def poisoned_metadata(folder):
    write_metadata(folder, Payload())


def bytes_item(folder):
    """Only DCP's own classes in .metadata, but the weight declared as "bytes", stored in a file holding a payload."""
    metadata = read_metadata(folder)
    key = weight_key(metadata)
    buffer = io.BytesIO()
    torch.save(Payload(), buffer)
    (folder / "__0_1.distcp").write_bytes(buffer.getvalue())
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data = {i: s for i, s in metadata.storage_data.items() if i.fqn != key}
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo("__0_1.distcp", 0, len(buffer.getvalue()))
    write_metadata(folder, metadata)


def outside_path(folder, absolute=False):
    """Only DCP's own classes, but every tensor read from a copy of the shards outside the folder."""
    elsewhere = folder.parent / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(folder / "__0_0.distcp", elsewhere / "__0_0.distcp")
    metadata = read_metadata(folder)
    relative = str(elsewhere / "__0_0.distcp") if absolute else "../elsewhere/__0_0.distcp"
    for info in metadata.storage_data.values():
        info.relative_path = relative
    write_metadata(folder, metadata)


ATTACKS = {
    "pickle in .metadata": poisoned_metadata,
    "bytes item": bytes_item,
    "relative path out": outside_path,
    "absolute path": lambda folder: outside_path(folder, absolute=True),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
@pytest.mark.parametrize("verify", [True, False])
def test_a_tampered_sharded_folder_runs_no_code_and_reads_nothing_outside(tmp_path, monkeypatch, attack, verify):
    path = tmp_path / "last.ckpt"
    save_sharded(path, linear(0))
    ATTACKS[attack](path)
    rewrite_manifest(path)  # the checksums match: only the safety rules stand in the way
    marker = tmp_path / "ran"
    monkeypatch.setenv(MARKER_ENV, str(marker))
    model = linear(1)
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointError) as caught:
        Fabric(accelerator="cpu").load(path, {"model": model}, verify=verify)
    assert caught.value.reason == "unsafe", str(caught.value)
    assert not marker.exists()
    assert torch.equal(model.weight, before)
    with pytest.raises(CheckpointError, match="unsafe|refus"):
        consolidate(path, tmp_path / "out.pt", verify=verify)
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


def test_consolidate_on_the_command_line_prints_the_problem_and_exits_1_without_a_traceback(tmp_path):
    path = tmp_path / "last.ckpt"
    save_sharded(path, linear(0))
    poisoned_metadata(path)
    rewrite_manifest(path)
    marker = tmp_path / "ran"
    for extra in ([], ["--no-verify"]):
        result = run_python(
            "-m",
            "fabriclite.cli",
            "consolidate",
            *extra,
            str(path),
            str(tmp_path / "out.pt"),
            check=False,
            **{MARKER_ENV: str(marker)},
        )
        assert result.returncode == 1, result.stderr
        assert "Traceback" not in result.stderr and str(path) in result.stderr and "refusing" in result.stderr
    (path / "__0_0.distcp").unlink()
    result = run_python("-m", "fabriclite.cli", "consolidate", str(path), str(tmp_path / "out.pt"), check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr and "missing" in result.stderr
    assert not marker.exists()


# ---------------------------------------------------------------------- 4. modes follow the umask
@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o002, 0o664, 0o775)])
def test_saved_files_and_folders_follow_the_umask(tmp_path, umask, file_mode, dir_mode):
    result = run_python(str(SCRIPTS / "checkpoint_modes.py"), str(tmp_path), oct(umask), timeout=180)
    modes = dict(line.split()[1:] for line in result.stdout.splitlines() if line.startswith("MODE "))
    assert modes, result.stdout
    for name, mode in modes.items():
        expected = dir_mode if (tmp_path / name).is_dir() else file_mode
        assert int(mode, 8) == expected, f"{name}: {mode}, expected {oct(expected)}\n{result.stdout}"
    assert {
        "single.ckpt",
        "nested",
        "nested/sharded.ckpt",
        "nested/sharded.ckpt/.metadata",
        "nested/sharded.ckpt/manifest.json",
        "nested/sharded.ckpt/__0_0.distcp",
        "consolidated.pt",
    } <= modes.keys()


# ---------------------------------------------------------------------- 5. a full disk
@pytest.mark.parametrize("sharded", [False, True])
def test_a_full_disk_says_so_keeps_the_previous_checkpoint_and_leaves_nothing_behind(tmp_path, sharded):
    result = run_on_small_disk(tmp_path, "2m", "checkpoint_disk_full.py", "sharded" if sharded else "file")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS disk full" in result.stdout, result.stdout + result.stderr


# ---------------------------------------------------------------------- 6. killed saves
def test_a_save_removes_the_partial_files_of_killed_saves_and_keeps_those_of_running_ones(tmp_path):
    path = tmp_path / "last.ckpt"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    host = socket.gethostname()
    stale = [
        tmp_path / f".last.ckpt.tmp-{host}-{dead.pid}-0a1b2c3d",  # a killed single-file save
        tmp_path / f".last.ckpt.tmp-{host}-{dead.pid}-0a1b2c3e.old",  # a killed replace
    ]
    stale[0].write_bytes(b"x" * 1000)
    (stale[1]).mkdir()
    (stale[1] / "__0_0.distcp").write_bytes(b"x")
    kept = [
        partial_path(path),  # this process: a save still running
        tmp_path / f".last.ckpt.tmp-another-host-{dead.pid}-0a1b2c3d",  # cannot tell from here
        tmp_path / ".other.ckpt.tmp-x-1-00",  # another checkpoint's
    ]
    for other in kept:
        other.write_bytes(b"y")
    atomic_save({"a": 1}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["last.ckpt", *(p.name for p in kept)])
    remove_stale_partials(path)
    assert all(p.exists() for p in kept)


def test_three_killed_saves_then_one_normal_save_leave_only_the_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    killed_mid_write = 0
    for _ in range(3):
        child = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "save_forever.py"), str(path)],
            stdout=subprocess.PIPE,
            text=True,
            env=python_env(),
        )
        try:
            assert child.stdout.readline().strip() == "saved"
            for _ in range(20000):  # until a partial file of this child is being written, then kill
                if any(name.startswith(".last.ckpt.tmp-") and size > 1 << 20 for name, size in _sizes(tmp_path)):
                    break
        finally:
            child.kill()
            child.wait(timeout=60)
        killed_mid_write += any(name.startswith(".last.ckpt.tmp-") for name, _ in _sizes(tmp_path))
    assert killed_mid_write >= 1, "no kill landed mid-write; the test proved nothing"
    atomic_save({"version": "final"}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def _sizes(folder):
    found = []
    for name in os.listdir(folder):
        try:
            found.append((name, os.stat(folder / name).st_size))
        except FileNotFoundError:  # renamed into place meanwhile
            pass
    return found


# ---------------------------------------------------------------------- CheckpointIO plugins
class LightningStyleIO:
    """A plugin written against Lightning's signature (no ``verify``), storing checkpoints in a dict."""

    def __init__(self):
        self.files = {}

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.files[str(path)] = checkpoint

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        if str(path) not in self.files:
            raise FileNotFoundError(path)
        if self.files[str(path)] == "broken":
            raise ValueError("bad header")
        return self.files[str(path)]

    def remove_checkpoint(self, path):
        self.files.pop(str(path), None)


def test_a_plugin_without_verify_is_called_without_it_and_its_errors_become_checkpoint_errors(tmp_path):
    from fabriclite.checkpoint import CheckpointIO, CheckpointNotFoundError

    plugin = type("Plugin", (LightningStyleIO, CheckpointIO), {})()
    fabric = Fabric(accelerator="cpu", plugins=[plugin])
    fabric.save(tmp_path / "a.ckpt", {"step": 3})
    state = {"step": 0}
    fabric.load(tmp_path / "a.ckpt", state)
    assert state["step"] == 3
    with pytest.raises(CheckpointNotFoundError, match="b.ckpt") as caught:
        fabric.load(tmp_path / "b.ckpt", state)
    assert isinstance(caught.value, FileNotFoundError) and caught.value.reason == "missing"
    plugin.files[str(tmp_path / "c.ckpt")] = "broken"
    raises_checkpoint_error("unreadable", tmp_path / "c.ckpt", lambda: fabric.load(tmp_path / "c.ckpt", state))


def test_leftovers_of_an_earlier_save_of_this_run_are_removed_on_any_host_and_nothing_else(tmp_path, monkeypatch):
    """A save killed mid-write (a real SIGKILL) leaves its partial file; seen from another machine sharing the folder
    (only its hostname is changed here), the run's next save removes it, for it belongs to an earlier save of the
    run. Another run's partials, and anything not named as ours, stay."""
    monkeypatch.setenv("FABRICLITE_RUN_ID", "run-a")
    folder = tmp_path / "ckpts"
    child = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "save_steps.py"), str(folder)], stdout=subprocess.PIPE, text=True,
        env=python_env(FABRICLITE_RUN_ID="run-a"),
    )  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "saved 1"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not any(size > 1 << 20 for _, size in _partials(folder)):
            time.sleep(0.001)
    finally:
        child.kill()
        child.wait(timeout=60)
    killed = [name for name, _ in _partials(folder)]
    assert killed, "no kill landed mid-write; the test proved nothing"
    host = socket.gethostname()
    elsewhere = [name.replace(f".tmp-{host}-", ".tmp-other-host-", 1) for name in killed]
    for name, moved in zip(killed, elsewhere):
        os.rename(folder / name, folder / moved)
    other_run = partial_path(folder / "step-9.ckpt", ("0" * 12, 1)).name.replace(f"-{host}-", "-other-host-")
    for name in (other_run, ".notes.tmp-other-host-1-ab", "step-log.txt"):
        (folder / name).write_text("not ours to remove\n")
    fabric = Fabric(accelerator="cpu", devices=1)
    state = {"step": 0, "payload": None}
    assert fabric.load_latest(folder, state) is not None
    before = sorted(os.listdir(folder))
    assert set(elsewhere) <= set(before)
    fabric.save(folder / "step-last.ckpt", state)  # the run's next save, under any name
    assert sorted(os.listdir(folder)) == sorted(
        {*before, "step-last.ckpt", other_run, ".notes.tmp-other-host-1-ab", "step-log.txt"} - set(elsewhere)
    )


def test_a_partial_written_inside_a_partials_name_by_a_killed_process_is_removed(tmp_path):
    # Replacing a sharded folder by a file writes the file at the folder's partial name, through a partial of that.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    host = socket.gethostname()
    nested = tmp_path / f"..last.ckpt.tmp-{host}-{dead.pid}-0a1b2c3d.tmp-{host}-{dead.pid}-0a1b2c3e"
    nested.write_bytes(b"x" * 1000)
    atomic_save({"a": 1}, tmp_path / "last.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def _partials(folder):
    return [(name, size) for name, size in _sizes(folder) if ".tmp-" in name]
