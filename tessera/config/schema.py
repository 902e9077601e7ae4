"""The run configuration: one `RunConfig` dataclass tree, loaded from YAML plus `--set` overrides.

    cfg = load_config("configs/tiny-dense.yaml", ["train.steps=10", "optim.lr=1e-3"])

Sections: `run_dir`, `model`, `train`, `optim`, `data`, `checkpoint`, `parallel`, `log`. Every
field is documented where it is declared. The `model` section is either `preset: NAME` or
`from_hf: DIR` (the model a HuggingFace directory's config.json describes) plus any `ModelConfig`
fields to override (nested ones too: `moe: {num_experts: 4}`), or all fields. With neither
`preset` nor `from_hf` and `train.init_from` a HuggingFace directory, the model is that directory's
(with the fields given overriding it).

Loading checks everything before any work starts: an unknown key, a value of the wrong type or an
impossible value raises `ConfigError` with the dotted key, the value and what is allowed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tessera.config.dataclass_build import build_dataclass, plain
from tessera.config.dtypes import short_dtype_argument
from tessera.config.errors import ConfigError, TesseraError
from tessera.config.hf_config import is_hf_directory, read_language_model_config
from tessera.config.model import ModelConfig
from tessera.config.overrides import apply_overrides
from tessera.config.parallel import ParallelConfig
from tessera.config.presets import get_preset
from tessera.config.run_checks import validate_run_config
from tessera.config.training.dpo import DPOConfig
from tessera.config.training.eagle import EagleTrainConfig
from tessera.config.training.grpo import GRPOConfig
from tessera.config.training.indexer_loss import IndexerLossConfig
from tessera.config.training.lora import LoRAConfig
from tessera.config.training.vision_training import VisionLanguageTrainConfig
from tessera.config.yaml_text import read_config_file


@dataclass
class DistillConfig:
    """Knowledge distillation (tessera.train.objectives.distill_loss, tessera.train.objectives.teacher): the student
    learns the teacher's next-token distribution as well as the data. Per micro-batch, over the N loss tokens of the
    global batch (the tokens the data loss counts; under SFT the answers only):

        loss = (1 - weight) * sum_t CE_t / N + weight * T^2 * sum_t KL(p_teacher,t || p_student,t) / N

    with p = softmax(logits / T) (Hinton et al. 2015, "Distilling the Knowledge in a Neural
    Network": T^2 keeps the soft targets' gradient scale independent of T)."""

    # The teacher: a HuggingFace model directory or a Tessera checkpoint / run directory of any family
    # Tessera supports. Its vocabulary and tokenizer must be the student's (refused otherwise). It is
    # built and cut by the student's layout (under pp its layers split over the same stages), frozen, run
    # forward only. None = no teacher.
    teacher: str | None = None
    temperature: float = 1.0  # T above: > 0; 1 = the teacher's own distribution, larger = softer
    weight: float = 0.5  # in [0, 1]: 0 = the data loss alone (the teacher is still run and logged), 1 = KD alone
    # Hidden-state matching (tessera.train.objectives.hidden_match): pairs [student layer, teacher layer] whose block
    # outputs are compared, the student's through a learned linear projection to the teacher's width, by
    # the MSE per loss token; the objective adds hidden_weight x that sum / N, logged as
    # distill_hidden_loss. Empty = off. One process and data-parallel layouts only (pp, tp, ep, cp refused),
    # not fp16.
    hidden_layers: list[tuple[int, int]] = field(default_factory=list)
    hidden_weight: float = 1.0  # >= 0: the hidden-state term's weight beside the mixed CE / KD objective


@dataclass
class TrainConfig:
    """What one training run does, step by step."""

    steps: int = 1000  # optimizer steps in total; a resumed run continues up to this number
    # What the model learns (tessera.config.training.dpo): lm = the data's next tokens (pretraining, SFT); dpo = to
    # prefer each pair's chosen answer over its rejected one (data.kind=preference, train.dpo); grpo = to raise
    # the reward of completions the serving engine samples for prompts (data.kind=prompts, train.grpo)
    objective: str = "lm"
    seed: int = 0  # seeds weight init (by parameter name), data order and every RNG
    seq_len: int = 256  # tokens per sample fed to the model (each sample holds seq_len + 1 tokens)
    micro_batch_size: int = 4  # samples per forward/backward pass on one data-parallel rank
    # Samples per optimizer step over all ranks = micro_batch_size x accumulation x data-parallel size;
    # it must be a multiple of micro_batch_size x data-parallel size.
    global_batch_size: int = 16
    # fp32; bf16: bf16 compute (autocast) over fp32 master weights and optimizer; fp16: the same in
    # fp16, for GPUs without bf16, with dynamic loss scaling (tessera.train.steps.loss_scaler) so that small
    # gradients do not underflow fp16's range.
    dtype: str = "fp32"
    # FP8 matrix products in the transformer blocks' linear layers (tessera.models.float8: tensor-wise
    # dynamic scaling, E4M3 forward, E5M2 gradients), on top of train.dtype=bf16; the LM head, router
    # and routed experts stay bf16. Needs compute capability >= 8.9 (Ada, Hopper, Blackwell) and
    # parallel.tp=1; refused elsewhere. Off by default: it trades precision for speed.
    fp8: bool = False
    # Compile each transformer block with torch.compile after parallelisation (tessera.parallel.compile):
    # the same numbers, faster kernels on GPUs. None = true on CUDA, false on CPU (where compiling
    # costs seconds per block and gains little), under parallel.tp > 1 and with
    # parallel.optimizer=distributed on several ranks (where true is refused).
    compile: bool | None = None
    # Tokens per chunk of the LM-head loss (tessera.models.chunked_cross_entropy): the micro-batch's
    # full-vocabulary logits never exist at once, only [chunk, vocab]. 0 = off (plain logits and
    # loss); None = 4096 on CUDA, off on CPU (chunking sums in another order: equal within fp32
    # rounding, not bit for bit). Under parallel.tp > 1 the vocabulary-parallel loss runs instead.
    loss_chunk_tokens: int | None = None
    # bf16/fp16 on one process: cast the matrix weights to the compute dtype once per optimizer step
    # (tessera.train.steps.compute_weights) instead of in every micro-batch's forward; the same arithmetic.
    # false: autocast casts them each time (2 bytes per weight less memory between steps).
    cast_weights_per_step: bool = True
    device: str = "auto"  # auto (cuda when available, else cpu), cpu, cuda, or cuda:N
    # On a CPU, `tessera train` keeps its intra-op thread count to the cores other processes leave free,
    # chosen every few steps, at least 1, at most the count it started with (tessera/cli/adaptive_threads.py;
    # metrics.jsonl logs it as cpu_threads). false: the starting count (OMP_NUM_THREADS) throughout.
    adaptive_threads: bool = True
    log_interval: int = 10  # write a metrics line every N steps (and at the first and last step)
    eval_interval: int = 0  # validation loss / perplexity every N steps and at the end; 0 = never
    eval_steps: int = 4  # validation batches (of global_batch_size samples) per evaluation
    # Tasks run at each evaluation too, on the model of that step, their metrics logged as
    # "<task>/<metric>" (tessera.eval: lm-eval task names, theirs or eval_tasks_path's, and humaneval).
    # The whole model is gathered on rank 0 and served there while the other ranks wait, so under
    # ranks the tasks must finish within collective_timeout_s. [] = none.
    eval_tasks: list[str] = field(default_factory=list)
    eval_tasks_path: str | None = None  # a directory of local lm-eval task YAML files (+ their data)
    eval_tasks_limit: int | None = None  # the first N documents (HumanEval problems) of each task; None = all
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 = no clipping (norm still logged)
    # Weights to start from (continued pretraining, fine-tuning): a HuggingFace model directory or a
    # Tessera checkpoint / run directory. They replace the random init; optimizer and step start fresh.
    # Its shape must match the `model` section. None = random init.
    init_from: str | None = None
    # Seconds a collective may wait for its peers before the run fails with an error naming the rank,
    # the phase of the step and the operation (a hung or crashed rank). Large enough for a checkpoint
    # save or the first step's warm-up on a big model; NCCL's own default is also 10 minutes.
    collective_timeout_s: float = 600.0
    # Memory per rank (GiB) that the start-up check plans against (`tessera plan`'s estimator): a run
    # predicted not to fit gets a warning, with what would fit, before anything is allocated.
    # None = the GPU's own memory; on a machine without a GPU there is no check.
    memory_budget_gib: float | None = None
    # A step whose gradient is not finite (by the whole model's norm, the same on every rank) is skipped
    # on every rank, an event in run_dir/events.jsonl; false: it stops the run with an error naming the
    # step. Under dtype=fp16 the loss scaler skips such a step either way (that is how it finds its scale).
    skip_nonfinite: bool = True
    # A step whose loss exceeds spike_factor x the median of the spike_window steps before it is not
    # applied: the run goes back to its last checkpoint and skips the batches up to the spike
    # (tessera.train.run.loss_spike). None = off.
    spike_factor: float | None = None
    spike_window: int = 100  # steps whose median loss the spike rule compares with; it waits for that many
    distill: DistillConfig = field(default_factory=DistillConfig)  # a teacher to distil from (off by default)
    dpo: DPOConfig = field(default_factory=DPOConfig)  # train.objective=dpo: beta and the loss
    grpo: GRPOConfig = field(default_factory=GRPOConfig)  # train.objective=grpo: group, reward, sampling, loss
    eagle: EagleTrainConfig = field(default_factory=EagleTrainConfig)  # an EAGLE draft head to train instead (off)
    # low-rank adapters over the frozen model, maybe quantized (LoRA / QLoRA: config/training/lora.py); off by default
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # DeepSeek-V3.2's indexer KL objective: weight (0 = off) and stage dense | sparse
    # (config/training/indexer_loss.py); off by default
    indexer_loss: IndexerLossConfig = field(default_factory=IndexerLossConfig)
    # data.kind=vision_sft: the family, vision tower, projector and freeze switches of a LLaVA / Qwen2-VL fine-tune
    vision_language: VisionLanguageTrainConfig = field(default_factory=VisionLanguageTrainConfig)

    def __post_init__(self) -> None:
        self.dtype = short_dtype_argument(self.dtype)  # bfloat16 is bf16 (tessera.config.dtypes); others: refused later


@dataclass
class OptimConfig:
    """AdamW (Loshchilov & Hutter 2019, decoupled weight decay) and the learning-rate schedule."""

    lr: float = 3e-4  # peak learning rate, reached at the end of warm-up
    min_lr: float = 3e-5  # floor the decay ends at (and never goes below)
    betas: tuple[float, float] = (0.9, 0.95)  # Adam beta1, beta2; 0.95 is the LLaMA choice for stability
    eps: float = 1e-8  # Adam epsilon
    weight_decay: float = 0.1  # decoupled decay of the parameters selected below
    # Which parameters decay. A parameter decays iff it is a matrix (ndim >= 2) and its name matches
    # none of `no_decay` (fnmatch patterns). Vectors (norm gains, biases) never decay unless
    # `decay_vectors`: pulling a norm gain towards zero is not regularisation. Embeddings are
    # excluded by default (rows of rare tokens would otherwise shrink just for being rare);
    # the LM head decays like any projection.
    no_decay: list[str] = field(default_factory=lambda: ["tok_embeddings.*"])  # names that never decay
    decay_vectors: bool = False  # also decay 1-D parameters (norm gains, biases)
    schedule: str = "cosine"  # constant, cosine, linear, or wsd (warmup-stable-decay)
    warmup_steps: int = 100  # linear warm-up from lr/warmup_steps to lr over this many steps
    # wsd only: length of the final linear decay to min_lr; None = the last 20% of total steps.
    decay_steps: int | None = None
    # Where decay ends (min_lr from then on); None = train.steps. Fixed, it keeps the schedule when a
    # resumed run raises train.steps; train.steps beyond it is warned about at start-up.
    total_steps: int | None = None
    fused: bool = False  # torch's fused AdamW kernel (CUDA only; same maths)


@dataclass
class DatasetEntry:
    """One dataset of a blend."""

    # the dataset prefix written by `tessera preprocess` (`--sft` for kind=sft: tokens + answer mask);
    # for kind=vision_sft a JSONL file of image-text conversations (tessera.data.vision_sft); for
    # kind=preference a JSONL file of prompt / chosen / rejected records (tessera.data.preference); for
    # kind=prompts a JSONL file of {"prompt", ...} records (tessera.data.prompts)
    path: str
    weight: float = 1.0  # relative sampling weight within the blend


@dataclass
class DataConfig:
    """Where the tokens come from."""

    # pretrain (packed documents, loss on every token), sft (loss on answers only), vision_sft (image-text
    # conversations from JSONL, one per sample, loss on answers only: train.vision_language) or preference
    # (JSONL of prompt / chosen / rejected records, one pair per sample: train.objective=dpo,
    # tessera.data.preference) or prompts (JSONL of prompt records whose other fields reach the reward:
    # train.objective=grpo, tessera.data.prompts)
    kind: str = "pretrain"
    # Datasets blended by weight. Empty = the bundled corpus (Python standard-library source, tokenized
    # with the bundled tokenizer), prepared on first use under `cache_dir` and reused afterwards.
    datasets: list[DatasetEntry] = field(default_factory=list)
    tokenizer: str | None = None  # tokenizer file or directory; None = the bundled tokenizer
    valid_fraction: float = 0.02  # share of documents held out for validation
    # Where the bundled corpus is prepared; None = $TESSERA_CACHE, else ~/.cache/tessera.
    cache_dir: str | None = None


@dataclass
class CheckpointConfig:
    """Distributed checkpoints under `run_dir/checkpoints`."""

    interval: int = 100  # save every N steps (and always at the end); 0 = only at the end
    keep_last: int = 3  # complete checkpoints kept; older ones are deleted once a newer one is safe
    # At the end of a run that reaches train.steps, write the final checkpoint's model as a HuggingFace
    # directory (config.json, fp32 safetensors, data.tokenizer's files), as `tessera convert` would:
    # rank 0 reads it from the checkpoint one safetensors file at a time, under any parallel layout,
    # while the other ranks wait (up to train.collective_timeout_s: for a model too large to export
    # in that time, raise it or run `tessera convert RUN_DIR OUT` afterwards). With train.lora: the
    # adapters as a PEFT directory (what `tessera convert RUN_DIR OUT --lora-adapter` writes). Off by default.
    export_hf: bool = False
    # Where export_hf writes; None = run_dir/hf. A relative path is under run_dir, like everything
    # else the run writes; an absolute one is taken as is. Files an export would not write there
    # are refused.
    export_hf_dir: str | None = None
    # YAML key `async`: a save copies the state to CPU memory and a thread writes it while training goes
    # on; the next save and the run's end wait for it (tessera.checkpoint.dcp.background). Same files.
    async_save: bool = field(default=False, metadata={"key": "async"})


@dataclass
class LogConfig:
    """Console, `metrics.jsonl` and TensorBoard."""

    tensorboard: bool = True  # write TensorBoard events under run_dir/tensorboard
    progress_bar: bool = True  # tqdm bar on the console (stderr)
    # Peak FLOP/s of one device for MFU. None = looked up from the GPU's name (H100, A100, ...);
    # on CPU, MFU is reported as null unless this is set.
    peak_flops: float | None = None
    # Count the calls and payload bytes of every collective of each step (all_reduce, all_gather,
    # reduce_scatter, all_to_all, broadcast, send_recv) into metrics.jsonl as comm/<kind>_calls and
    # comm/<kind>_bytes (summed over ranks). Off by default: it adds per-operator Python overhead.
    comm_stats: bool = False
    # On ranks, metrics lines have each rank's step and wait times; the slowest rank is named when its
    # work exceeds the median rank's by more than this fraction of the step (tessera.train.run.rank_timing).
    straggler_threshold: float = 0.1


@dataclass
class RunConfig:
    """A whole run. `run_dir` holds config.yaml, metrics.jsonl, tensorboard/ and checkpoints/."""

    run_dir: str = "runs/default"  # load_config defaults it to runs/<config file stem>
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def accumulation_steps(self, dp_size: int = 1) -> int:
        """Micro-batches per optimizer step on each rank."""
        return self.train.global_batch_size // (self.train.micro_batch_size * dp_size)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (tuples as lists) that `load_config` reads back to an equal RunConfig."""
        return plain(self)


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML run configuration, apply `--set` overrides, build and validate the tree."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        raw = read_config_file(p)
        if raw is None:  # an empty file: every default
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections, "
                              f"got {type(raw).__name__}")
        raw.setdefault("run_dir", f"runs/{p.stem}")
    return config_from_dict(apply_overrides(raw, list(overrides or [])))


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    """Build and validate a RunConfig from nested plain data (as read from YAML)."""
    raw = dict(raw)
    model_raw = raw.pop("model", None)
    if model_raw is None:  # `model:` left empty: the default shape, or the model train.init_from holds
        model_raw = {}
    if not isinstance(model_raw, dict):
        raise ConfigError(f"model must be a section (preset: NAME, from_hf: DIR and/or fields), got "
                          f"{type(model_raw).__name__} {model_raw!r}")
    train_raw = raw.get("train")
    init_from = train_raw.get("init_from") if isinstance(train_raw, dict) else None
    cfg = build_dataclass(RunConfig, raw, "")
    if (model_raw.get("preset") is None and model_raw.get("from_hf") is None and isinstance(init_from, str)
            and is_hf_directory(init_from)):  # fields given beside it override the directory's
        try:
            cfg.model = build_model_config({**model_raw, "preset": None, "from_hf": init_from}, "train.init_from")
        except ConfigError:
            if not model_raw:  # nothing else describes the model: what is wrong with config.json is the news
                raise
            # fields were given: they describe the model as before (the weights are checked against it)
            cfg.model = build_model_config(model_raw)
    else:
        cfg.model = build_model_config(model_raw)
    validate_run_config(cfg)
    return cfg


def build_model_config(raw: dict[str, Any], from_key: str = "model.from_hf") -> ModelConfig:
    """`{preset: NAME, **overrides}`, `{from_hf: DIR, **overrides}` or a full field list -> ModelConfig.
    `from_key` is the key errors about the HuggingFace directory name (the one the user wrote).

    Fields a preset derived (head_dim = dim / n_heads, n_kv_heads = n_heads) follow an override of
    what they were derived from, so `preset: tiny-llama, dim: 256` gets head_dim 64, not the preset's 16.
    """
    raw = dict(raw)
    preset = raw.pop("preset", None)
    from_hf = raw.pop("from_hf", None)
    if preset is not None and from_hf is not None:
        raise ConfigError(f"model.preset={preset!r} and model.from_hf={from_hf!r} both name a model: give one "
                          "(model.preset=null drops the preset)")
    if from_hf is not None:
        if not isinstance(from_hf, str) or not from_hf:
            raise ConfigError(f"{from_key}={from_hf!r} is invalid: must be a HuggingFace model directory")
        if not is_hf_directory(from_hf):
            raise ConfigError(f"{from_key}={from_hf!r} is invalid: no config.json there (a HuggingFace model "
                              "directory is expected)")
        try:
            base = read_language_model_config(from_hf).to_dict()
        except TesseraError as e:
            raise ConfigError(f"{from_key}={from_hf!r}: {e}") from e
    elif preset is not None:
        if not isinstance(preset, str):
            raise ConfigError(f"model.preset={preset!r} is invalid: must be a preset name")
        try:
            base = get_preset(preset).to_dict()
        except ConfigError as e:
            raise ConfigError(f"model.preset: {e}") from e
    if preset is not None or from_hf is not None:
        if "head_dim" not in raw and base["n_heads"] and base["head_dim"] == base["dim"] // base["n_heads"]:
            base["head_dim"] = None
        if "n_kv_heads" not in raw and "n_heads" in raw and base["n_kv_heads"] == base["n_heads"]:
            base["n_kv_heads"] = None
        for key in ("moe", "mla", "linear_attention", "mamba"):
            if isinstance(base.get(key), dict) and isinstance(raw.get(key), dict):
                raw[key] = {**base[key], **raw[key]}
        raw = {**base, **raw}
    return build_dataclass(ModelConfig, raw, "model.")


def save_config(cfg: RunConfig, path: str | os.PathLike) -> None:
    """Write the fully resolved configuration as YAML (loadable with `load_config`)."""
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
