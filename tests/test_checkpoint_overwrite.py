"""fabric.save replaces only a checkpoint it wrote: random mixtures of files, folders, symbolic links and read-only
entries at the target path, saved onto as one file and as a sharded folder; after every attempt every file that was
not ours is still there, byte for byte. Then the same on 2 FSDP processes (gloo)."""

import os
import pickle
import random
import shutil
import stat
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, assert_passed, run_python
from torch import nn

from fabriclite import Fabric
from fabriclite import checkpoint
from fabriclite.checkpoint import CheckpointError, check_replaceable, describe, is_checkpoint


def save(fabric, path, state, sharded):
    if sharded:  # the FSDP folder format, written by the one process there is
        checkpoint.save(path, checkpoint.to_checkpoint(state), fabric._strategy, sharded=True)
    else:
        fabric.save(path, state)


def snapshot(root: Path) -> dict:
    """Every entry under ``root`` (links not followed): its kind, bytes or link target, and mode."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            entry = Path(folder) / name
            info = entry.lstat()
            if stat.S_ISLNK(info.st_mode):
                found[entry] = ("link", os.readlink(entry))
            elif stat.S_ISDIR(info.st_mode):
                found[entry] = ("folder", stat.S_IMODE(info.st_mode))
            else:
                found[entry] = ("file", entry.read_bytes(), stat.S_IMODE(info.st_mode))
    return found


class Occupants:
    """Puts a random thing at a path and says whether it is ours (a checkpoint fabric.save wrote) or the user's."""

    def __init__(self, rng: random.Random, templates: Path) -> None:
        self.rng = rng
        self.templates = templates

    def place(self, path: Path, depth: int = 0) -> bool:
        kinds = ["text", "binary", "empty file", "zip", "pickle", "folder", "link", "dangling link", "our file"]
        kinds += ["our folder", "our folder with a user file", "empty folder"] if depth == 0 else []
        kind = self.rng.choice(kinds)
        ours = kind in ("our file", "our folder", "empty folder")
        if kind == "text":
            path.write_text("".join(self.rng.choice("abc \n") for _ in range(self.rng.randint(1, 300))))
        elif kind == "binary":
            path.write_bytes(self.rng.randbytes(self.rng.randint(1, 3000)))
        elif kind == "empty file":
            path.write_bytes(b"")
        elif kind == "zip":
            with zipfile.ZipFile(path, "w") as archive:
                archive.writestr("notes/readme.txt", "mine")
        elif kind == "pickle":
            path.write_bytes(pickle.dumps({"mine": [1, 2, 3]}))
        elif kind == "folder":
            path.mkdir()
            for i in range(self.rng.randint(1, 4)):
                self.place(path / f"entry{i}{self.rng.choice(['.txt', '.ckpt', ''])}", depth + 1)
        elif kind == "empty folder":
            path.mkdir()
        elif kind == "link":
            other = path.with_name(path.name + ".target")
            other.write_text("the file the link points to")
            path.symlink_to(other.name)
        elif kind == "dangling link":
            path.symlink_to("nowhere")
        elif kind == "our file":
            shutil.copyfile(self.templates / "file.ckpt", path)
        else:
            shutil.copytree(self.templates / "sharded.ckpt", path)
            if kind == "our folder with a user file":
                (path / "notes.txt").write_text("added by hand")
        if kind not in ("link", "dangling link") and self.rng.random() < 0.3:
            path.chmod(0o555 if path.is_dir() else 0o444)  # read-only (root may write anyway: the check must hold)
        return ours


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    folder = tmp_path_factory.mktemp("templates")
    fabric = Fabric(accelerator="cpu")
    model = nn.Linear(3, 2)
    save(fabric, folder / "file.ckpt", {"model": model, "step": -1}, sharded=False)
    save(fabric, folder / "sharded.ckpt", {"model": model, "step": -1}, sharded=True)
    return folder


def make_writable(root: Path) -> None:
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            entry = Path(folder) / name
            if not entry.is_symlink():
                entry.chmod(0o755 if entry.is_dir() else 0o644)


@pytest.mark.parametrize("sharded", [False, True], ids=["one file", "sharded folder"])
def test_random_occupants_of_the_target_path_are_kept_byte_for_byte_unless_ours(tmp_path, templates, sharded):
    fabric = Fabric(accelerator="cpu")
    model = nn.Linear(3, 2)
    refused = replaced = 0
    for seed in range(40):
        rng = random.Random(seed)
        root = tmp_path / f"case{seed}"
        root.mkdir()
        (root / "neighbour.txt").write_text("beside the target")
        target = root / rng.choice(["last.ckpt", "ckpts", "run"])
        ours = Occupants(rng, templates).place(target)
        before, what = snapshot(root), describe(target)
        try:
            save(fabric, target, {"model": model, "step": seed}, sharded)
            error = None
        except CheckpointError as caught:
            error = caught
        after = snapshot(root)
        if ours:
            assert error is None, f"seed {seed}: {target} held a checkpoint of ours ({what}): {error}"
            assert fabric.load(target)["step"] == seed
            # Everything but the replaced checkpoint is untouched.
            assert {k: v for k, v in after.items() if target not in (k, *k.parents)} == {
                k: v for k, v in before.items() if target not in (k, *k.parents)
            }
            replaced += 1
        else:
            assert error is not None, f"seed {seed}: saved over {target}, which held the user's {what}"
            assert error.reason == "occupied" and error.path == str(target) and str(target) in str(error)
            assert after == before, f"seed {seed}: the save changed the user's files"
            assert not [p for p in root.iterdir() if ".tmp-" in p.name], "a partial save was left behind"
            refused += 1
        make_writable(root)
    assert refused > 10 and replaced > 5  # both outcomes were exercised


@pytest.mark.parametrize("sharded", [False, True], ids=["one file", "sharded folder"])
def test_saving_onto_a_folder_of_user_files_is_refused_naming_the_path_and_its_entries(tmp_path, sharded):
    fabric = Fabric(accelerator="cpu")
    folder = tmp_path / "ckpts"
    folder.mkdir()
    (folder / "a.txt").write_text("my notes")
    (folder / "data").mkdir()
    with pytest.raises(CheckpointError, match=r"ckpts.*a folder with 2 entries: a\.txt, data/") as caught:
        save(fabric, folder, {"model": nn.Linear(3, 2)}, sharded)
    assert caught.value.reason == "occupied"
    assert (folder / "a.txt").read_text() == "my notes" and (folder / "data").is_dir()
    save(fabric, folder / "last.ckpt", {"step": 1}, sharded)  # inside the folder is fine
    assert fabric.load(folder / "last.ckpt")["step"] == 1 and (folder / "a.txt").exists()


def test_a_checkpoint_of_ours_is_replaced_in_either_format(tmp_path):
    fabric = Fabric(accelerator="cpu")
    path = tmp_path / "last.ckpt"
    for step, sharded in enumerate([False, False, True, True, False]):
        save(fabric, path, {"step": step}, sharded)
        assert fabric.load(path)["step"] == step and path.is_dir() == sharded
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_what_is_at_a_path_is_described_and_judged(tmp_path, templates):
    (tmp_path / "log.txt").write_text("epoch 1 loss 0.3\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(templates / "file.ckpt")
    assert describe(tmp_path / "log.txt") == "a text file of 17 bytes beginning 'epoch 1 loss 0.3'"
    assert describe(tmp_path / "empty") == "an empty folder"
    assert describe(tmp_path / "missing") == "nothing"
    assert describe(tmp_path / "link").startswith("a symbolic link to ")
    assert describe(templates / "file.ckpt").startswith("a checkpoint file of ")
    assert describe(templates / "sharded.ckpt").startswith("a sharded checkpoint folder with 4 entries")
    assert is_checkpoint(templates / "file.ckpt") and is_checkpoint(templates / "sharded.ckpt")
    assert not any(is_checkpoint(tmp_path / name) for name in ["log.txt", "empty", "missing", "link"])
    torch.save({"w": torch.zeros(2)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    assert is_checkpoint(tmp_path / "legacy.pt")
    for name in ["empty", "missing", "legacy.pt"]:
        check_replaceable(tmp_path / name)
    for name in ["log.txt", "link"]:
        with pytest.raises(CheckpointError, match="Nothing was changed"):
            check_replaceable(tmp_path / name)


def test_consolidate_never_replaces_a_users_file(tmp_path, templates):
    out = tmp_path / "model.pt"
    out.write_text("my own notes")
    with pytest.raises(CheckpointError, match="text file"):
        checkpoint.consolidate(templates / "sharded.ckpt", out)
    assert out.read_text() == "my own notes"


def test_fsdp_saves_on_two_processes_never_replace_a_users_files(tmp_path):
    out = run_python(str(SCRIPTS / "fsdp_save_occupied.py"), str(tmp_path), timeout=300).stdout
    assert_passed(
        out,
        [
            "sharded: a folder of user files is refused on every rank",
            "sharded: the user's files are kept byte for byte",
            "full: a folder of user files is refused on every rank",
            "full: the user's files are kept byte for byte",
            "sharded: a text file is refused on every rank",
            "our own checkpoint folder is replaced",
            "our own checkpoint file is replaced",
            "sharded: loading into a model of another shape is a CheckpointError and a RuntimeError naming the shapes",
        ],
    )
