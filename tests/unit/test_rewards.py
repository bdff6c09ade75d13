"""Rule-based rewards, reward-function loading and the asynchronous reward pool."""

import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest

from verl_mega.rewards import (
    RewardFunctionError,
    RewardPool,
    arithmetic_score,
    compute_score,
    extract_boxed,
    extract_solution,
    first_integer,
    format_reward,
    load_reward_fn,
)


# ------------------------------------------------------------------------------------------------- math rewards
@pytest.mark.parametrize("text,strict,flexible", [
    ("She pays 3 + 4 = 7 dollars.\n#### 7", "7", "7"),
    ("#### 1,234", "1234", "1234"),
    ("first #### 5 then #### -12.5", "-12.5", "-12.5"),
    ("#### $18", "18", "18"),
    ("The answer is 42.", None, "42"),
    ("so \\boxed{3,000} and then 7 more words 9", None, "3000"),
    ("no numbers here", None, None),
])
def test_extract_solution(text, strict, flexible):
    assert extract_solution(text, "strict") == strict
    assert extract_solution(text, "flexible") == flexible


def test_extract_boxed_nested_and_unbalanced():
    assert extract_boxed(r"x \boxed{1} y \boxed{\frac{1}{2}} z") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{12") is None
    assert extract_boxed("nothing") is None


def test_compute_score_numeric_and_format_score():
    assert compute_score("#### 72.0", "72") == 1.0
    assert compute_score("#### 1,234", 1234) == 1.0
    assert compute_score("#### 71", "72") == 0.0
    assert compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert compute_score("the answer is 72", "72") == 0.0  # strict needs ####
    assert compute_score("the answer is 72", "72", method="flexible") == 1.0
    # GSM8K's full solution text as ground truth
    assert compute_score("#### 18", "Janet sells 16 - 3 - 4 = 9 eggs... 9 * 2 = 18\n#### 18") == 1.0
    assert compute_score("#### 0.3333334", "0.3333333", tolerance=1e-6) == 1.0
    assert compute_score("#### 0.334", "0.3333333", tolerance=1e-6) == 0.0
    assert compute_score("#### 5", "five") == 0.0


def test_format_reward():
    assert format_reward("blah #### 3") == 1.0
    assert format_reward(r"blah \boxed{3}") == 1.0
    assert format_reward(r"blah \boxed{3}", style="gsm8k") == 0.0
    assert format_reward("#### 3", style="boxed") == 0.0
    assert format_reward("answer: 3") == 0.0
    with pytest.raises(ValueError, match="unknown format style"):
        format_reward("x", style="xml")


@pytest.mark.parametrize("response,truth,expected", [
    ("7", "7", 1.0), (" 7\n", "7", 1.0), ("7 because 3+4", "7", 1.0), ("17", "7", 0.0), ("", "7", 0.0),
    ("abc", "7", 0.0), ("-3", "-3", 1.0), ("3", "-3", 0.0), ("12+", 12, 1.0), ("x=9", "9", 1.0),
])
def test_arithmetic_score(response, truth, expected):
    assert arithmetic_score(response, truth) == expected


def test_first_integer():
    assert first_integer("a 12 b 3") == 12
    assert first_integer("none") is None


# ------------------------------------------------------------------------------------------------------- loader
USER_MODULE = textwrap.dedent("""
    import time

    def compute_score(response, ground_truth, **kwargs):
        return 1.0 if response.strip() == str(ground_truth) else 0.0

    def only_source(response, ground_truth, data_source="none"):
        return 2.0 if data_source == "mine" else 0.5

    def as_dict(response, ground_truth):
        return {"score": 0.25, "acc": True}

    def one_arg(response):
        return 0.0

    def needs_key(response, ground_truth, *, key):
        return 0.0

    def batch_len(responses, ground_truths, **kw):
        return [float(len(r)) for r in responses]

    def slow_or_bad(response, ground_truth, **kw):
        if response == "slow":
            time.sleep(5)
        if response == "bad":
            raise RuntimeError("boom")
        if response == "nan":
            return float("nan")
        return float(len(response))

    def crashes(response, ground_truth, **kw):
        import ctypes
        import os
        if response == "exit":
            os._exit(7)
        if response == "segv":
            ctypes.string_at(0)
        return 1.0

    def ignores_alarm(response, ground_truth, **kw):
        import signal
        if response == "stuck":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # like native code that never checks
            time.sleep(60)
        return 1.0
""")


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_MODULE)
    return str(path)


def test_load_builtins_and_dotted_paths():
    assert load_reward_fn("arithmetic").score_one("7", "7") == 1.0
    assert load_reward_fn("gsm8k").score_one("42", "42") == 0.0
    assert load_reward_fn("gsm8k_flexible").score_one("42", "42") == 1.0
    for spec in ("verl_mega.rewards.math_reward:arithmetic_score", "verl_mega.rewards.math_reward.arithmetic_score"):
        fn = load_reward_fn(spec)
        assert fn.score_one("5", "5") == 1.0 and not fn.batched


def test_load_from_file(user_file):
    assert load_reward_fn(user_file).score_one(" 3 ", 3) == 1.0  # defaults to compute_score
    fn = load_reward_fn(f"{user_file}:only_source")
    # extras it does not take (extra_info) are dropped; data_source is passed
    assert fn.score_one("x", 1, {"data_source": "mine", "extra_info": {"a": 1}}) == 2.0
    assert load_reward_fn(f"{user_file}:only_source", reward_kwargs={"data_source": "mine"}).score_one("x", 1) == 2.0
    assert load_reward_fn(f"{user_file}:as_dict").score_one("x", 1) == 0.25
    batched = load_reward_fn(f"{user_file}:batch_len")
    assert batched.batched and batched.score_batch(["ab", "abcd"], [0, 0]) == [2.0, 4.0]


def test_load_errors_are_one_line(user_file, tmp_path):
    cases = [
        (str(tmp_path / "missing.py:fn"), "not found"),
        ("no_such_pkg_xyz.mod:fn", "could not import module 'no_such_pkg_xyz.mod'"),
        (f"{user_file}:nope", "has no function 'nope'"),
        ("verl_mega.rewards.math_reward:nope", "available: .*arithmetic_score"),
        (f"{user_file}:one_arg", "takes 1 positional parameter"),
        (f"{user_file}:needs_key", "required parameter.*key.*Accepted forms: verl's compute_score"),
        ("notabuiltin", "neither a built-in"),
    ]
    for spec, pattern in cases:
        with pytest.raises(RewardFunctionError, match=pattern) as info:
            load_reward_fn(spec)
        assert "\n" not in str(info.value)
    with pytest.raises(RewardFunctionError, match="reward_kwargs bogus"):
        load_reward_fn(f"{user_file}:only_source", reward_kwargs={"bogus": 1})


def test_batched_flag_on_function():
    def scorer(rs, gts):
        return [1.0] * len(rs)

    scorer.batched = True
    fn = load_reward_fn(scorer)
    assert fn.batched and fn.score_batch(["a", "b", "c"], [1, 2, 3]) == [1.0, 1.0, 1.0]


# --------------------------------------------------------------------------------------------------------- pool
def _leftovers() -> tuple[int, int]:
    """Threads, and child processes not yet reaped (the pool's workers are plain subprocesses)."""
    import threading

    import psutil

    return threading.active_count(), len(psutil.Process().children())


@pytest.mark.alone  # a time bound
def test_pool_scores_in_order_and_survives_failures(user_file, caplog):
    fn = load_reward_fn(f"{user_file}:slow_or_bad")
    before = _leftovers()
    # generous limits: the CI box may be heavily loaded, and a healthy call must never look timed out
    with RewardPool(fn, num_workers=2, timeout_s=1.0) as pool, caplog.at_level(logging.WARNING):
        begin = time.monotonic()
        future = pool.submit(["a", "slow", "bcd", "bad", "nan", "ef"], [0] * 6)
        result = future.result(timeout=10)
        assert time.monotonic() - begin < 4.5  # the 5 s sleep was cut off at the time limit
        assert result.scores == [1.0, 0.0, 3.0, 0.0, 0.0, 2.0]
        assert (result.num_timeouts, result.num_errors) == (1, 2)
        assert result.first_error.startswith("timed out after 1s") or "boom" in result.first_error
        # the pool keeps working after a timeout
        assert pool.score(["abcd"], [0]).scores == [4.0]
        assert (pool.total_timeouts, pool.total_errors, pool.total_scored) == (1, 2, 7)
    assert any("1 timeout(s) and 2 error(s)" in r.getMessage() for r in caplog.records)
    assert _leftovers() == before  # killed workers were reaped, the dispatcher thread ended


def test_hanging_calls_are_killed_and_nothing_leaks(user_file):
    before = _leftovers()
    with RewardPool(f"{user_file}:slow_or_bad", num_workers=2, timeout_s=0.5) as pool:
        for _ in range(4):
            begin = time.monotonic()
            result = pool.score(["slow", "ab"], [0, 0])
            assert time.monotonic() - begin < 0.5 + 3.0
            assert result.scores == [0.0, 2.0] and result.num_timeouts == 1
        threads, children = _leftovers()
        assert threads == before[0] + 1 and children == before[1] + 2  # one dispatcher, num_workers workers
    assert _leftovers() == before


def test_blocked_signals_do_not_stop_the_time_limit(user_file):
    with RewardPool(f"{user_file}:ignores_alarm", num_workers=1, timeout_s=0.5) as pool:
        begin = time.monotonic()
        result = pool.score(["ok", "stuck"], [0, 0])
        assert result.scores == [1.0, 0.0] and result.num_timeouts == 1
        assert time.monotonic() - begin < 5
        assert pool.score(["ok"], [0]).scores == [1.0]  # the worker was replaced and the pool still works


def test_crash_inside_the_function_is_a_clear_error(user_file):
    with RewardPool(f"{user_file}:crashes", num_workers=1, timeout_s=5.0) as pool:
        result = pool.score(["ok", "exit", "ok"], [0, 0, 0])
        assert result.scores == [1.0, 0.0, 1.0] and result.num_errors == 1
        assert "died (exit code 7) inside the function" in result.first_error
        result = pool.score(["segv"], [0])
        assert "died (signal SIGSEGV)" in result.first_error


def test_batch_stops_early_past_max_error_frac(user_file):
    with RewardPool(f"{user_file}:slow_or_bad", num_workers=2, timeout_s=0.5, max_error_frac=0.1) as pool:
        begin = time.monotonic()
        result = pool.score(["slow"] * 16, [0] * 16)
        assert time.monotonic() - begin < 0.5 + 3.0  # one wave of time limits, not eight
        assert result.num_timeouts == 2 and result.num_errors == 14
        assert result.first_error == "timed out after 0.5s"


def test_batched_function_in_chunks(user_file):
    with RewardPool(f"{user_file}:batch_len", num_workers=2, chunk_size=2) as pool:
        assert pool.score(["a", "bb", "ccc", "dddd", "eeeee"], [0] * 5).scores == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_submit_validates_lengths_and_workers():
    with RewardPool("arithmetic", num_workers=1) as pool:
        with pytest.raises(ValueError, match="lengths differ"):
            pool.submit(["1"], [1, 2])
    with pytest.raises(ValueError, match="num_workers must be >= 1"):
        RewardPool("arithmetic", num_workers=0)


def test_unpicklable_callable_is_refused():
    with pytest.raises(ValueError, match="cannot be sent to worker processes"):
        RewardPool(load_reward_fn(lambda response, ground_truth: 1.0), num_workers=1)


def test_pool_start_failure_is_an_error_not_a_hang(tmp_path):
    path = tmp_path / "child_fails.py"
    path.write_text(textwrap.dedent(f"""
        import os
        if os.getpid() != {os.getpid()}:  # a worker process
            raise ImportError("this module cannot be imported in a worker")

        def compute_score(response, ground_truth, **kw):
            return 1.0
    """))
    begin = time.monotonic()
    with pytest.raises(RuntimeError, match="cannot be loaded in a worker process.*ImportError: this module"):
        RewardPool(str(path), num_workers=1)
    assert time.monotonic() - begin < 20


def test_workers_never_run_the_main_script(tmp_path):
    """A user's script that starts a pool at top level, with no ``if __name__ == "__main__"`` guard (as the docs'
    Python example is): its workers do not run it again (multiprocessing's spawn would, and every worker would start
    a pool of its own)."""
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent("""
        import os
        from verl_mega.rewards import RewardPool

        with open("runs.log", "a") as f:
            f.write(f"{os.getpid()}\\n")
        pool = RewardPool("arithmetic", num_workers=2)
        print("scores", pool.score(["7", "8"], ["7", "9"]).scores)
        pool.close()
    """))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "scores [1.0, 0.0]" in done.stdout
    assert len((tmp_path / "runs.log").read_text().splitlines()) == 1  # the script ran once, in this process


def test_a_function_of_the_main_script_is_refused_with_one_line():
    def score(response, ground_truth):
        return 1.0

    score.__module__ = "__main__"  # as if defined in the script that was run
    with pytest.raises(ValueError, match="'.*score' is defined in the main script, which worker processes do not "
                                         "run; define it in a module"):
        RewardPool(load_reward_fn(score), num_workers=1)


# ------------------------------------------------------------------------------------------------ verl's contract
VERL_MODULE = textwrap.dedent("""
    import re

    CALLS = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        # verl's contract, as in verl.utils.reward_score: the arguments come by keyword
        m = re.search(r"-?\\d+", solution_str)
        ok = m is not None and m.group(0) == str(ground_truth)
        return {"score": float(ok), "acc": ok, "source_len": len(data_source),
                "split_is_train": (extra_info or {}).get("split") == "train", "pred": m.group(0) if m else ""}

    def plain_float(data_source, solution_str, ground_truth, extra_info=None, *, scale=1.0):
        return scale * float(solution_str == ground_truth)

    def batched(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
        # verl's BatchRewardManager: lists, by keyword, plus reward_kwargs
        return [{"score": float(s == g) * kwargs.get("scale", 1.0), "idx": e["index"]}
                for s, g, e in zip(solution_strs, ground_truths, extra_infos)]

    def needs_more(data_source, solution_str, ground_truth, extra_info, tokenizer):
        return 0.0
""")


@pytest.fixture
def verl_file(tmp_path):
    path = tmp_path / "verl_reward.py"
    path.write_text(VERL_MODULE)
    return str(path)


def test_verl_compute_score_called_by_keyword_with_source_and_extra_info(verl_file):
    fn = load_reward_fn(verl_file)  # a file and verl's default function name, compute_score
    assert fn.contract == "verl" and not fn.batched
    row = {"data_source": "openai/gsm8k", "ability": "math", "extra_info": {"split": "train", "index": 3}}
    scores, infos = fn.score_batch_info(["7 apples", "8"], ["7", "7"], [row, {"data_source": "x"}])
    assert scores == [1.0, 0.0]
    # the other numeric values of the dict are kept (True counts as 1); strings are not
    assert infos == [{"acc": 1.0, "source_len": 12.0, "split_is_train": 1.0},
                     {"acc": 0.0, "source_len": 1.0, "split_is_train": 0.0}]
    scaled = load_reward_fn(f"{verl_file}:plain_float", reward_kwargs={"scale": 2.0})
    assert scaled.score_one("7", "7", {"data_source": "s"}) == 2.0


def test_verl_batched_form(verl_file):
    fn = load_reward_fn(f"{verl_file}:batched", reward_kwargs={"scale": 3.0})
    assert fn.contract == "verl" and fn.batched
    extras = [{"data_source": "a", "extra_info": {"index": i}} for i in range(3)]
    assert fn.score_batch_info(["1", "2", "x"], ["1", "2", "3"], extras) == ([3.0, 3.0, 0.0],
                                                                             [{"idx": 0.0}, {"idx": 1.0}, {"idx": 2.0}])


def test_a_function_that_fits_neither_form_shows_both(verl_file, user_file):
    for spec, what in ((f"{verl_file}:needs_more", "required parameter(s) tokenizer that verl's contract does not "
                                                   "pass"),
                       (f"{user_file}:one_arg", "takes 1 positional parameter(s), which fits neither accepted form")):
        with pytest.raises(RewardFunctionError) as info:
            load_reward_fn(spec)
        msg = str(info.value)
        assert what in msg and "\n" not in msg
        assert "compute_score(data_source, solution_str, ground_truth, extra_info=None)" in msg
        assert "fn(response, ground_truth, **extras)" in msg
    # a required parameter passed by reward.kwargs fits
    assert load_reward_fn(f"{verl_file}:needs_more", reward_kwargs={"tokenizer": None}).contract == "verl"
    assert load_reward_fn(f"{user_file}:needs_key", reward_kwargs={"key": 1}).score_one("a", "b") == 0.0


def test_pool_returns_each_samples_dict_values(verl_file):
    with RewardPool(f"{verl_file}:compute_score", num_workers=1) as pool:
        result = pool.score(["3", "4", "5"], ["3", "3", "5"], [{"data_source": "ab"}] * 3)
    assert result.scores == [1.0, 0.0, 1.0]
    assert result.info_sums() == {"acc": (2.0, 3), "source_len": (6.0, 3), "split_is_train": (0.0, 3)}


def test_dict_values_become_reward_metrics_over_ranks():
    from verl_mega.rewards.pool import RewardBatchResult, info_metrics

    a = RewardBatchResult([1.0, 0.0], 0, 0, 0.0, infos=[{"acc": 1.0, "mean": 5.0}, {"acc": 0.0}]).info_sums()
    b = RewardBatchResult([1.0], 0, 0, 0.0, infos=[{"acc": 1.0, "len": 3.0}]).info_sums()
    # means over the samples that returned the key, whichever rank scored them; our own names get a prefix
    assert info_metrics([a, b]) == {"reward/acc": 2 / 3, "reward/fn_mean": 5.0, "reward/len": 3.0}
    assert info_metrics([{}, {}]) == {}


# ---------------------------------------------------------------------------------- a user module's import, bounded
SLOW_IMPORT = textwrap.dedent("""
    import os, pathlib, time
    pathlib.Path(os.environ["MARKER_DIR"], str(os.getpid())).touch()  # who imported it
    time.sleep(3600)  # an import that never returns

    def compute_score(response, ground_truth):
        return 1.0
""")


def _importers(marker_dir) -> list[int]:
    return [int(p.name) for p in marker_dir.iterdir()]


def _gone(pid: int, bound_s: float = 10.0) -> bool:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def slow_file(tmp_path, monkeypatch):
    marker_dir = tmp_path / "imported_by"
    marker_dir.mkdir()
    monkeypatch.setenv("MARKER_DIR", str(marker_dir))
    path = tmp_path / "slow_reward.py"
    path.write_text(SLOW_IMPORT)
    return path, marker_dir


def test_a_reward_file_whose_import_never_returns_is_one_line_error_and_never_runs_here(slow_file, monkeypatch):
    """The trainer's check of reward.function imports the file in a process of its own, ended at the bound: one
    line naming the file, the limit and the fix; this process never ran the file, and the check left nothing."""
    import verl_mega.rewards.loader as loader

    path, marker_dir = slow_file
    monkeypatch.setattr(loader, "IMPORT_TIMEOUT_S", 1.5)
    with pytest.raises(RewardFunctionError) as info:
        loader.check_user_code(f"{path}:compute_score", reward_kwargs={})
    message = str(info.value)
    assert "\n" not in message and str(path) in message and "within 1.5 s" in message
    assert "do slow set-up inside the function" in message
    importers = _importers(marker_dir)
    assert len(importers) == 1 and importers[0] != os.getpid()
    assert _gone(importers[0]), "the check process outlived its bound"


def test_a_reward_pool_given_a_spec_imports_it_in_its_workers_only_and_bounds_their_start(slow_file, monkeypatch):
    import verl_mega.rewards.pool as pool_module

    path, marker_dir = slow_file
    monkeypatch.setattr(pool_module, "_STARTUP_TIMEOUT_S", 1.5)
    with pytest.raises(RewardFunctionError, match=r"slow_reward.py': importing it did not return within 1.5 s in "
                                                  r"a reward worker process"):
        RewardPool(str(path), num_workers=1)
    importers = _importers(marker_dir)
    assert os.getpid() not in importers and len(importers) == 1
    assert _gone(importers[0])


def test_the_check_of_a_user_file_still_refuses_a_bad_signature_in_one_line(user_file):
    from verl_mega.rewards.loader import check_user_code

    check_user_code(f"{user_file}:compute_score")  # a good one passes
    for spec, kwargs, match in [(f"{user_file}:one_arg", None, "fits neither accepted form"),
                                (f"{user_file}:missing", None, "has no function 'missing'"),
                                (f"{user_file}:only_source", {"bogus": 1}, "reward_kwargs bogus are not parameters")]:
        with pytest.raises(RewardFunctionError, match=match) as info:
            check_user_code(spec, reward_kwargs=kwargs)
        assert "\n" not in str(info.value)
    assert not any(name.startswith("verl_mega_user_reward_") and getattr(module, "__file__", "") == user_file
                   for name, module in sys.modules.items())  # checked elsewhere, not imported here


def test_a_pool_given_a_spec_learns_whether_it_is_batched_from_its_workers(user_file):
    with RewardPool(f"{user_file}:batch_len", num_workers=1) as pool:
        assert pool.batched is True  # from the worker's ready message: this process never loaded the file
        assert pool.score(["ab", "c"], [0, 0]).scores == [2.0, 1.0]
