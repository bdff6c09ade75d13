"""tools/from_verl.py: verl trainer configs (hydra composition, interpolations, dotted overrides) → verl_mega recipes,
every key mapped or reported."""

import importlib.util
import sys
import textwrap
from pathlib import Path

import yaml

from verl_mega.config import load_config

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
_spec = importlib.util.spec_from_file_location("from_verl_cli", REPO / "tools" / "from_verl.py")
from_verl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(from_verl)

from verl_keys import Ctx, Map, Same, Unsupported, classify  # noqa: E402

UNKNOWN = "not a key of verl's PPO trainer configs that this converter knows"


def test_every_key_of_verls_trainer_configs_is_classified():
    keys = [k for k in (REPO / "tests/fixtures/verl/trainer_keys.txt").read_text().splitlines()
            if k and not k.startswith("#")]
    assert len(keys) > 1100
    ctx = Ctx({})
    outcomes = {k: classify(k, None, ctx) for k in keys}
    unknown = [k for k, o in outcomes.items() if isinstance(o, Unsupported) and o.reason.startswith(UNKNOWN)]
    assert unknown == []
    assert all(isinstance(o, (Map, Same, Unsupported)) and (not isinstance(o, (Same, Unsupported)) or o.reason)
               for o in outcomes.values())
    assert isinstance(classify("trainer.no_such_key", 1, ctx), Unsupported)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


# A trainer config laid out as verl's: groups placed by `group@package`, `../` groups, a `${model_engine}` choice,
# `# @package _global_`, `override` in a child config, relative and oc.select interpolations.
TREE = {
    "ppo_trainer.yaml": """
        defaults:
          - model_engine: dp
          - actor@actor_rollout_ref.actor: ${model_engine}_actor
          - rollout@actor_rollout_ref.rollout: rollout
          - _self_
        actor_rollout_ref:
          hybrid_engine: true
        data:
          train_batch_size: 1024
          max_response_length: 512
        trainer:
          n_gpus_per_node: 8
          nnodes: 1
          project_name: p
          experiment_name: e
          default_local_dir: checkpoints/${trainer.project_name}/${trainer.experiment_name}
        """,
    "ppo_megatron_trainer.yaml": """
        defaults:
          - ppo_trainer
          - override model_engine: megatron
          - _self_
        """,
    "model_engine/dp.yaml": "# @package _global_\nmodel_engine: dp\n",
    "model_engine/megatron.yaml": "# @package _global_\nmodel_engine: megatron\n",
    "actor/actor.yaml": """
        ppo_mini_batch_size: 256
        rollout_n: ${oc.select:actor_rollout_ref.rollout.n,1}
        checkpoint:
          save_contents: [model, optimizer, extra]
          load_contents: ${.save_contents}
        """,
    "actor/dp_actor.yaml": """
        defaults:
          - ../optim@optim: fsdp
          - actor
          - _self_
        strategy: fsdp
        fsdp_config:
          param_offload: false
        """,
    "actor/megatron_actor.yaml": """
        defaults:
          - ../optim@optim: fsdp
          - actor
          - _self_
        strategy: megatron
        megatron:
          tensor_model_parallel_size: 1
          param_offload: false
        """,
    "optim/fsdp.yaml": "lr: 1.0e-06\nlr_warmup_steps: -1\nlr_warmup_steps_ratio: 0.0\n",
    "rollout/rollout.yaml": "n: 1\nresponse_length: ${oc.select:data.max_response_length,512}\ntemperature: 1.0\n",
}


def test_hydra_composition_choices_overrides_and_interpolations(tmp_path):
    _write(tmp_path, TREE)
    dp = from_verl.flatten(from_verl.resolve(from_verl.compose(tmp_path / "ppo_trainer.yaml")))
    assert dp["model_engine"] == "dp" and dp["actor_rollout_ref.actor.strategy"] == "fsdp"
    assert dp["actor_rollout_ref.actor.optim.lr"] == 1e-6
    assert dp["actor_rollout_ref.actor.checkpoint.load_contents"] == ["model", "optimizer", "extra"]
    assert dp["actor_rollout_ref.rollout.response_length"] == 512 and dp["actor_rollout_ref.actor.rollout_n"] == 1
    assert dp["trainer.default_local_dir"] == "checkpoints/p/e"
    megatron = from_verl.flatten(from_verl.resolve(from_verl.compose(tmp_path / "ppo_megatron_trainer.yaml")))
    assert megatron["model_engine"] == "megatron"
    assert megatron["actor_rollout_ref.actor.megatron.tensor_model_parallel_size"] == 1
    # the command line's group choice wins, as `main_ppo model_engine=megatron` does
    chosen = from_verl.compose(tmp_path / "ppo_trainer.yaml", choices={"model_engine": "megatron"})
    assert chosen["actor_rollout_ref"]["actor"]["strategy"] == "megatron"


def _run(tmp_path, *args):
    out, report = tmp_path / "recipe.yaml", tmp_path / "report.txt"
    rc = from_verl.main([*map(str, args), "-o", str(out), "--report", str(report)])
    return rc, (yaml.safe_load(out.read_text()) if out.exists() else None), \
        (report.read_text() if report.exists() else "")


def test_overrides_become_a_recipe_that_loads(tmp_path):
    _write(tmp_path, TREE)
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    rc, recipe, report = _run(
        tmp_path, tmp_path / "ppo_megatron_trainer.yaml", "actor_rollout_ref.actor.optim.lr=2e-6",
        "actor_rollout_ref.rollout.n=5", "data.train_batch_size=64", "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "algorithm.adv_estimator=grpo",
        "+actor_rollout_ref.actor.ppo_micro_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "data.train_files=[/data/a.parquet,/data/b.parquet]",
        f"custom_reward_function.path={reward}", "trainer.save_freq=-1", "trainer.logger=[console,mlflow]",
        "actor_rollout_ref.model.lora_rank=8")
    assert rc == 0, report
    assert recipe["actor"]["lr"] == 2e-6 and recipe["rollout"]["n"] == 5 and recipe["data"]["train_batch_size"] == 64
    assert recipe["parallel"]["tp"] == 2 and recipe["algorithm"]["adv_estimator"] == "grpo"
    assert recipe["actor"]["micro_batch_size_per_gpu"] == 4  # verl's global micro-batch over 4 GPUs
    assert recipe["data"]["train_files"] == ["/data/a.parquet", "/data/b.parquet"]
    assert recipe["reward"]["function"] == f"{reward}:compute_score"
    assert recipe["trainer"]["output_dir"] == "checkpoints/p/e" and recipe["trainer"]["save_every"] == 0
    assert recipe["logging"]["mlflow"] is True and recipe["logging"]["wandb"] is False
    assert recipe["rollout"]["max_response_length"] == 512
    # every key is reported; verl's LoRA rank becomes the actor's adapters
    assert "actor_rollout_ref.model.lora_rank=8 -> model.lora.rank=8" in report
    assert recipe["model"]["lora"]["rank"] == 8
    assert "torchrun --nnodes 1 --nproc-per-node 4" in report
    cfg = load_config(tmp_path / "recipe.yaml", check_paths=False)
    assert (cfg.actor.lr, cfg.rollout.n, cfg.parallel.tp, cfg.model.lora.rank) == (2e-6, 5, 2, 8)
    assert cfg.reward.function == f"{reward}:compute_score"


def test_an_override_beats_the_yaml_where_two_verl_keys_set_one_of_ours(tmp_path):
    flat = {"actor_rollout_ref.actor.grad_clip": 1.0, "actor_rollout_ref.actor.optim.clip_grad": 0.5}
    ours, _, notes = from_verl.convert(flat, overridden={"actor_rollout_ref.actor.optim.clip_grad"})
    assert ours["actor.grad_clip"] == 0.5
    assert any("both set it; kept 0.5" in n for n in notes)


def test_bad_inputs_are_one_line(tmp_path, capsys):
    _write(tmp_path, {"broken.yaml": "defaults:\n  - actor@actor_rollout_ref.actor: nope\n"})
    assert _run(tmp_path, tmp_path / "broken.yaml")[0] == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "actor/nope.yaml, which does not exist" in err and "\n" not in err
    assert _run(tmp_path, "data.train_batch_size")[0] == 2  # not key=value
    assert "is not key=value" in capsys.readouterr().err
    rc, recipe, report = _run(tmp_path, "actor_rollout_ref.rollout.n=4", "data.train_batch_size=2",
                              "actor_rollout_ref.actor.ppo_mini_batch_size=3")
    assert rc == 1 and "the recipe does not load in verl_mega" in report  # our validation, reported


def test_vllm_engine_kwargs_pass_through_and_the_rollouts_own_are_refused(tmp_path):
    flat = {"actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.custom_ops": ["+quant_fp8"],
            "actor_rollout_ref.rollout.engine_kwargs.vllm.block_size": 32,
            "actor_rollout_ref.rollout.engine_kwargs.sglang": {},
            "actor_rollout_ref.rollout.engine_kwargs.trtllm": {}}
    ours, rows, _ = from_verl.convert(flat, overridden=set())
    assert ours == {"rollout.engine_kwargs.compilation_config.custom_ops": ["+quant_fp8"],
                    "rollout.engine_kwargs.block_size": 32}
    assert all(isinstance(outcome, Same) for key, _, outcome in rows if ".sglang" in key or ".trtllm" in key)
    assert isinstance(classify("actor_rollout_ref.rollout.engine_kwargs.vllm", {}, Ctx({})), Same)
    refused = classify("actor_rollout_ref.rollout.engine_kwargs.vllm.max_model_len", 4096, Ctx({}))
    assert isinstance(refused, Unsupported) and "data.max_prompt_length" in refused.reason
    assert isinstance(classify("actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend", "fa3", Ctx({})),
                      Unsupported)
    # the converted recipe loads, and the arguments reach the rollout's config as given
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(from_verl.nest({**ours, "model.path": "m"})))
    cfg = load_config(path, check_paths=False)
    assert cfg.rollout.engine_kwargs == {"compilation_config": {"custom_ops": ("+quant_fp8",)}, "block_size": 32}


def test_lora_keys_become_the_actors_adapters():
    fsdp = {"actor_rollout_ref.model.lora_rank": 32, "actor_rollout_ref.model.lora_alpha": 64,
            "actor_rollout_ref.model.target_modules": ["q_proj", "v_proj"], "actor_rollout_ref.model.exclude_modules":
            None, "actor_rollout_ref.model.lora_adapter_path": None, "critic.model.lora_rank": 0,
            "critic.model.lora_alpha": 16}
    ours, rows, _ = from_verl.convert(fsdp, overridden=set())
    assert ours == {"model.lora.rank": 32, "model.lora.alpha": 64.0, "model.lora.target_modules": ["q_proj", "v_proj"]}
    assert not [key for key, _, outcome in rows if isinstance(outcome, Unsupported)]
    megatron = {"actor_rollout_ref.model.lora.rank": 16, "actor_rollout_ref.model.lora.alpha": 32,
                "actor_rollout_ref.model.lora.dropout": 0.05, "actor_rollout_ref.model.lora.type": "lora",
                "actor_rollout_ref.model.lora.target_modules": ["linear_qkv", "linear_proj", "linear_fc1",
                                                                 "linear_fc2"],
                "actor_rollout_ref.model.lora.lora_A_init_method": "xavier",
                "actor_rollout_ref.model.lora.lora_B_init_method": "zero", "actor_rollout_ref.model.lora.merge": False}
    ours, rows, _ = from_verl.convert(megatron, overridden=set())
    assert ours["model.lora.target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"]
    assert (ours["model.lora.rank"], ours["model.lora.alpha"], ours["model.lora.dropout"]) == (16, 32.0, 0.05)
    assert ours["model.lora.init"] == "kaiming"  # verl's xavier has no counterpart: mapped with a note
    assert any("xavier" in outcome.note for _, _, outcome in rows if isinstance(outcome, Map))
    # the critic's adapters, an excluded module or a LoRA variant are refused with the reason
    assert isinstance(classify("critic.model.lora_rank", 8, Ctx({"critic.model.lora_rank": 8})), Unsupported)
    on = Ctx({"actor_rollout_ref.model.lora.rank": 8})
    assert isinstance(classify("actor_rollout_ref.model.lora.exclude_modules", ["o_proj"], on), Unsupported)
    assert isinstance(classify("actor_rollout_ref.model.lora.type", "dora", on), Unsupported)
    assert isinstance(classify("actor_rollout_ref.model.target_modules", ["lm_head"],
                               Ctx({"actor_rollout_ref.model.lora_rank": 8})), Unsupported)


def test_expert_parallel_generation_becomes_gen_ep():
    # verl: expert_parallel_size = tensor_model_parallel_size × data_parallel_size, as rollout.gen_ep's engines
    flat = {"actor_rollout_ref.rollout.expert_parallel_size": 8, "actor_rollout_ref.rollout.data_parallel_size": 4,
            "actor_rollout_ref.rollout.tensor_model_parallel_size": 2}
    ours, rows, _ = from_verl.convert(flat, overridden=set())
    assert ours["rollout.gen_ep"] == 8 and ours["rollout.gen_tp"] == 2
    assert not [key for key, _, outcome in rows if isinstance(outcome, Unsupported)]
    plain_dp = Ctx({"actor_rollout_ref.rollout.data_parallel_size": 2})
    assert isinstance(classify("actor_rollout_ref.rollout.data_parallel_size", 2, plain_dp), Unsupported)
    assert isinstance(classify("actor_rollout_ref.rollout.expert_parallel_size", 1, Ctx({})), Same)


def test_validation_files_travel_only_when_validation_runs():
    files = ["/data/test.parquet"]
    for before, freq, kept in ((False, -1, False), (True, -1, True), (False, 5, True)):
        flat = {"data.val_files": files, "trainer.val_before_train": before, "trainer.test_freq": freq}
        ours, _, _ = from_verl.convert(flat, overridden=set())
        assert ("data.val_files" in ours) is kept, (before, freq, ours)


def test_sequence_parallel_at_tp1_is_off_as_megatron_decides():
    # verl's Megatron defaults pair sequence_parallel=true with tensor_model_parallel_size=1
    for tp, sp in ((1, False), (2, True)):
        flat = {"actor_rollout_ref.actor.megatron.sequence_parallel": True,
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": tp}
        ours, _, _ = from_verl.convert(flat, overridden=set())
        assert ours["parallel.sequence_parallel"] is sp and ours["parallel.tp"] == tp


def test_rollout_engine_keys_that_carry_intent_convert_or_are_refused(tmp_path):
    flat = {"actor_rollout_ref.rollout.quantization": "fp8", "actor_rollout_ref.rollout.quantization_config_file": None,
            "actor_rollout_ref.rollout.enable_prefix_caching": False,
            "actor_rollout_ref.rollout.cudagraph_capture_sizes": [1, 2, 4, 8],
            "actor_rollout_ref.rollout.over_sample_rate": 0, "actor_rollout_ref.rollout.scheduling_policy": "fcfs",
            "actor_rollout_ref.rollout.skip_rollout": False, "actor_rollout_ref.rollout.max_model_len": None}
    ours, rows, _ = from_verl.convert(flat, overridden=set())
    assert ours == {"rollout.quantization": "fp8", "rollout.enable_prefix_caching": False,
                    "rollout.engine_kwargs.compilation_config.cudagraph_capture_sizes": [1, 2, 4, 8]}
    assert not [key for key, _, outcome in rows if isinstance(outcome, Unsupported)]
    # verl's FP8 blocks differ from our per-channel scales: said in the mapping's note
    assert any("128x128" in outcome.note for _, _, outcome in rows if isinstance(outcome, Map))
    assert isinstance(classify("actor_rollout_ref.rollout.quantization", None, Ctx({})), Same)
    for key, value in (("quantization", "torchao"), ("quantization_config_file", "torchao_config.json"),
                       ("over_sample_rate", 0.1), ("scheduling_policy", "priority"), ("skip_rollout", True),
                       ("full_determinism", True)):
        assert isinstance(classify(f"actor_rollout_ref.rollout.{key}", value, Ctx({})), Unsupported), key
    assert isinstance(classify("actor_rollout_ref.rollout.logprobs_mode", "processed_logprobs", Ctx({})), Same)
    assert isinstance(classify("actor_rollout_ref.rollout.logprobs_mode", "raw_logprobs", Ctx({})), Unsupported)
    # validation samples at top_p 1 with no top-k: verl's other settings are refused
    for key, same_value, other in (("top_p", 1.0, 0.9), ("top_k", -1, 20)):
        assert isinstance(classify(f"actor_rollout_ref.rollout.val_kwargs.{key}", same_value, Ctx({})), Same)
        assert isinstance(classify(f"actor_rollout_ref.rollout.val_kwargs.{key}", other, Ctx({})), Unsupported)
    # a rollout key this converter does not know is reported, not passed over
    assert isinstance(classify("actor_rollout_ref.rollout.no_such_key", 1, Ctx({})), Unsupported)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(from_verl.nest({**ours, "model.path": "m"})))
    cfg = load_config(path, check_paths=False)
    assert (cfg.rollout.quantization, cfg.rollout.enable_prefix_caching) == ("fp8", False)
    assert cfg.rollout.engine_kwargs == {"compilation_config": {"cudagraph_capture_sizes": (1, 2, 4, 8)}}
