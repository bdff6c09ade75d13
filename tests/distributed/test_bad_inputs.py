"""Bad input through the user-facing CLIs: each case exits non-zero with a one-line `error: …` naming the problem
(and the fix), before anything heavy is built, and leaves no partial output behind: the run's output directory
does not appear, and a directory it had to read (a checkpoint, an output directory to resume) is unchanged.
Malicious checkpoint files are refused without running their code (a marker file the payload would write never
appears)."""

import json
import os
import pickle
import shlex
import shutil
import sys
import contextlib
import io
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from runs import RESUME_STEPS, SHORT
from torchrun_util import run_captured

from verl_mega.models.tiny import make_tiny_hf_model
from verl_mega.checkpoint.integrity import checkpoint_files, digest_files, write_manifest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "configs" / "quickstart_cpu.yaml")
# the checkpoint cases resume the reference run, saved with these (result-changing) settings
SMALL = SHORT
CKPT_STEP = 4


def _env(tmp_path) -> dict:
    return {**os.environ, "VERL_MEGA_CACHE": os.environ.get("VERL_MEGA_CACHE", str(tmp_path / "cache")),
            "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "VLLM_CPU_CI_ENV": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class _Payload:
    """Unpickling this writes the marker file: what an attacker's code would do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _forge_manifest(ckpt: Path) -> None:
    """What an attacker who edits files would do as well: a manifest that matches them."""
    write_manifest(ckpt, digest_files(ckpt, checkpoint_files(ckpt)))


def _shard(ckpt: Path) -> Path:
    return sorted((ckpt / "actor").glob("*.distcp"))[0]


@pytest.fixture(scope="module")
def assets(tmp_path_factory, resume_reference):
    root = tmp_path_factory.mktemp("bad")
    env = _env(root)
    good = make_tiny_hf_model(root / "good", model_type="qwen2")
    # --- models
    nosafe = root / "no_weights"
    nosafe.mkdir()
    (nosafe / "config.json").write_text((good / "config.json").read_text())
    trunc = _copy(good, root / "truncated")
    data = (good / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 3])
    wrong = _copy(good, root / "wrong_model")
    cfg = json.loads((good / "config.json").read_text())
    cfg_wrong = {k: v for k, v in cfg.items() if k != "layer_types"}
    (wrong / "config.json").write_text(json.dumps({**cfg_wrong, "num_hidden_layers": 4}))
    gpt2 = root / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    make_tiny_hf_model(root / "vocab_small", model_type="qwen2", vocab_size=40)  # the tokenizer has 55 tokens
    make_tiny_hf_model(root / "vocab_big", model_type="qwen2", vocab_size=512)
    no_eos = _copy(good, root / "no_eos")
    tok_cfg = json.loads((no_eos / "tokenizer_config.json").read_text())
    tok_cfg["eos_token"] = None  # explicitly none (left out, Qwen2's tokenizer class would add its own)
    (no_eos / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    bad_arch = _copy(good, root / "bad_arch")
    (bad_arch / "config.json").write_text(json.dumps({**cfg, "architectures": ["FooForCausalLM"]}))
    nan = _copy(good, root / "nan_weights")
    tensors = load_file(nan / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(tensors, nan / "model.safetensors", metadata={"format": "pt"})
    # --- data and recipes
    (root / "empty.jsonl").write_text("")
    (root / "nofield.jsonl").write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    (root / "wrongtype.jsonl").write_text(json.dumps({"prompt": 5, "answer": "2"}) + "\n")
    (root / "badjson.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n')
    (root / "latin1.jsonl").write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n'
                                        b'{"prompt": "caf\xe9 1+2=", "answer": "3"}\n')
    (root / "nullanswer.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": None}) + "\n")
    (root / "reward_sig.py").write_text("def score():\n    return 1.0\n\n\ndef fixed(response, ground_truth):\n"
                                        "    return 1.0\n")
    (root / "notckpt").mkdir()
    (root / "dup.yaml").write_text(f"defaults: {RECIPE}\nactor:\n  lr: 1.0e-4\n  lr: 2.0e-4\n")
    (root / "empty.yaml").write_text("# nothing yet\n")
    (root / "a_file").write_text("not a directory\n")
    # --- a real checkpoint (step 4 of the session's 6-step reference run, conftest.py), and broken copies of it
    run, _ = resume_reference
    ck = run / "checkpoints" / f"step_{CKPT_STEP:06d}"
    ckpts = root / "ckpts"
    ckpts.mkdir()
    variants = {name: _copy(ck, ckpts / name) for name in (
        "intact", "trunc", "flip", "norank", "noconfig", "schema", "garbage_json", "garbage_manifest", "nocommon",
        "evil_metadata", "evil_common", "evil_rank")}
    shard = _shard(variants["trunc"])
    shard.write_bytes(shard.read_bytes()[:1000])
    shard = _shard(variants["flip"])
    flipped = bytearray(shard.read_bytes())
    flipped[len(flipped) // 2: len(flipped) // 2 + 16] = bytes(b ^ 0xFF for b in flipped[len(flipped) // 2:][:16])
    shard.write_bytes(bytes(flipped))
    (variants["norank"] / "rank_00000.pt").unlink()
    for name, edit in (("noconfig", lambda s: s.pop("config")), ("schema", lambda s: s.update(schema=99))):
        state = json.loads((variants[name] / "trainer.json").read_text())
        edit(state)
        (variants[name] / "trainer.json").write_text(json.dumps(state))
    (variants["garbage_json"] / "trainer.json").write_text("{not json")
    (variants["garbage_manifest"] / "manifest.json").write_text("[1, 2")
    (variants["nocommon"] / "actor" / "common.pt").unlink()
    (variants["evil_metadata"] / "actor" / ".metadata").write_bytes(pickle.dumps(_Payload(root / "marker")))
    _forge_manifest(variants["evil_metadata"])
    torch.save({"optimizer": _Payload(root / "marker")}, variants["evil_common"] / "actor" / "common.pt")
    _forge_manifest(variants["evil_common"])
    torch.save({"torch": _Payload(root / "marker")}, variants["evil_rank"] / "rank_00000.pt")
    _forge_manifest(variants["evil_rank"])
    broken_run = _copy(run, root / "broken_run")  # resume=auto with no intact checkpoint left
    for step in sorted((broken_run / "checkpoints").glob("step_*")):
        shard = _shard(step)
        shard.write_bytes(shard.read_bytes()[:1000])
    # --- an mcore checkpoint of the converters, and malicious / broken copies
    mcore = root / "mcore"
    proc = run_captured([sys.executable, str(ROOT / "tools" / "convert_hf_to_mcore.py"), "--hf-path", str(good),
                         "--output", str(mcore)], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (_copy(mcore, root / "mcore_evil") / ".metadata").write_bytes(pickle.dumps(_Payload(root / "marker")))
    meta = (mcore / ".metadata").read_bytes()
    (_copy(mcore, root / "mcore_trunc") / ".metadata").write_bytes(meta[: len(meta) // 2])
    return root


@dataclass
class Case:
    args: list[str]
    needle: str
    recipe: str = RECIPE
    tool: str | None = None  # a tools/*.py converter instead of the trainer
    watch: Path | None = None  # a directory that must be left exactly as it was
    shell: str | None = None  # run inside `unshare -m sh -c` (private mounts), {cmd} = the command
    sub: bool = False  # run the CLI in a subprocess (implied by tool and shell); otherwise main() in this process


def cases(a: Path) -> list[Case]:
    ck = a / "ckpts"

    def resume(name: str, *more: str) -> list[str]:
        return [*SMALL, f"trainer.total_steps={CKPT_STEP + 2}", f"trainer.resume={ck / name}", *more]

    return [
        # --- config
        Case(["actor.lrr=1e-5"], "did you mean", sub=True),
        Case(["actor.lr"], "actor.lr"),
        Case(["actor.lr=abc"], "actor.lr"),
        Case(["actor.lr=-1"], "actor.lr"),
        Case(["algorithm.adv_estimator=foo"], "algorithm.adv_estimator"),
        Case(["algorithm.adv_estimator=gae", "critic.enable=false"], "critic"),
        Case(["algorithm.kl_ctrl.type=adaptive", "algorithm.use_kl_in_reward=true"], "target_kl"),
        Case(["parallel.tp=2"], "world size"),
        Case(["rollout.n=0"], "rollout.n"),
        Case(["data.train_batch_size=7", "actor.ppo_mini_batch_size=2"], "batch"),
        Case([], "key 'lr' appears twice (lines 3 and 4)", recipe=str(a / "dup.yaml")),
        Case([], "empty.yaml' is empty", recipe=str(a / "empty.yaml")),
        Case(["reward.num_workers=0"], "reward.num_workers=0: reward functions run in worker processes"),
        Case(["reward.max_error_frac=2"], "reward.max_error_frac=2"),
        Case(["trainer.time_limit_s=-5"], "trainer.time_limit_s"),
        Case(["actor.routing_replay=r3"], "actor.routing_replay=r3 needs a Mixture-of-Experts model"),
        # --- output directory
        Case([f"trainer.output_dir={a / 'a_file'}"], "a_file' is a file, not a directory"),
        Case([f"trainer.output_dir={a / 'a_file' / 'out'}"], "a_file is a file, not a directory"),
        Case(["trainer.output_dir={mnt}/out"], "is not writable: permission denied",
             shell="mount -t tmpfs -o ro,size=1m tmpfs {mnt} && {cmd}"),
        Case(["trainer.output_dir={mnt}/out"], "is not writable: no space left on the device",
             shell="mount -t tmpfs -o size=256k tmpfs {mnt} && {cmd}; rc=$?; ls -A {mnt}; exit $rc"),
        # --- model and tokenizer
        Case([f"model.path={a / 'missing'}"], "model.path"),
        Case([f"model.path={a / 'no_weights'}"], "safetensors"),
        Case([f"model.path={a / 'truncated'}"], "truncated"),
        Case([f"model.path={a / 'wrong_model'}"], "do not match"),
        Case([f"model.path={a / 'gpt2'}"], "model_type='gpt2' is not supported"),
        Case([f"model.path={a / 'bad_arch'}"], 'names architectures FooForCausalLM; the rollout engine (vLLM) runs'),
        Case([f"model.path={a / 'vocab_small'}"], "the tokenizer has 55 tokens but the model's vocabulary has 40"),
        Case([f"model.path={a / 'vocab_big'}"], "less than half of the model's vocabulary of 512"),
        Case([f"model.path={a / 'no_eos'}"], "has no end-of-sequence token"),
        Case([f"model.path={a / 'nan_weights'}"], "tensor model.layers.1.mlp.down_proj.weight in", sub=True),
        # --- data
        Case([f"data.train_files=[{a / 'missing.jsonl'}]"], "missing.jsonl"),
        Case([f"data.train_files=[{a / 'empty.jsonl'}]"], "empty.jsonl"),
        Case([f"data.train_files=[{a / 'nofield.jsonl'}]"], "prompt"),
        Case([f"data.train_files=[{a / 'wrongtype.jsonl'}]"], "prompt"),
        Case([f"data.train_files=[{a / 'badjson.jsonl'}]"], "badjson.jsonl", sub=True),
        Case([f"data.train_files=[{a / 'latin1.jsonl'}]", "reward.function=arithmetic"],
             "latin1.jsonl:line 2: byte 0xe9 at column 16 is not UTF-8"),
        Case([f"data.train_files=[{a / 'nullanswer.jsonl'}]", "reward.function=arithmetic"],
             "nullanswer.jsonl:line 1: field 'answer' is null"),
        # --- reward function
        Case(["reward.function=no_such_module.fn"], "no_such_module"),
        Case([f"reward.function={a / 'reward_sig.py'}:score"], "score"),
        Case([f"reward.function={a / 'reward_sig.py'}:fixed", "reward.kwargs={bogus: 1}"],
             "reward_kwargs bogus are not parameters"),
        # --- checkpoints to resume
        Case([f"trainer.resume={a / 'notckpt'}"], "trainer.resume"),
        Case(resume("trunc"), "__0_0.distcp has 1000 bytes, manifest.json records", watch=ck / "trunc"),
        Case(resume("flip"), "__0_0.distcp does not match its SHA-256 in manifest.json", watch=ck / "flip", sub=True),
        Case(resume("norank"), "rank_00000.pt is missing (listed in manifest.json)", watch=ck / "norank"),
        Case(resume("noconfig"), "trainer.json lacks 'config'", watch=ck / "noconfig"),
        Case(resume("schema"), "trainer.json has schema 99", watch=ck / "schema"),
        Case(resume("garbage_json"), "trainer.json is unreadable (JSONDecodeError", watch=ck / "garbage_json"),
        Case(resume("garbage_manifest"), "manifest.json is unreadable", watch=ck / "garbage_manifest"),
        Case(resume("nocommon"), "actor/common.pt is missing (listed in manifest.json)", watch=ck / "nocommon"),
        Case(resume("evil_metadata"), "actor/.metadata refers to posix.system, which dist-checkpoint metadata "
                                      "never holds; refusing to load it", watch=ck / "evil_metadata", sub=True),
        Case(resume("evil_common"), "actor/common.pt holds objects a weights-only load refuses",
             watch=ck / "evil_common"),
        Case(resume("evil_rank"), "evil_rank/rank_00000.pt holds objects a weights-only load refuses",
             watch=ck / "evil_rank"),  # before the build: the in-process case would build the model otherwise
        Case(resume("intact", "parallel.use_distributed_optimizer=false"),
             "holds the state of the distributed optimizer, which the plain one cannot load", watch=ck / "intact"),
        Case([*SMALL, f"trainer.total_steps={CKPT_STEP - 1}", f"trainer.resume={ck / 'intact'}"],
             f"trainer.total_steps={CKPT_STEP - 1} is below step {CKPT_STEP}", watch=ck / "intact"),
        Case(resume("intact", "actor.lr=0.1"), "config differs from intact in result-changing keys (actor.lr",
             watch=ck / "intact"),
        Case([*SMALL, f"trainer.total_steps={RESUME_STEPS + 2}", f"trainer.output_dir={a / 'broken_run'}"],
             "no older intact checkpoint", watch=a / "broken_run"),
        # --- converters
        Case(["--mcore-path", str(a / "mcore_evil")], "mcore_evil/.metadata refers to posix.system",
             tool="convert_mcore_to_hf.py", watch=a / "mcore_evil"),
        Case(["--mcore-path", str(a / "mcore_trunc")], "mcore_trunc/.metadata is truncated or corrupt",
             tool="convert_mcore_to_hf.py", watch=a / "mcore_trunc"),
    ]


def _listing(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}


def _in_process(argv: list[str]) -> tuple[int, str, str]:
    """`python -m verl_mega.train ARGV` as main(ARGV) in this process (fast: nothing is imported again); the
    environment the launcher discovery exports is put back afterwards."""
    from verl_mega.train import main

    saved, err = dict(os.environ), io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            rc = main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return rc, "", err.getvalue()


@pytest.mark.slow
def test_bad_inputs_fail_fast_with_one_line(assets, tmp_path):
    env = _env(tmp_path)
    all_cases = cases(assets)
    assert len(all_cases) >= 50
    failures = []
    for i, case in enumerate(all_cases):
        out = tmp_path / f"out{i}"
        mnt = tmp_path / f"mnt{i}"
        args = [a.replace("{mnt}", str(mnt)) for a in case.args]
        if case.tool:
            cmd = [sys.executable, str(ROOT / "tools" / case.tool), *args, "--output", str(out)]
        else:
            cmd = [sys.executable, "-m", "verl_mega.train", "--config", case.recipe]
            cmd += [] if any(a.startswith("trainer.output_dir=") for a in args) else [f"trainer.output_dir={out}"]
            cmd += args
        if case.shell:
            mnt.mkdir()
            cmd = ["unshare", "-m", "sh", "-c", case.shell.format(mnt=mnt, cmd=shlex.join(cmd))]
        before = _listing(case.watch) if case.watch else None
        if case.sub or case.tool or case.shell:
            proc = run_captured(cmd, env=env, timeout=300)
            rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        else:
            rc, stdout, stderr = _in_process(cmd[3:])
        errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
        leftovers = [p for p in (out, *tmp_path.glob(f".out{i}.tmp-*")) if p.exists()]
        leftovers += [case.watch] if case.watch and _listing(case.watch) != before else []
        leftovers += ["files in the mount"] if case.shell and stdout.strip() else []
        leftovers += ["marker: the payload ran"] if (assets / "marker").exists() else []
        tail = stderr.strip().splitlines()[-1:]
        ok = rc == 2 and len(errors) == 1 and case.needle.lower() in errors[0].lower() and not leftovers
        if case.sub and stderr.strip() and not tail[0].startswith("error: "):  # nothing after the error line
            ok = False
        if not ok:
            failures.append(f"{case.args}: rc={rc} errors={errors} leftovers={leftovers} tail={tail}")
    assert not failures, "\n".join(failures)
