"""Config sections of the run itself: `trainer`, `checkpoint` and `logging`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from verl_mega.config.base import ConfigSection, option

RESUME_AUTO, RESUME_OFF = "auto", "off"
POOL_HEARTBEAT_S = 2.0  # every rank's heartbeat period (verl_mega/parallel/pools.py beats it)
MISSED_BEATS = 3  # a heartbeat timeout spans at least this many periods: one late beat is no alarm
# The longest run: trainer.total_steps, trainer.total_epochs and algorithm.filter_groups.max_num_gen_batches at most
# this. The data loader counts its batches (steps x batches per step, or epochs x batches per epoch) as a Python
# int whose len() must fit in an index-sized (int64) integer: 10**9 x 10**9 does, with room to spare. A billion
# steps at one a second is over thirty years.
MAX_RUN_LENGTH = 10**9


@dataclass(frozen=True, kw_only=True)
class TrainerConfig(ConfigSection):
    """Run length, seeds, output directory, resume and reliability guards."""

    SECTION: ClassVar[str] = "trainer"

    total_steps: int | None = option(
        None, help="RL steps to run (at most 10^9); null runs total_epochs over the data. Not result-changing on "
                   "resume unless an LR schedule decays over the run length.", affects_results=False)
    total_epochs: int | None = option(1, help="Epochs over data.train_files when total_steps is null (at most 10^9).",
                                      affects_results=False)
    output_dir: str = option("outputs/run", help="Directory for metrics.jsonl, TensorBoard logs, plots and "
                                                 "checkpoints/.", affects_results=False)
    seed: int = option(42, help="Global seed (model init, sampling and shuffling unless they set their own).")
    deterministic: bool = option(False, help="Deterministic training kernels: torch.use_deterministic_algorithms "
                                             "(warning where an op has none), cuBLAS's fixed workspace, cuDNN "
                                             "without autotuning. Repeatable GPU training, slower; CPU runs repeat "
                                             "either way.")
    save_every: int = option(0, help="Save a checkpoint every N steps; 0 disables periodic saves.",
                             affects_results=False)
    time_limit_s: float | None = option(
        None, help="Stop cleanly (checkpoint of the last step, exit 0) before the run has been going this many "
                   "seconds: after the first step that ends less than one step's duration before the limit. null: "
                   "no limit. SIGTERM and SIGINT stop the same way (docs/checkpointing.md).", affects_results=False)
    resume: str = option(RESUME_AUTO, help="`auto` resumes from the newest complete checkpoint in output_dir, `off` "
                                           "starts fresh (an earlier run's records in output_dir are moved to "
                                           "earlier_runs/), anything else is a checkpoint directory.",
                         affects_results=False)
    resume_allow_config_change: bool = option(
        False, help="Resume even if result-changing keys differ from the checkpoint's config (they are still "
                    "listed).", affects_results=False)
    log_every: int = option(1, help="Print console metrics every N steps (metrics.jsonl gets every step).",
                            affects_results=False)
    max_consecutive_nonfinite: int = option(
        3, help="Skip a step whose loss or grad norm is NaN/Inf; abort after this many in a row.",
        affects_results=False)
    collective_timeout_s: float = option(
        1800.0, help="Abort with a message naming the stage when a collective hangs longer than this.",
        affects_results=False)
    pool_heartbeat_timeout_s: float = option(
        60.0, help="With a rollout pool of its own: a rank of the other pool whose heartbeat (every 2 s) stops for "
                   "this long while this rank waits for its answer is reported as stopped or hung, and the job ends "
                   "with an error. 0 waits trainer.collective_timeout_s instead; otherwise at least 6 (3 beats). "
                   "Refused when colocated.",
        affects_results=False)
    profile: bool = option(False, help="Print the per-stage time / overlap profile every step (and collect vLLM's "
                                       "per-request stats for the prefill / decode split).",
                           affects_results=False)
    val_every: int = option(0, help="Validate every N steps (needs data.val_files); 0 disables.",
                            affects_results=False)
    val_before_train: bool = option(False, help="Validate once before the first step of a fresh run, logged as "
                                                "step 0 (verl's trainer.val_before_train; needs data.val_files). A "
                                                "resumed run does not repeat it.", affects_results=False)
    balance_batch: bool = option(True, help="Give each data-parallel rank the same number of rows with similar "
                                            "token counts (whole groups, longest first to the least-loaded rank); "
                                            "false: contiguous blocks of the batch.")
    sample_transport: Literal["scatter", "gather"] = option(
        "scatter", help="`scatter`: each rank receives only the rows it trains on; `gather`: every rank receives "
                        "every row (the baseline, for checks and benchmarks).", affects_results=False)
    peak_tflops: float | None = option(
        None, help="One device's peak TFLOP/s for the `perf/mfu` metric; null uses the datasheet bf16/fp16 dense "
                   "figure of known GPUs (H100/H200 989, A100 312, B200 2250) and omits MFU elsewhere.",
        affects_results=False)

    def validate(self) -> None:
        self._check_range("total_steps", ge=1, le=MAX_RUN_LENGTH, example=100)
        self._check_range("total_epochs", ge=1, le=MAX_RUN_LENGTH, example=1)
        self._require(self.total_steps is not None or self.total_epochs is not None,
                      "trainer.total_steps and trainer.total_epochs are both null; set one, e.g. "
                      "trainer.total_steps=100")
        self._require(bool(self.output_dir.strip()), "trainer.output_dir is empty; set trainer.output_dir=<dir>")
        self._require(bool(self.resume.strip()), "trainer.resume is empty; use auto, off or a checkpoint directory")
        for name in ("save_every", "val_every"):
            self._check_range(name, ge=0)
        self._check_range("log_every", ge=1)
        self._check_range("max_consecutive_nonfinite", ge=1, example=3)
        self._check_range("collective_timeout_s", gt=0.0, example=1800)
        least = MISSED_BEATS * POOL_HEARTBEAT_S
        self._require(self.pool_heartbeat_timeout_s == 0 or self.pool_heartbeat_timeout_s >= least,
                      f"trainer.pool_heartbeat_timeout_s={self.pool_heartbeat_timeout_s:g} is shorter than "
                      f"{MISSED_BEATS} heartbeats (one every {POOL_HEARTBEAT_S:g} s), so a healthy peer would be "
                      f"reported hung; set it to 0 (off) or at least {least:g}, e.g. "
                      f"trainer.pool_heartbeat_timeout_s=60")
        self._check_range("peak_tflops", gt=0.0, example=989)
        self._check_range("time_limit_s", gt=0.0, example=3600)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig(ConfigSection):
    """What a checkpoint holds and how many are kept (under <trainer.output_dir>/checkpoints/)."""

    SECTION: ClassVar[str] = "checkpoint"
    AFFECTS_RESULTS: ClassVar[bool] = False

    keep_last: int | None = option(2, help="Keep the newest N complete checkpoints; null keeps all.")
    async_save: bool = option(False, help="Write checkpoint shards in the background (Megatron async "
                              "dist-checkpointing) while training goes on; a checkpoint becomes visible to resume "
                              "once every rank has written it (see docs/checkpointing.md).")
    export_hf: bool = option(False, help="Also export the actor as HF safetensors at each save (`hf/`: config, "
                                         "weights and the run's tokenizer, model.chat_template included).")
    save_optimizer: bool = option(True, help="Include optimizer state (needed for an exact resume).")
    verify_checksums: bool = option(
        True, help="Before resuming, compare every file of the checkpoint with the SHA-256 recorded in its "
                   "manifest.json at save time (the ranks hash a share each); false skips that, sizes are still "
                   "checked (cost: docs/checkpointing.md).")

    def validate(self) -> None:
        self._check_range("keep_last", ge=1, example=2)


@dataclass(frozen=True, kw_only=True)
class LoggingConfig(ConfigSection):
    """Metric sinks (rank 0). Every step's metrics always go to <trainer.output_dir>/metrics.jsonl when jsonl is on."""

    SECTION: ClassVar[str] = "logging"
    AFFECTS_RESULTS: ClassVar[bool] = False

    console: bool = option(True, help="Print metrics to the console.")
    progress_bar: bool = option(True, help="On a terminal, a progress bar with ETA over steps (elsewhere, one line "
                                           "per step).")
    verbose: bool = option(False, help="Show Megatron's, vLLM's and transformers' INFO lines and the warnings of "
                                       "conditions the framework handles (hidden by default).")
    jsonl: bool = option(True, help="Append one JSON object per step to <output_dir>/metrics.jsonl.")
    tensorboard: bool = option(True, help="Write TensorBoard event files under <output_dir>.")
    plot: bool = option(True, help="Write a reward / KL / entropy curve PNG to <output_dir> at the end.")
    wandb: bool = option(False, help="Also log every step to Weights & Biases (pip install wandb); WANDB_MODE=offline "
                                     "keeps the run in <output_dir>/wandb without network. A resumed run continues "
                                     "its wandb run.")
    mlflow: bool = option(False, help="Also log every step to MLflow (pip install mlflow-skinny): the tracking URI is "
                                      "MLFLOW_TRACKING_URI, else a file store in <output_dir>/mlruns. A resumed run "
                                      "continues its MLflow run.")
    project: str = option("verl_mega", help="Tracker project: the wandb project and the MLflow experiment.")
    run_name: str | None = option(None, help="Tracker run name; null uses the name of trainer.output_dir.")

    def validate(self) -> None:
        self._require(bool(self.project.strip()), "logging.project is empty; set logging.project=<name>")
