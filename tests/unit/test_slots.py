"""The CPU slots the test processes share (tests/slots.py): all-or-nothing, first come first served, refused where
waiting could deadlock."""

import threading
import time

import pytest

import slots


@pytest.fixture
def box(tmp_path, monkeypatch):
    monkeypatch.setattr(slots, "DIR", tmp_path / "slots")
    monkeypatch.setattr(slots, "CAPACITY", 3)
    monkeypatch.setattr(slots, "CORES", 2)
    monkeypatch.setattr(slots, "LEDGER", slots._Ledger())  # not the one this test itself runs under
    return tmp_path


def _release(fds):
    for fd in fds:
        slots.fcntl.flock(fd, slots.fcntl.LOCK_UN)
        slots.os.close(fd)


def _queue_held(box) -> bool:
    path = box / "slots" / "queue"
    if not path.exists():
        return False
    fd = slots.os.open(path, slots.os.O_RDWR)
    try:
        slots.fcntl.flock(fd, slots.fcntl.LOCK_EX | slots.fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        slots.os.close(fd)
    return False


def _wait_until(condition, what: str):
    for _ in range(400):  # a bound on a wait, not a measurement: only a hang fails
        if condition():
            return
        time.sleep(0.025)
    raise AssertionError(f"never: {what}")


def test_slots_are_taken_all_or_none_and_the_first_waiter_goes_first(box):
    one = slots._acquire(1)
    got = {}
    everything = threading.Thread(target=lambda: got.setdefault("all", slots._acquire(3)), daemon=True)
    everything.start()  # waits for the 3 slots, first in line
    _wait_until(lambda: _queue_held(box), "the waiter is first in line")
    assert "all" not in got  # 2 free slots are not enough, and it took none of them
    later = threading.Thread(target=lambda: got.setdefault("later", slots._acquire(1)), daemon=True)
    later.start()  # behind it in the queue, though a slot is free
    time.sleep(0.2)  # (had it jumped the queue, it would have its slot by now)
    assert "later" not in got
    _release(one)
    _wait_until(lambda: "all" in got, "the first waiter got every slot")
    assert len(got["all"]) == 3 and "later" not in got and later.is_alive()
    _release(got["all"])
    _wait_until(lambda: "later" in got, "the second waiter got its slot")
    _release(got["later"])


def test_a_test_holds_its_slot_and_its_jobs_hold_theirs(box):
    ledger = slots.LEDGER
    with slots.test_slots(alone=False):
        assert ledger.held == 1
        taken = slots.job_started(2)  # the test's own slot serves the job's first rank
        assert taken == 2 and ledger.held == 2
        with pytest.raises(RuntimeError, match="reserve them first"):
            slots.job_started(1)  # a second job while one runs could wait forever
        slots.job_ended(taken)
        assert ledger.held == 1
        with slots.reserve(2):
            a, b = slots.job_started(1), slots.job_started(1)
            assert ledger.held == 2
            slots.job_ended(a)
            slots.job_ended(b)
        assert ledger.held == 1
        with slots.idle():
            assert ledger.held == 0
        assert ledger.held == 1
    assert ledger.held == 0
    with slots.test_slots(alone=True):
        assert ledger.held == 3 and slots.job_started(4) == 2 and ledger.held == 3
        slots.job_ended(2)
    assert ledger.held == 0
