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
    if getattr(config.option, "maxschedchunk", 0) is None:  # pytest-xdist: one test at a time to each worker, in
        config.option.maxschedchunk = 1  # our order (by default the first quarter goes out in two blocks)


# session fixtures of tests/distributed/conftest.py that are whole training runs (minutes each), the longest first
# (on the 2-core box: 240, 180, 170, 150, 150 and 145 s)
WHOLE_RUNS = ("moe_quickstart_run", "calculator_run", "async_quickstart_run", "dapo_run", "gspo_run",
              "lora_quickstart_run", "quickstart_run")


def _order(item) -> tuple:
    """Whole runs first (the longest first), then the other multi-process tests, then those that hold every slot;
    unit tests last."""
    runs = [WHOLE_RUNS.index(name) for name in getattr(item, "fixturenames", ()) if name in WHOLE_RUNS]
    alone = item.get_closest_marker("alone") is not None
    return (not runs, min(runs, default=0), alone, "distributed" not in item.path.parts)


def pytest_collection_modifyitems(config, items):
    import torch

    for item in items:  # multi-process jobs and whole training runs: minutes, not seconds
        if "distributed" in item.path.parts:
            item.add_marker(pytest.mark.slow)
    # the longest first, so that pytest-xdist's workers do not end on them one after the other, and the tests that
    # hold every slot last, when little else is left to wait for them; the same order on every worker (a stable
    # sort of the collection order)
    items.sort(key=_order)
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
