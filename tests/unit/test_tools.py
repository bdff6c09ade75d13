"""Tools for multi-turn rollouts: the calculator, call parsing, and the worker that survives misbehaving tools."""

import time

import pytest

import logging

from verl_mega.rollout.tools import (MAX_OUTPUT_CHARS, PYTHON_TOOL_RISK, Answer, ToolError, ToolRunner, calc,
                                     load_tool, parse_call)

MISBEHAVING = '''
import os, sys, time

def hang(arguments):
    time.sleep(60)

def crash(arguments):
    os._exit(3)

def chatty(arguments):
    print("x" * 5_000_000)          # printed, not returned: must not reach the trainer's console
    sys.stderr.write("y" * 1_000_000)
    return "fine"

def huge(arguments):
    return "z" * 3_000_000

def add(a, b):
    return a + b

def boom(arguments):
    raise RuntimeError("the tool itself is broken")

def picky(arguments):
    from verl_mega.rollout.tools import ToolError
    raise ToolError(f"cannot use {arguments!r}")
'''


@pytest.fixture()
def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(MISBEHAVING)
    return path


def test_calc_is_exact_and_refuses_code():
    assert calc("23*17") == "391"
    assert calc(" (2+3)*4 - 6/3 ") == "18"
    assert calc("7/2") == "3.5"
    assert calc("-2**10") == "-1024"
    with pytest.raises(ToolError, match="ValueError: not arithmetic"):  # an answer to the policy, not a failure
        calc("__import__('os').system('true')")
    with pytest.raises(ToolError, match="ValueError: exponent too large"):
        calc("9**9999")
    with pytest.raises(ToolError, match="SyntaxError"):
        calc("2+")
    with pytest.raises(ToolError, match="ZeroDivisionError"):
        calc("1/0")


@pytest.mark.parametrize("body, expected", [
    ("calc:23*17", ("calc", "23*17")),
    (" calc : 1+1 ", ("calc", "1+1")),
    ('{"name": "python", "arguments": {"code": "print(1)"}}', ("python", {"code": "print(1)"})),
    ('{"name": "calc"}', ("calc", {})),
    ("no colon here", ("", "no colon here")),
    ('{"broken json": ', ("", '{"broken json":')),
])
def test_parse_call(body, expected):
    assert parse_call(body) == expected


def test_unknown_tool_spec_fails_at_start_up():
    with pytest.raises(ValueError, match="not a built-in tool"):
        ToolRunner(["calculator"], 1.0)
    with pytest.raises(ValueError):
        load_tool("no_such_module_xyz:fn")


def test_misbehaving_tools_are_cut_off_and_the_runner_goes_on(tools_file, caplog):
    specs = ["calc", "python", f"{tools_file}:hang", f"{tools_file}:crash", f"{tools_file}:chatty",
             f"{tools_file}:huge", f"{tools_file}:add", f"{tools_file}:boom", f"{tools_file}:picky"]
    with caplog.at_level(logging.INFO):
        runner = ToolRunner(specs, timeout_s=1.5, python_memory_mb=256)
    assert PYTHON_TOOL_RISK in caplog.text  # the python tool's sandbox shares the kernel, and the run says so
    assert "python tool sandbox" in caplog.text  # how it is isolated here, said once
    try:
        assert runner.call("calc", "12*12") == Answer(True, "144")
        assert runner.call("calc", "2+") == Answer(False, "error: SyntaxError: invalid syntax (<unknown>, line 1)")

        start = time.monotonic()
        assert runner.call("hang", "") == Answer(False, "error: hang timed out after 1.5 s", failed=True)
        assert time.monotonic() - start < 5
        assert runner.call("calc", "2+2") == Answer(True, "4")  # a fresh worker answers
        start = time.monotonic()
        assert runner.call("hang", "", timeout_s=0.2) == Answer(False, "error: hang timed out after 0.2 s",
                                                                failed=True)
        assert time.monotonic() - start < 3

        assert runner.call("crash", "") == Answer(False, "error: crash crashed (exit code 3)", failed=True)
        assert runner.call("add", {"a": 2, "b": 3}) == Answer(True, "5")  # JSON arguments as keywords
        # argument names the tool does not take are the policy's mistake, not the tool's failure
        assert runner.call("add", {"a": 2, "c": 3}) == Answer(
            False, "error: add: missing a required argument: 'b'")
        assert runner.call("boom", "") == Answer(False, "error: RuntimeError: the tool itself is broken", failed=True)
        assert runner.call("picky", "x") == Answer(False, "error: cannot use 'x'")  # the tool's answer

        assert runner.call("chatty", "") == Answer(True, "fine")
        ok, text, failed = runner.call("huge", "")
        assert not ok and not failed and len(text) < MAX_OUTPUT_CHARS + 100 and "cut at" in text

        ok, text, failed = runner.call("python", "while True: print('spam' * 10000)")
        assert not ok and not failed and "output exceeded" in text
        ok, text, _ = runner.call("python", "while True: pass")
        assert not ok and "timed out" in text
        ok, text, _ = runner.call("python", "x = bytearray(1 << 30)")
        assert not ok and "MemoryError" in text
        ok, text, _ = runner.call("python", "import os\nprint(sorted(os.environ))")
        assert ok and text.strip() in ("[]", "['LC_CTYPE']")  # no environment reaches the code
        code = "import os\nprint(os.path.basename(os.getcwd()), os.listdir('.'), os.getsid(0) == os.getpid())"
        ok, text, _ = runner.call("python", code)
        assert ok and text == "scratch [] True\n"  # an empty scratch dir, a session of its own
        ok, text, _ = runner.call("python", "raise SystemExit('bye')")
        assert not ok and "bye" in text

        assert runner.call("rm", "-rf /") == Answer(False, "error: unknown tool 'rm'; tools: add, boom, calc, chatty, "
                                                           "crash, hang, huge, picky, python")
        assert runner.call("python", {"code": "print(6*7)"}) == Answer(True, "42\n")
    finally:
        runner.close()


def test_a_tool_file_whose_import_never_returns_is_refused_in_one_line(tmp_path, monkeypatch):
    """Tool files are checked in a process of their own, under the import bound, never imported by the trainer."""
    import verl_mega.rewards.loader as loader
    from verl_mega.rollout.tools import check_tool

    path = tmp_path / "slow_tool.py"
    path.write_text("import time\ntime.sleep(3600)\n\ndef lookup(text):\n    return text\n")
    monkeypatch.setattr(loader, "IMPORT_TIMEOUT_S", 1.5)
    with pytest.raises(ValueError, match=r"tool '.*slow_tool.py:lookup': importing it did not return within 1.5 s"):
        ToolRunner([f"{path}:lookup"], 1.0)
    check_tool("calc")
