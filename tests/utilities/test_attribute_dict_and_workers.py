"""fabriclite.utilities.data: AttributeDict and suggested_max_num_workers."""

import os

import pytest

from fabriclite.utilities.data import AttributeDict, suggested_max_num_workers


def test_attribute_dict_keys_are_attributes_both_ways():
    hparams = AttributeDict(lr=1e-3, batch_size=32)
    hparams.lr = 3e-4
    hparams.epochs = 2
    assert hparams == {"lr": 3e-4, "batch_size": 32, "epochs": 2} and hparams["epochs"] == 2
    del hparams.epochs
    assert "epochs" not in hparams
    assert repr(hparams) == "batch_size: 32\n        lr: 0.0003"
    with pytest.raises(AttributeError, match="no attribute 'momentum'; its keys: \\['batch_size', 'lr'\\]"):
        _ = hparams.momentum


def test_suggested_workers_share_this_process_cpus_and_leave_one_for_it():
    cpus = len(os.sched_getaffinity(0))
    assert suggested_max_num_workers(1) == max(1, cpus - 1)
    assert suggested_max_num_workers(cpus * 4) == 1
    with pytest.raises(ValueError, match="local_world_size=0 should be >= 1"):
        suggested_max_num_workers(0)
