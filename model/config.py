"""The typed configs of the model code, apart from the code that needs torch.

Stage configs hold these (`pretrain.model`, the loop knobs of pretrain and SFT, `lora`, the PPO
policy section of align), so planning a run (`gristmill run ... --dry-run`, a config mistake)
validates them without importing torch, transformers or peft. Each is defined here once; the
modules that use them (model/presets.py, loop.py, lora.py, ppo.py) import them from here.
"""
from __future__ import annotations

from typing import ClassVar, Literal, Self

from pydantic import Field, model_validator

from gristmill.core.stage import StageConfig
from gristmill.core.train_config import TrainConfig

# Every linear layer of a Llama block: attention projections and the SwiGLU MLP. Adapting all of
# them (not only q/v) is what QLoRA found to match full fine-tuning.
LLAMA_LINEAR_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class ModelConfig(StageConfig):
    """Shape of a Llama-style decoder; the defaults (about 0.5M non-embedding parameters) suit a CPU."""

    hidden_size: int = Field(default=128, gt=0, description="Width of the residual stream (model dimension).")
    num_layers: int = Field(default=2, gt=0, description="Number of transformer blocks.")
    num_heads: int = Field(default=4, gt=0, description="Attention heads per block (no grouped-query sharing).")
    intermediate_size: int = Field(default=512, gt=0, description="Hidden width of the SwiGLU MLP.")
    max_seq_len: int = Field(default=256, gt=1, description="Longest sequence in tokens the model is trained for "
                                                            "(RoPE max_position_embeddings).")
    rope_theta: float = Field(default=10000.0, gt=0, description="RoPE base frequency.")

    @model_validator(mode="after")
    def _check_shape(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by "
                             f"num_heads ({self.num_heads})")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"hidden_size / num_heads = {self.hidden_size // self.num_heads} must be "
                             "even (RoPE rotates pairs of dimensions); change hidden_size or num_heads")
        return self


class LoopConfig(TrainConfig):
    """The shared training config (core.train_config) plus the knobs only this loop has: gradient
    accumulation, the LR schedule's shape, evaluation cadence, compilation, MFU and spike rollback."""

    unhashed_fields: ClassVar[frozenset[str]] = (
        TrainConfig.unhashed_fields | {"eval_every", "compile", "peak_tflops", "fsdp"})

    grad_accum_steps: int = Field(default=1, gt=0, description="Micro-batches each step's batch is split into "
                                                               "(a memory knob; batch_size must divide evenly).")
    tokens_per_step: int | None = Field(
        default=None, gt=0, description="Tokens per optimizer step, all processes together (the global batch, the "
                                        "same whatever the process count). When set, batch_size is the micro-batch "
                                        "(sequences per process per forward pass) and the accumulation follows: "
                                        "tokens_per_step / (processes * batch_size * seq_len), which must be whole.")
    optimizer: Literal["adamw", "muon"] = Field(
        default="adamw", description="adamw: AdamW for every parameter. muon: Muon for the transformer blocks' "
                                     "matrices, AdamW for the embedding, norms and biases, with one lr and "
                                     "weight_decay (model/optim.py).")
    muon_momentum: float = Field(default=0.95, ge=0, lt=1, description="muon only: Muon's Nesterov momentum.")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="Final LR as a fraction of lr (cosine floor).")
    schedule: Literal["cosine", "wsd"] = Field(
        default="cosine", description="LR after warmup: cosine decay to the floor, or wsd (warmup-stable-decay: "
                                      "constant, then linear decay over the last decay_frac of the steps).")
    decay_frac: float = Field(default=0.2, ge=0, le=1, description="wsd only: share of max_steps spent decaying.")
    eval_every: int = Field(default=50, ge=0, description="Run the stage's evaluation every N steps "
                                                           "(and always at the end); 0: only at the end.")
    compile: bool = Field(default=False, description="torch.compile each decoder block (inductor). Pays off on GPU; "
                                                     "on a CPU it adds ~30 s of compilation and gains nothing.")
    fsdp: bool = Field(default=False, description="Shard each decoder block's weights, gradients and optimizer state "
                                                  "over the data-parallel processes (FSDP2, applied by the training "
                                                  "loop; bf16 compute, fp32 gradient reduction). Same result as "
                                                  "replicas up to reduction order (operational).")
    peak_tflops: float | None = Field(
        default=None, gt=0, description="Peak FLOP/s (in TFLOP/s) of one device, for the logged MFU. None: known "
                                        "GPUs by name (bf16 dense), no MFU on CPU.")
    spike_zscore: float = Field(default=6.0, ge=0, description="Roll back when a step's loss exceeds the rolling mean "
                                                                "by this many standard deviations; 0 disables.")
    spike_window: int = Field(default=50, gt=1, description="Steps of loss history the spike mean/std are taken over "
                                                            "(no spike check until the window is full).")
    max_rollbacks: int = Field(default=3, ge=0, description="Rollbacks (spike or non-finite loss/grad) allowed before "
                                                            "the run stops with an error; 0: stop at the first.")

    @model_validator(mode="after")
    def _check_accumulation(self) -> LoopConfig:
        if self.batch_size % self.grad_accum_steps:
            raise ValueError(f"batch_size ({self.batch_size}) must be divisible by "
                             f"grad_accum_steps ({self.grad_accum_steps})")
        if self.tokens_per_step is not None and self.grad_accum_steps != 1:
            raise ValueError("set tokens_per_step or grad_accum_steps, not both "
                             f"(tokens_per_step={self.tokens_per_step}, grad_accum_steps={self.grad_accum_steps})")
        return self

    def with_seq_len(self, seq_len: int, world_size: int = 1) -> Self:
        """For fixed-length sequences trained by `world_size` processes: a copy with tokens_per_step
        resolved into batch_size (sequences per step, all processes) and grad_accum_steps (micro-
        batches of the configured batch_size per process). Refused, naming the keys, when
        tokens_per_step is not a whole number of micro-batches on every process."""
        if self.tokens_per_step is None:
            return self
        micro_tokens = world_size * self.batch_size * seq_len
        if self.tokens_per_step % micro_tokens:
            raise ValueError(f"tokens_per_step ({self.tokens_per_step}) must be a multiple of processes * "
                             f"batch_size * seq_len = {world_size} * {self.batch_size} * {seq_len} = "
                             f"{micro_tokens}; change tokens_per_step, batch_size or the launch's processes")
        accum = self.tokens_per_step // micro_tokens
        return self.model_copy(update={"tokens_per_step": None, "grad_accum_steps": accum,
                                       "batch_size": world_size * self.batch_size * accum})


class LoraConfig(StageConfig):
    """Low-rank adapter shape and regularisation (the knobs of PEFT's LoraConfig that matter)."""

    rank: int = Field(default=8, gt=0, description="Rank r of each adapter (A is r x in, B is out x r).")
    alpha: float = Field(default=16.0, gt=0, description="Scale numerator: the update is (alpha / rank) * B A.")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout on the adapter's input during training.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(LLAMA_LINEAR_MODULES), min_length=1,
        description="Names of the linear submodules that get adapters (Llama: q/k/v/o_proj, gate/up/down_proj).")


class PPOConfig(TrainConfig):
    """PPO hyperparameters beside the shared training config (core.train_config: lr, max_steps,
    batch_size = prompts sampled per PPO step, warmup_frac, AdamW, grad_clip per update, seed,
    checkpoints). Clip ranges, vf_coef, kl_coef, gamma and lam default to TRL 0.x's PPOConfig."""

    minibatch_size: int = Field(default=4, ge=1, description="Responses per optimizer update; divides batch_size.")
    ppo_epochs: int = Field(default=4, ge=1, description="Passes over each rollout's minibatches.")
    clip_range: float = Field(default=0.2, gt=0, description=(
        "Policy ratio clip: ratios outside 1 +- this give no gradient."))
    value_clip_range: float = Field(default=0.2, gt=0, description="How far a value may move from its rollout value "
                                                                    "before the clipped value loss takes over.")
    vf_coef: float = Field(default=0.1, ge=0, description="Weight of the value loss in the total loss.")
    kl_coef: float = Field(default=0.05, ge=0, description=(
        "beta: per-token reward penalty per nat of log(pi / pi_ref)."))
    gamma: float = Field(default=1.0, ge=0, le=1, description="Discount per response token.")
    lam: float = Field(default=0.95, ge=0, le=1, description="GAE lambda: bias (0) vs variance (1) of the advantages.")
    max_new_tokens: int = Field(default=32, ge=1, description="Longest sampled response, in tokens.")
    temperature: float = Field(default=1.0, gt=0, description=(
        "Sampling temperature; log-probs are of logits / temperature."))
    missing_eos_penalty: float = Field(default=0.0, ge=0, description=(
        "Subtracted from the score of a response cut at max_new_tokens before it ended its turn; 0: none."))

    @model_validator(mode="after")
    def _minibatches_fit(self) -> PPOConfig:
        if self.batch_size % self.minibatch_size:
            raise ValueError(f"batch_size ({self.batch_size}) must be divisible by "
                             f"minibatch_size ({self.minibatch_size})")
        return self
