import os
import warnings

import pytest

import slots

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs; skipped without them")
    config.addinivalue_line("markers", "slow: multi-process or whole-run CPU test (every test under tests/distributed "
                                       "is one); the fast tier is -m 'not slow'")
    config.addinivalue_line("markers", "alone: holds every CPU slot of the box while it runs (tests/slots.py): "
                                       "nothing runs beside a test that bounds a time or races a signal")
    if config.option.durations is None:  # the slowest tests, listed at the end of every run: what to trim next
        config.option.durations = 15


# session fixtures of tests/distributed/conftest.py that are whole training runs (minutes each)
WHOLE_RUNS = {"quickstart_run", "moe_quickstart_run", "dapo_run", "gspo_run", "calculator_run", "async_quickstart_run"}


def pytest_collection_modifyitems(config, items):
    import torch

    for item in items:  # multi-process jobs and whole training runs: minutes, not seconds
        if "distributed" in item.path.parts:
            item.add_marker(pytest.mark.slow)
    # the longest first, so that pytest-xdist's workers do not end on them one after the other, and the tests that
    # hold every slot last, when little else is left to wait for them; the same order on every worker (a stable
    # sort of the collection order)
    items.sort(key=lambda item: (not WHOLE_RUNS & set(getattr(item, "fixturenames", ())),
                                 item.get_closest_marker("alone") is not None, "distributed" not in item.path.parts))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown inside the test's CPU slots (the jobs it starts take theirs as they start)."""
    with slots.test_slots(alone=item.get_closest_marker("alone") is not None):
        yield
