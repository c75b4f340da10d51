"""rank_zero_only and the rank-zero logging helpers, at Lightning's import path."""

import logging
import sys

import pytest

from fabriclite.rank_zero import _rank_from_environment
from fabriclite.utilities import rank_zero_only
from fabriclite.utilities.rank_zero import rank_zero_deprecation, rank_zero_info, rank_zero_warn


@pytest.fixture
def rank(monkeypatch):
    def set_rank(value):
        monkeypatch.setattr(rank_zero_only, "rank", value)

    return set_rank


def test_a_rank_zero_only_function_runs_on_rank_zero_and_returns_none_elsewhere(rank):
    double = rank_zero_only(lambda x: 2 * x)
    rank(0)
    assert double(3) == 6
    rank(1)
    assert double(3) is None


def test_the_logging_helpers_speak_on_rank_zero_only(rank, caplog):
    rank(1)
    with caplog.at_level(logging.INFO, logger="fabriclite"):
        rank_zero_info("quiet")
        rank_zero_warn("quiet")  # would fail the test as an unexpected warning only on rank 0
    assert caplog.records == []
    rank(0)
    with caplog.at_level(logging.INFO, logger="fabriclite"):
        rank_zero_info("epoch %d done", 3)
    assert caplog.records[-1].getMessage() == "epoch 3 done"
    with pytest.warns(DeprecationWarning, match="old is deprecated"):
        rank_zero_deprecation("old is deprecated")


@pytest.mark.parametrize(
    ("env", "expected"),
    [({}, 0), ({"LOCAL_RANK": "3"}, 3), ({"RANK": "5", "LOCAL_RANK": "1"}, 5), ({"SLURM_PROCID": "2"}, 2)],
)
def test_the_rank_comes_from_the_launch_variables(monkeypatch, env, expected):
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _rank_from_environment() == expected


def test_a_rank_that_is_not_a_number_is_named(monkeypatch):
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ValueError, match="RANK='zero' must be an integer"):
        _rank_from_environment()


@pytest.mark.parametrize(
    ("env", "expected"),  # Lightning's test_rank_zero_known_environment_variables, case by case
    [
        ({"RANK": "0"}, 1),
        ({"SLURM_PROCID": "0"}, 1),
        ({"LOCAL_RANK": "0"}, 1),
        ({"JSM_NAMESPACE_RANK": "0"}, 1),
        ({}, 1),
        ({"RANK": "1"}, None),
        ({"SLURM_PROCID": "2"}, None),
        ({"LOCAL_RANK": "3"}, None),
        ({"JSM_NAMESPACE_RANK": "4"}, None),
    ],
)
def test_until_a_strategy_sets_the_rank_rank_zero_only_follows_the_launch_variables(monkeypatch, env, expected):
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(rank_zero_only, "_rank", None)  # as in a process no strategy has set up yet
    monkeypatch.delitem(sys.modules, "fabriclite.utilities.rank_zero")  # what Lightning's test does
    from fabriclite.utilities.rank_zero import rank_zero_only as reimported

    @reimported
    def foo():
        return 1

    assert foo() == expected
    reimported.rank = 0  # set by a strategy: the variables no longer matter
    assert foo() == 1
