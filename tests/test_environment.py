"""The start-up's garbage-collection hold (engine/environment.py): off while starting, on after, always."""

from __future__ import annotations

import gc

import pytest

from engine.environment import StartupCollection


@pytest.fixture(autouse=True)
def collector_left_on():
    yield
    gc.enable()  # whatever a failed assertion left


def test_the_collector_is_off_while_starting_and_on_after():
    with StartupCollection() as startup:
        assert not gc.isenabled()
        startup.done()
        assert gc.isenabled()
        startup.done()  # a second call changes nothing
        assert gc.isenabled()
    assert gc.isenabled()


def test_a_failed_start_turns_the_collector_back_on():
    with pytest.raises(RuntimeError), StartupCollection():
        raise RuntimeError("the model did not load")
    assert gc.isenabled()


def test_freezing_moves_what_is_alive_out_of_the_collectors_reach():
    kept = [[i] for i in range(1000)]  # noqa: F841  # alive across the freeze
    before = gc.get_freeze_count()
    try:
        with StartupCollection(freeze=True):
            pass
        assert gc.isenabled()
        assert gc.get_freeze_count() >= before + 1000
    finally:
        gc.unfreeze()  # the test process's objects back in reach
