"""PPO for a chat model against a reward function, with a KL penalty to a frozen reference model.

TRL 1.x no longer has a PPO trainer, so this is our own loop, after InstructGPT and TRL 0.x:

- rollout: sample one response per prompt from the policy (transformers `generate`, plain sampling
  at `temperature`), stopping at the end of the assistant turn or after `max_new_tokens`;
- per-token rewards: -kl_coef * (log pi - log pi_ref) of each sampled token, plus the reward
  function's score of the whole response on its last token;
- advantages by GAE(gamma, lam) from a value head, whitened over the rollout; returns = A + V;
- `ppo_epochs` passes over shuffled minibatches minimising the clipped policy objective plus
  vf_coef * the clipped value loss, with AdamW (LR decayed linearly to 0) and gradient clipping.

Log-probabilities are those of logits / temperature, the distribution the tokens were sampled
from. Policy and reference run without dropout (eval mode), so before its first update the policy
reproduces its rollout log-probabilities exactly and the PPO ratio starts at 1.

Value head: a linear layer on the policy's final hidden states (the shared trunk of TRL 0.x's
AutoModelForCausalLMWithValueHead) rather than a separate value model initialised from the reward
model (InstructGPT). One forward pass yields logits and values, so a step costs one model's compute
and optimizer state instead of two, which is what a CPU or a memory-bound GPU can afford. The price:
the value loss also moves the trunk the policy reads; vf_coef weighs it. The head starts at zero.

Resume: every `checkpoint_every` steps (and after the last) the policy, value head (safetensors),
optimizer and step go to `checkpoints/step-%07d` of the work directory's place, on its disk or its
artifact store's bucket (model/checkpoint.py: marker with digests written last; a damaged one is
skipped on resume); each one's seconds and bytes are logged in its step's row (checkpoint_s,
checkpoint_bytes). All randomness of a step (which prompts, the sampled tokens, the minibatch
order) is drawn after seeding torch from (seed, step), so a resumed run repeats exactly what an
uninterrupted one does without carrying RNG states across.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import torch

from gristmill.core.chat import Message, prompt_ids
from gristmill.core.progress import Reporter
from gristmill.core.stage import MetricsLog
from gristmill.model.checkpoint import (
    ROW_KEY,
    Place,
    checkpoint_stats,
    read_marker,
    restore_rows,
    resume_point,
    save_checkpoint,
)
from gristmill.model.config import PPOConfig
from gristmill.model.export import generation_config
from gristmill.model.ranks import ONE_PROCESS, Ranks
from gristmill.model.schedule import warmup_linear

log = logging.getLogger("gristmill.ppo")

# (prompts, response texts) -> scores, shape [n]: a reward model's scorer, or a rule in tests
RewardFn = Callable[[list[list[Message]], list[str]], torch.Tensor]
FINAL_WINDOW = 10  # steps averaged into the final score/KL stats


# ---------------------------------------------------------------- the PPO arithmetic (tensors [batch, tokens])

def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)



def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, ranks: Ranks = ONE_PROCESS) -> torch.Tensor:
    """x shifted and scaled to mean 0, variance 1 over the masked entries of every process (0
    elsewhere)."""

    def mean_over_ranks(values: torch.Tensor) -> torch.Tensor:
        total, count = ranks.total((values * mask).sum(), mask.sum())
        return total / count.clamp(min=1)

    mean = mean_over_ranks(x)
    var = mean_over_ranks((x - mean) ** 2)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def token_rewards(logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor, scores: torch.Tensor,
                  kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards, kl) per response token: kl = log pi - log pi_ref of the sampled token (nats),
    reward = -kl_coef * kl, plus the sequence's score on its last token. Responses occupy a prefix
    of each row (mask 1 then 0)."""
    kl = (logps - ref_logps) * mask
    rewards = -kl_coef * kl
    last = mask.sum(1).long() - 1
    rewards[torch.arange(len(scores), device=rewards.device), last] += scores
    return rewards, kl


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and returns (A + V). The value after a response's last
    token is 0: the episode ends there."""
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def clipped_policy_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, clip_range: float) -> tuple[torch.Tensor, float, float]:
    """(PPO-clip loss, share of tokens where the clipped term is the larger loss, approximate KL
    between the rollout and current policy as mean 0.5 * (log ratio)^2)."""
    log_ratio = logps - old_logps
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_range, 1 + clip_range)
    loss = masked_mean(torch.max(unclipped, clipped), mask)
    clip_frac = masked_mean((clipped > unclipped).float(), mask).item()
    approx_kl = masked_mean(0.5 * log_ratio.detach() ** 2, mask).item()
    return loss, clip_frac, approx_kl


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       mask: torch.Tensor, clip_range: float) -> torch.Tensor:
    """0.5 * the larger of the squared errors of the new value and of the value kept within
    clip_range of its rollout value."""
    kept_close = old_values + (values - old_values).clamp(-clip_range, clip_range)
    return 0.5 * masked_mean(torch.max((values - returns) ** 2, (kept_close - returns) ** 2), mask)


# ---------------------------------------------------------------- models

class ValueHead(torch.nn.Module):
    """Value of each state from the policy's final hidden state; zero at initialisation."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden).squeeze(-1)


@overload
def response_logprobs(model: Any, ids: torch.Tensor, attention: torch.Tensor, prompt_len: int,
                      temperature: float, value_head: ValueHead) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def response_logprobs(model: Any, ids: torch.Tensor, attention: torch.Tensor, prompt_len: int,
                      temperature: float, value_head: None = None) -> tuple[torch.Tensor, None]: ...
def response_logprobs(model: Any, ids: torch.Tensor, attention: torch.Tensor, prompt_len: int,
                      temperature: float, value_head: ValueHead | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities over the vocabulary at each response position, [batch, tokens, vocab], and
    with a value head the values of the states those tokens are chosen in, [batch, tokens].
    `ids` is left-padded prompts followed by responses; positions count real tokens only, as in
    `generate`, so these are the distributions the responses were sampled from."""
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    n_response = ids.shape[1] - prompt_len
    out = model(input_ids=ids, attention_mask=attention, position_ids=positions,
                output_hidden_states=value_head is not None, logits_to_keep=n_response + 1)
    logprobs = (out.logits[:, :-1].float() / temperature).log_softmax(-1)
    values = value_head(out.hidden_states[-1][:, prompt_len - 1:-1].float()) if value_head else None
    return logprobs, values


def _left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq):], attention[row, width - len(seq):] = torch.tensor(seq), 1
    return ids, attention


@dataclass(kw_only=True)
class Rollout:
    ids: torch.Tensor  # [batch, prompt_len + tokens]: left-padded prompts, then responses
    attention: torch.Tensor  # same shape: 1 on real prompt and response tokens
    prompt_len: int
    mask: torch.Tensor  # [batch, tokens]: 1 on response tokens (up to and including the stop token)
    texts: list[str]  # decoded responses without special tokens
    ended: torch.Tensor  # [batch] bool: the response ended its turn before max_new_tokens


@torch.no_grad()
def sample_responses(policy: Any, tokenizer: Any, prompts: Sequence[Sequence[Message]],
                     cfg: PPOConfig) -> Rollout:
    """One sampled response per prompt, cut after its first stop token."""
    device = next(policy.parameters()).device
    config = generation_config(tokenizer)  # the stop tokens: end of turn, end of document
    ids, attention = _left_pad([prompt_ids(tokenizer, p) for p in prompts], tokenizer.pad_token_id)
    # Plain sampling: top_k=0 and top_p=1 turn off the filters generate applies by default.
    out = policy.generate(input_ids=ids.to(device), attention_mask=attention.to(device),
                          eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
                          do_sample=True, temperature=cfg.temperature, top_k=0, top_p=1.0,
                          max_new_tokens=cfg.max_new_tokens)
    prompt_len = ids.shape[1]
    response = out[:, prompt_len:]
    is_stop = torch.isin(response, torch.tensor(config.eos_token_id, device=device))
    after_stop = (is_stop.cumsum(1) - is_stop.long()) > 0
    response = response.masked_fill(after_stop, tokenizer.pad_token_id)
    mask = (~after_stop).long()
    texts = tokenizer.batch_decode([r[m.bool()] for r, m in zip(response, mask)], skip_special_tokens=True)
    return Rollout(ids=torch.cat([ids.to(device), response], 1),
                   attention=torch.cat([attention.to(device), mask], 1), prompt_len=prompt_len,
                   mask=mask, texts=texts, ended=is_stop.any(1))


# ---------------------------------------------------------------- one PPO step

def _scores(reward_fn: RewardFn, prompts: list[list[Message]], texts: list[str]) -> torch.Tensor:
    scores = torch.as_tensor(reward_fn(prompts, texts), dtype=torch.float32).cpu()
    if scores.shape != (len(texts),) or not torch.isfinite(scores).all():
        raise ValueError(f"reward_fn must return {len(texts)} finite scores, "
                         f"got shape {tuple(scores.shape)}: {scores}")
    return scores


@torch.no_grad()
def score_rollout(policy: Any, value_head: ValueHead, reference: Any, roll: Rollout, scores: torch.Tensor,
                  cfg: PPOConfig, ranks: Ranks = ONE_PROCESS) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Rollout log-probs, values, advantages and returns, and the rollout's metrics."""
    tokens = roll.ids[:, roll.prompt_len:, None]
    mask = roll.mask.float()
    logprobs, values = response_logprobs(policy, roll.ids, roll.attention, roll.prompt_len,
                                         cfg.temperature, value_head)
    ref_logprobs, _ = response_logprobs(reference, roll.ids, roll.attention, roll.prompt_len, cfg.temperature)
    logps, ref_logps = logprobs.gather(-1, tokens).squeeze(-1), ref_logprobs.gather(-1, tokens).squeeze(-1)
    penalised = scores.to(mask.device) - cfg.missing_eos_penalty * (~roll.ended).float()
    rewards, kl = token_rewards(logps, ref_logps, mask, penalised, cfg.kl_coef)
    values = values * mask
    advantages, returns = gae(rewards, values, mask, cfg.gamma, cfg.lam)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    metrics = {"ppo/score": scores.mean().item(), "ppo/kl": kl.sum(1).mean().item(),
               "ppo/reward": rewards.sum(1).mean().item(), "ppo/entropy": masked_mean(entropy, mask).item(),
               "ppo/response_tokens": mask.sum(1).mean().item(), "ppo/ended_frac": roll.ended.float().mean().item()}
    batch = {"logps": logps, "values": values, "advantages": whiten(advantages, mask, ranks=ranks),
             "returns": returns}
    return batch, ranks.average(metrics)


def optimise(policy: Any, value_head: ValueHead, optimizer: torch.optim.Optimizer, roll: Rollout,
             batch: dict[str, torch.Tensor], cfg: PPOConfig, ranks: Ranks = ONE_PROCESS) -> dict[str, float]:
    """`ppo_epochs` passes of clipped-loss updates over shuffled minibatches of one rollout (this
    process's share of each minibatch; the gradients are averaged over the processes)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    tokens, mask = roll.ids[:, roll.prompt_len:, None], roll.mask.float()
    sums: dict[str, float] = {}
    updates = 0
    for _ in range(cfg.ppo_epochs):
        for mb in torch.randperm(len(mask)).split(cfg.minibatch_size // ranks.world):
            logprobs, values = response_logprobs(policy, roll.ids[mb], roll.attention[mb], roll.prompt_len,
                                                 cfg.temperature, value_head)
            logps = logprobs.gather(-1, tokens[mb]).squeeze(-1)
            pg_loss, clip_frac, approx_kl = clipped_policy_loss(
                logps, batch["logps"][mb], batch["advantages"][mb], mask[mb], cfg.clip_range)
            vf_loss = clipped_value_loss(values, batch["values"][mb], batch["returns"][mb], mask[mb],
                                         cfg.value_clip_range)
            optimizer.zero_grad(set_to_none=True)
            (pg_loss + cfg.vf_coef * vf_loss).backward()
            ranks.average_gradients(params)
            max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            optimizer.step()
            row = {"policy_loss": pg_loss.item(), "value_loss": vf_loss.item(), "clip_frac": clip_frac,
                   "approx_kl": approx_kl, "grad_norm": grad_norm.item()}
            sums = {k: sums.get(k, 0.0) + v for k, v in row.items()}
            updates += 1
    return ranks.average({f"ppo/{k}": v / updates for k, v in sums.items()})


def prompt_indices(step: int, batch_size: int, n_prompts: int, seed: int) -> list[int]:
    """Prompts of step `step` (0-based): consecutive slices of a seeded permutation per pass over
    the prompts, so every prompt is used once per pass."""
    out = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, index = divmod(position, n_prompts)
        order = torch.randperm(n_prompts, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(order[index]))
    return out


def ppo_step(step: int, policy: Any, value_head: ValueHead, reference: Any, optimizer: torch.optim.Optimizer,
             tokenizer: Any, prompts: list[list[Message]], reward_fn: RewardFn, cfg: PPOConfig,
             ranks: Ranks = ONE_PROCESS) -> dict[str, float]:
    """Step `step` (0-based): a rollout of this process's share of the step's prompts, its
    scores, and the updates on it; returns the step's metrics (over every process)."""
    # The step's sampling and minibatch order, a stream of its own in each process.
    torch.manual_seed(cfg.seed * 1_000_003 + step * ranks.world + ranks.rank)
    chosen = [prompts[i] for i in prompt_indices(step, cfg.batch_size, len(prompts), cfg.seed)]
    chosen = chosen[ranks.rank::ranks.world]
    roll = sample_responses(policy, tokenizer, chosen, cfg)
    scores = _scores(reward_fn, chosen, roll.texts)
    batch, row = score_rollout(policy, value_head, reference, roll, scores, cfg, ranks)
    # Warmup, then linear decay to 0 (TRL's PPO default): a pure function of the step, so resume
    # needs no scheduler state; the shrinking steps let the policy settle instead of jittering
    # around the optimum, which whitened advantages never let die down at a constant LR.
    lr = cfg.lr * warmup_linear(step, cfg.max_steps, cfg.warmup_frac)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return {**row, **optimise(policy, value_head, optimizer, roll, batch, cfg, ranks), "ppo/lr": lr}


# ---------------------------------------------------------------- checkpoints and the loop

def _save(checkpoints: Place, state: dict[str, Any], modules: dict[str, Any], keep: int,
          ranks: Ranks, metrics: MetricsLog) -> dict[str, float]:
    """Weights as safetensors (policy and value head), the optimizer's tensors with torch.save;
    written by the main process (every process holds the same). Returns checkpoint_s and _bytes."""
    from safetensors.torch import save_model

    def write(directory: Path) -> None:
        if not ranks.main:
            return
        save_model(modules["policy"], str(directory / "policy.safetensors"))
        save_model(modules["value_head"], str(directory / "value_head.safetensors"))
        torch.save(modules["optimizer"].state_dict(), directory / "optimizer.pt")

    model_bytes = sum(p.numel() * p.element_size() for p in modules["policy"].parameters())
    return save_checkpoint(checkpoints, state, keep, write, expected_bytes=3 * model_bytes, main=ranks.main,
                           barrier=ranks.barrier, metrics=metrics)


def _resume(checkpoints: Place, modules: dict[str, Any], ranks: Ranks) -> tuple[dict[str, Any], Path | None]:
    """The newest checkpoint that verifies, loaded without unpickling: safetensors weights, and the
    optimizer state with `weights_only=True` (by every process); its saved state and its folder."""
    from safetensors.torch import load_model

    good = resume_point(checkpoints, main=ranks.main, barrier=ranks.barrier)
    if good is None:
        return {"step": 0, "scores": [], "kls": []}, None
    step, path = good
    device = next(modules["policy"].parameters()).device
    load_model(modules["policy"], str(path / "policy.safetensors"), device=str(device))
    load_model(modules["value_head"], str(path / "value_head.safetensors"), device=str(device))
    modules["optimizer"].load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=True))
    log.info("resuming PPO from step %d (%s)", step, path)
    return read_marker(path), path


def ppo_train(policy: Any, reference: Any, tokenizer: Any, prompts: Sequence[Sequence[Message]],
              reward_fn: RewardFn, cfg: PPOConfig, checkpoints: Place, metrics: MetricsLog, *,
              metrics_step_offset: int = 0) -> dict[str, Any]:
    """Train `policy` in place with PPO for `cfg.max_steps` steps, resuming from the last
    checkpoint in `checkpoints` (the caller builds the place, exports the policy, then may delete
    them with `checkpoints.remove()`). `reference` is the frozen policy before training, on the same
    device. Step s is logged to `metrics` as step s + metrics_step_offset (to follow, e.g., the
    reward model's steps in the same metrics.jsonl) with: ppo/score (mean reward_fn score),
    ppo/kl (summed log pi/pi_ref per response), ppo/reward, ppo/entropy, ppo/policy_loss,
    ppo/value_loss, ppo/clip_frac, ppo/approx_kl, ppo/grad_norm, ppo/response_tokens,
    ppo/ended_frac, ppo/lr. Under a data-parallel launch (Ranks) each process rolls out its share
    of a step's prompts and every process takes the same optimizer step; the main process logs
    and checkpoints. Seeds torch's global RNG at every step. Returns ppo_steps,
    ppo_resumed_from_step, ppo_score_initial (step 1), ppo_score_final and ppo_kl_final (means
    over the last steps)."""
    if not prompts:
        raise ValueError("ppo_train needs at least one prompt")
    device = next(policy.parameters()).device
    ranks = Ranks.of_launch(device)
    if cfg.batch_size % ranks.world or cfg.minibatch_size % ranks.world:
        raise ValueError(f"ppo's batch_size ({cfg.batch_size}) and minibatch_size ({cfg.minibatch_size}) must "
                         f"split evenly over the {ranks.world} processes of the launch; make them multiples "
                         f"of {ranks.world}")
    prompts = [list(p) for p in prompts]
    policy.eval()  # no dropout: rollout and update log-probs must agree (see module docstring)
    reference.to(device).eval().requires_grad_(False)
    value_head = ValueHead(policy.config.get_text_config().hidden_size).to(device)
    optimizer = torch.optim.AdamW([*policy.parameters(), *value_head.parameters()], lr=cfg.lr,
                                  betas=(cfg.beta1, cfg.beta2), eps=1e-5,
                                  weight_decay=cfg.weight_decay)
    modules = {"policy": policy, "value_head": value_head, "optimizer": optimizer}
    state, resumed_at = _resume(checkpoints, modules, ranks)
    resumed_from = state["step"]
    if ranks.main:  # the one process that writes metrics.jsonl
        metrics.truncate_after(metrics_step_offset + resumed_from)  # lines of steps redone now
        if resumed_at is not None:
            restore_rows(metrics, metrics_step_offset + resumed_from, state, resumed_at)
    saves: list[dict[str, float]] = []
    with Reporter("ppo", unit="step", enabled=ranks.main) as progress:
        progress.start(cfg.max_steps, done=resumed_from)
        while state["step"] < cfg.max_steps:
            step = state["step"]
            row = ppo_step(step, policy, value_head, reference, optimizer, tokenizer, prompts, reward_fn, cfg, ranks)
            state = {"step": step + 1, "scores": state["scores"] + [row["ppo/score"]],
                     "kls": state["kls"] + [row["ppo/kl"]]}
            if state["step"] % cfg.checkpoint_every == 0 or state["step"] == cfg.max_steps:
                saves.append(_save(checkpoints, {**state, ROW_KEY: row}, modules, cfg.keep_checkpoints, ranks,
                                   metrics))
                row = {**row, **saves[-1]}  # the row, saved with the checkpoint, is written after it
            if ranks.main:
                metrics.log(metrics_step_offset + step + 1, **row)
            progress.advance(1, score=row["ppo/score"], kl=row["ppo/kl"])
    recent = slice(-FINAL_WINDOW, None)
    return {"ppo_steps": state["step"], "ppo_resumed_from_step": resumed_from,
            "ppo_score_initial": state["scores"][0],
            "ppo_score_final": sum(state["scores"][recent]) / len(state["scores"][recent]),
            "ppo_kl_final": sum(state["kls"][recent]) / len(state["kls"][recent]),
            **{f"ppo_{k}": v for k, v in checkpoint_stats(saves).items()}}
