"""Tools for multi-turn rollouts: the calculator, call parsing, and the worker that survives misbehaving tools."""

import time

import pytest

from verl_mega.rollout.tools import MAX_OUTPUT_CHARS, ToolRunner, calc, load_tool, parse_call

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
    with pytest.raises(ValueError, match="not arithmetic"):
        calc("__import__('os').system('true')")
    with pytest.raises(ValueError, match="exponent too large"):
        calc("9**9999")


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


def test_misbehaving_tools_are_cut_off_and_the_runner_goes_on(tools_file):
    specs = ["calc", "python", f"{tools_file}:hang", f"{tools_file}:crash", f"{tools_file}:chatty",
             f"{tools_file}:huge", f"{tools_file}:add"]
    runner = ToolRunner(specs, timeout_s=1.5, python_memory_mb=256)
    try:
        assert runner.call("calc", "12*12") == (True, "144")

        start = time.monotonic()
        ok, text = runner.call("hang", "")
        assert not ok and "hang timed out after 1.5 s" in text
        assert time.monotonic() - start < 5
        assert runner.call("calc", "2+2") == (True, "4")  # a fresh worker answers

        ok, text = runner.call("crash", "")
        assert not ok and "crash crashed (exit code 3)" in text
        assert runner.call("add", {"a": 2, "b": 3}) == (True, "5")  # JSON arguments as keywords

        assert runner.call("chatty", "") == (True, "fine")
        ok, text = runner.call("huge", "")
        assert not ok and len(text) < MAX_OUTPUT_CHARS + 100 and "cut at" in text

        ok, text = runner.call("python", "while True: print('spam' * 10000)")
        assert not ok and "output exceeded" in text
        ok, text = runner.call("python", "while True: pass")
        assert not ok and "timed out" in text
        ok, text = runner.call("python", "x = bytearray(1 << 30)")
        assert not ok and "MemoryError" in text
        ok, text = runner.call("python", "import os\nprint(sorted(os.environ))")
        assert ok and text.strip() in ("[]", "['LC_CTYPE']")  # no environment leaks into the sandbox
        ok, text = runner.call("python", "raise SystemExit('bye')")
        assert not ok and "bye" in text

        ok, text = runner.call("rm", "-rf /")
        assert not ok and "unknown tool 'rm'" in text
        assert runner.call("python", {"code": "print(6*7)"}) == (True, "42\n")
    finally:
        runner.close()
