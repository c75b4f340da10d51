"""The README's first command, examples/demo.py, runs end to end: pretrain, save, load, fine-tune, report."""

import re

import pytest
from helpers import ROOT, run_python

DEMO = str(ROOT / "examples" / "demo.py")

pytest.importorskip("sklearn", reason="the demo's data set ships with scikit-learn")


def test_demo_pretrains_saves_loads_and_fine_tunes_well_above_chance(tmp_path):
    weights = tmp_path / "weights" / "vit.pt"
    result = run_python(
        DEMO, "--epochs", "8", "--pretrain-epochs", "5", "--weights", str(weights), "--seed", "0", timeout=240
    )
    out = result.stdout

    assert "pretraining took" in out, out
    assert f"loaded pretrained weights from {weights}" in out, out
    # The atomic write leaves the weights and nothing else (no temporary file) behind.
    assert [p.name for p in weights.parent.iterdir()] == ["vit.pt"]

    match = re.search(r"^test accuracy: (\d+\.\d)%$", out, re.MULTILINE)
    assert match, out
    # Chance is 10%. With these short runs seed 0 reaches 94.7% here and seeds 0-5 reach 82-95%; other
    # CPUs round bf16 differently and may follow a less lucky seed's path, hence the margin. (Shorter
    # runs are not stable enough: 3 pretraining and 5 fine-tuning epochs ranged from 35% to 89%.)
    assert float(match.group(1)) > 60.0, out
    assert re.search(r"^time: \d+\.\d s \(fine-tuning \d+\.\d s, pretraining \d+\.\d s\)$", out, re.MULTILINE), out
