"""The typed configuration: the one definition of every option.

Dataclasses below are the schema. tyro builds the command line from them, YAML files fill them
(config_files.py, strictly: unknown or repeated keys and wrongly typed values are errors naming the
key), and the precedence is defaults < YAML < command line.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import Literal

from meshtrain.models.config import ModelConfig  # model.*: defined beside the families that read them


BUNDLED_CORPUS = str(pathlib.Path(__file__).parent / "data" / "corpus" / "python_stdlib_docstrings.txt")


PipelineSchedule = Literal["auto", "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                           "ZBVZeroBubble", "DualPipeV"]


@dataclass
class ParallelConfig:
    """Sizes of the 5-D device mesh (pp, dp, cp, tp, ep). Their product rules are in parallel/layout.py."""

    pp: int = 1
    """Pipeline stages (alias: pipeline_model_parallel_size)."""
    vpp: int = 1
    """Virtual pipeline stages per rank (alias: virtual_pipeline_model_parallel_size)."""
    pp_schedule: PipelineSchedule = "auto"
    """auto: 1F1B with vpp=1, Interleaved1F1B with vpp>1. ZBVZeroBubble and DualPipeV place two
    stages per rank in a V (vpp=2)."""
    pp_layers_per_stage: list[int] | None = None
    """Decoder layers in each of the pp*vpp stages, in stage order, e.g. [1, 3, 3, 1] to offset the
    embedding and output cost of the first and last stage; None splits evenly."""
    dp_replicate: int = 1
    """Replicated data-parallel groups; > 1 with dp_shard > 1 gives HSDP."""
    dp_shard: int = -1
    """FSDP2 shard group size; -1 takes what the world size leaves over."""
    cp: int = 1
    """Context parallel size (alias: context_parallel_size): ring attention over load-balanced
    sequence shards; needs train.seq_len % (2 * cp) == 0."""
    cp_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """How ring attention passes keys and values around the cp group."""
    tp: int = 1
    """Tensor parallel size (alias: tensor_model_parallel_size)."""
    sp: bool = False
    """Sequence parallel on norms and residuals; needs tp > 1 (alias: sequence_parallel)."""
    ep: int = 1
    """Expert parallel size (alias: expert_model_parallel_size)."""
    etp: int = 1
    """Tensor parallel inside each expert (alias: expert_tensor_parallel_size)."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free each block's gathered parameters after its forward and re-gather them in backward
    (always): less memory for one more all-gather per block, and per micro-batch under a pipeline.
    default: always without pp, never with pp. The root unit always keeps them."""
    fsdp_accumulate: Literal["reduce_each", "reduce_last", "reduce_last_unsharded"] = "reduce_each"
    """How FSDP accumulates gradients over a step's micro-batches. reduce_each: reduce-scatter each
    micro-batch's gradients (least memory). reduce_last: keep full gradients until the last
    micro-batch and reduce once (1/accumulation of the reduce traffic, one full gradient copy per
    rank). reduce_last_unsharded: also keep parameters gathered between micro-batches (fewer
    all-gathers, one full parameter copy too). Pipelines always reduce once per step (torch's schedule)."""
    loss_parallel: bool = True
    """With tp > 1, compute cross-entropy on the vocab-sharded logits without gathering them."""
    gpus_per_node: int | None = None
    """Ranks per node, for the tp-across-nodes warning; None reads LOCAL_WORLD_SIZE."""
    timeout_s: int = 600
    """Collective timeout: a dead rank ends the job after this long instead of hanging it."""


@dataclass
class OptimizerConfig:
    """AdamW."""

    lr: float = 3e-3
    weight_decay: float = 0.1
    """Applied to matrices and embeddings, not to norm weights."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8


@dataclass
class LRScheduleConfig:
    """Linear warmup, then decay to min_lr_ratio * lr at the last step."""

    warmup_steps: int = 10
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.1


@dataclass
class DataConfig:
    """Training text and how it is tokenized and packed."""

    path: str = BUNDLED_CORPUS
    """A dataset prepared by `meshtrain prepare` (or Megatron; its PREFIX), or a .txt, .jsonl or
    .parquet file or a directory of them (tokenized at start). Default: the bundled corpus."""
    blend: list[str] = field(default_factory=list)
    """[weight, path, weight, path, ...]: sample several datasets (each as data.path takes it) in
    these proportions, Megatron's blend; replaces data.path."""
    text_field: str = "text"
    """Field holding the text in jsonl/parquet records."""
    tokenizer: str = "byte"
    """"byte" (UTF-8 bytes, no files needed) or the path of a Hugging Face tokenizer.json."""
    format: Literal["pretrain", "chat", "prompt_response", "preference"] = "pretrain"
    """pretrain: documents packed back to back, every token a target. chat: jsonl/parquet records
    with `messages` ([{role, content}, ...]) rendered by the tokenizer's chat template;
    prompt_response: records with `prompt` and `response`. Both SFT formats train on the assistant
    (response) tokens only, each conversation packed whole and attended to on its own. preference:
    records with `prompt`, `chosen` and `rejected` (strings, or chat messages) for a preference
    objective (objective.kind dpo and the rest)."""
    chat_template: str | None = None
    """The chat template: a tokenizer_config.json, or a .jinja file. Default: the tokenizer_config.json
    beside data.tokenizer."""
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    response_field: str = "response"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    overlong: Literal["truncate", "drop"] = "truncate"
    """SFT conversations longer than train.seq_len + 1 tokens: cut (truncate) or skip (drop); counted in the log."""
    special_text_in_content: Literal["special", "text"] = "special"
    """Text equal to a special token inside a message's content (a user writing "<|im_end|>"):
    special (the token itself, as transformers' apply_chat_template tokenizes it) or text (spelled
    out in ordinary tokens, so data cannot forge turn markers; only the template's own are special)."""
    bad_records: Literal["error", "skip"] = "error"
    """An SFT record that cannot be rendered (no messages, a content that is not text, a turn the chat
    template refuses): stop with an error naming its file, record and turn, or skip it (counted in the
    log, the first reason with it)."""
    document_mask: Literal["auto", "on", "off"] = "auto"
    """Attention inside each packed document only (block-causal, documents found by their EOS). auto:
    on where an EOS id is known, said in the log (on: an error where none is)."""
    reset_position_ids: bool = False
    """With document masking: RoPE positions restart at 0 in every document of a packed sample."""
    eos_id: int | None = None
    """The end-of-document token. Default: the tokenizer's, or the one recorded by `meshtrain prepare`."""
    shuffle: bool = True
    num_workers: int = 0
    """DataLoader worker processes per rank."""


@dataclass
class TrainConfig:
    """The training run."""

    steps: int = 200
    global_batch_size: int = 16
    """Sequences per optimizer step, summed over data-parallel ranks."""
    micro_batch_size: int = 4
    """Sequences per forward/backward on one rank; accumulation = global / (micro * dp)."""
    seq_len: int = 128
    seed: int = 0
    grad_clip: float = 1.0
    """Max global L2 norm of the gradients; 0 disables clipping."""
    mixed_precision: Literal["fp32", "bf16"] = "fp32"
    """bf16: bf16 compute with fp32 master weights and fp32 gradient reduction."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward instead of storing them. full: keep each layer's input
    only; selective: keep the matmul, attention and collective outputs and recompute the cheap ops
    (about half the activations of none, for little extra compute)."""
    compile: bool = False
    """torch.compile each decoder layer (inductor; an MoE layer's attention half), after TP and before
    FSDP, as torchtitan does. Off until measured on GPU: on CPU it costs tens of seconds of
    compilation per rank."""
    float8: bool = False
    """Float8 training of the decoder's linear layers through torchao (CUDA with float8 tensor cores,
    H100/H200 class; the optional torchao extra). The embedding and lm_head stay in the compute dtype."""
    float8_all_gather: bool = True
    """With float8 under FSDP: all-gather the projections' weights in float8 (half of bf16's bytes,
    a quarter of fp32's), each shard cast with the whole weight's scale. Exact: the same float8
    weights as casting after a high-precision all-gather."""
    float8_emulate: bool = False
    """With float8: torchao's emulation, float8-rounded operands into a high-precision matmul, on
    any device. Float8's numerics without float8 hardware, and no speed-up: for tests and debugging."""
    activation_checkpointing_every: int = 1
    """Checkpoint one decoder layer in every this many (by global index); the others keep all."""
    run_dir: str = "runs/default"
    """Where the resolved config, metrics.jsonl and TensorBoard events go."""
    dry_run: bool = False
    """Validate the config and print the layout, then exit without training."""


@dataclass
class CheckpointConfig:
    """Training checkpoints (torch.distributed.checkpoint) and Hugging Face export."""

    dir: str | None = None
    """Where step-N checkpoints go; None means run_dir/checkpoints."""
    interval: int = 0
    """Save every this many steps, and at the last step; 0 saves nothing."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are deleted after a newer one is published. 0 keeps all."""
    async_save: bool = False
    """Write in a background thread while training goes on (torch's dcp.async_save); the next save
    or the end of the run waits for it."""
    resume: str = "auto"
    """auto: continue from the newest complete checkpoint in dir, if any; never: start fresh; or the
    path of a checkpoint (a step-N dir, or `meshtrain convert --to dcp` weights) to start from."""
    export_hf: str | None = None
    """After the last step, write the model here as Hugging Face safetensors + config.json."""
    hf_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype of exported weights; auto: the dtype of model.init_from_hf's checkpoint, else float32."""
    hf_max_shard_gb: float = 5.0
    """Largest exported safetensors file (transformers' default is 5 GB)."""


@dataclass
class LoggingConfig:
    log_every: int = 1
    progress: Literal["auto", "on", "off"] = "auto"
    """A progress bar on a terminal (auto), always (on) or plain lines (off)."""
    jsonl: bool = True
    """Write metrics to run_dir/metrics.jsonl."""
    tensorboard: bool = False
    """Write TensorBoard events (needs the optional tensorboard package)."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s of one device for MFU; None guesses from the CUDA device name."""
    wandb_project: str | None = None
    """Log to this Weights & Biases project (needs the optional wandb package); None: no W&B."""
    wandb_mode: Literal["online", "offline"] = "online"
    """offline: write the W&B run under run_dir/wandb without network (``wandb sync`` uploads it later)."""
    phase_every: int = 0
    """Every this many steps, log where the step's time went (data wait, forward+backward,
    optimizer, checkpoint), per rank 0; 0: never."""


@dataclass
class ProfilingConfig:
    """Looking inside a run: profiler traces, CUDA memory snapshots, the flight recorder of collectives."""

    trace: bool = False
    """Record torch.profiler traces for a window of steps, one Chrome/Perfetto trace per rank in
    run_dir/profile/ (open in https://ui.perfetto.dev or chrome://tracing)."""
    trace_wait: int = 1
    """Steps before the window (the first steps' set-up would dominate it)."""
    trace_warmup: int = 1
    """Steps profiled but not recorded, so the recorded ones run warm."""
    trace_active: int = 2
    """Steps recorded."""
    memory_snapshot_steps: list[int] = field(default_factory=list)
    """CUDA: write a memory snapshot (run_dir/memory/, open in https://pytorch.org/memory_viz) after
    each of these steps, and on an out-of-memory error."""
    flight_recorder: int = 1000
    """Collectives each rank remembers (torch's flight recorder). When one does not complete, every
    rank writes them to run_dir/flight_recorder/ and names the last in its error; 0 disables."""


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning: LoRA adapters on chosen linears, everything else frozen."""

    method: Literal["none", "lora", "dora"] = "none"
    """lora: W x + (alpha / rank) B A x. dora: LoRA with weight decomposition (DoRA, Liu et al. 2024, as
    PEFT's use_dora): each output row of W + (alpha / rank) B A is rescaled to a trained magnitude."""
    rank: int = 16
    alpha: float = 32.0
    """The update is (alpha / rank) B A x."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    targets: list[str] = field(default_factory=lambda: ["*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj",
                                                        "*.gate_proj", "*.up_proj", "*.down_proj"])
    """Module names (wildcards) whose linear layers get adapters."""
    export_adapter: str | None = None
    """At the end, write the adapters here as a PEFT adapter directory (peft.PeftModel loads it onto
    the base model). checkpoint.export_hf then writes the merged model."""

    @property
    def adapters(self) -> bool:
        return self.method != "none"


@dataclass
class PreferenceConfig:
    """Preference training, the objective of data.format=preference: a loss over pairs of a chosen and
    a rejected response to one prompt, measured against a frozen reference model (the base with the
    adapters off under peft, else a frozen copy of the starting weights)."""

    loss: Literal["dpo", "ipo", "hinge", "simpo"] = "dpo"
    """dpo: -log sigmoid(beta * m), m = (chosen's log-ratio to the reference) - (rejected's), summed
    log-probs (Rafailov et al. 2023; with label_smoothing, conservative DPO). ipo: (m' - 1/(2 beta))^2,
    m' from per-token mean log-probs (Azar et al. 2023). hinge: max(0, 1 - beta * m) (SLiC). simpo:
    no reference, -log sigmoid(beta * (mean token log-prob of chosen - of rejected) - simpo_gamma)
    (Meng et al. 2024)."""
    beta: float = 0.1
    label_smoothing: float = 0.0
    """dpo and simpo: the probability that a pair's labels are flipped (the loss is then
    -(1-e) log sigmoid(x) - e log sigmoid(-x))."""
    simpo_gamma: float = 0.5
    """simpo: the target margin gamma."""
    nll_weight: float = 0.0
    """RPO (Pang et al. 2024): plus this times the chosen response's mean token negative log-likelihood."""


@dataclass
class EvalConfig:
    """Validation: the loss on held-out data every few steps, without touching training's state."""

    interval: int = 0
    """Evaluate after every this many optimizer steps (and after the last); 0 disables."""
    steps: int = 4
    """Global batches (train.global_batch_size sequences each) per evaluation."""
    data: str = ""
    """Held-out data, in any form data.path takes. Empty: the split below of the training data."""
    split: float = 0.0
    """With eval.data empty: this fraction of the training samples (the last ones) is held out and
    never trained on."""


@dataclass
class JobConfig:
    """meshtrain train: a full training job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
