"""PPO: the loss arithmetic on hand-computed values, convergence to the closed-form optimum of the
KL-regularised objective on a one-token bandit, and exact resume."""
from __future__ import annotations

import copy
import math
from collections import Counter

import pytest
import torch
from pydantic import ValidationError

from gristmill.core.chat import prompt_ids
from gristmill.core.stage import MetricsLog, read_metrics
from gristmill.model import ppo
from gristmill.model.checkpoint import checkpoint_place

PROMPT = [{"role": "user", "content": "Say a word."}]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------- config and arithmetic

def test_settings_validate_and_describe_every_field():
    with pytest.raises(ValidationError, match=r"batch_size \(16\) must be divisible by minibatch_size \(5\)"):
        ppo.PPOConfig(batch_size=16, minibatch_size=5)
    with pytest.raises(ValidationError, match="temperature"):
        ppo.PPOConfig(temperature=0)
    assert all(f.description for f in ppo.PPOConfig.model_fields.values())
    assert "checkpoint_every" not in ppo.PPOConfig().hashed_dict()


def test_gae_matches_hand_computation():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, 2.0, 9.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 1.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # row 2 ends after 2 tokens
    advantages, returns = ppo.gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # row 1: d2 = 1 - 0.7 = 0.3; d1 = 0.9*0.7 - 0.6 = 0.03; d0 = 0.9*0.6 - 0.5 = 0.04
    #        A2 = 0.3; A1 = 0.03 + 0.45*0.3 = 0.165; A0 = 0.04 + 0.45*0.165 = 0.11425
    # row 2: the value after the last token is 0 and the masked reward/value are ignored:
    #        d1 = 2 - 1 = 1; d0 = 0.5 + 0.9*1 - 1 = 0.4; A1 = 1; A0 = 0.4 + 0.45*1 = 0.85
    assert torch.allclose(advantages, torch.tensor([[0.11425, 0.165, 0.3], [0.85, 1.0, 0.0]]))
    assert torch.allclose(returns, torch.tensor([[0.61425, 0.765, 1.0], [1.85, 2.0, 0.0]]))


def test_token_rewards_put_the_score_on_the_last_token():
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    rewards, kl = ppo.token_rewards(logps, ref, mask, torch.tensor([10.0, 20.0]), kl_coef=0.1)
    assert torch.allclose(kl, torch.tensor([[0.5, 0.0, -1.0], [1.0, 0.0, 0.0]]))
    assert torch.allclose(rewards, torch.tensor([[-0.05, 0.0, 10.1], [19.9, 0.0, 0.0]]))


def test_clipped_losses_on_hand_values():
    # ratios 1.5, 1.5, 0.5, 0.5 against advantages +1, -1, +1, -1 (clip range 0.2):
    #   -A*r = -1.5, 1.5, -0.5, 0.5 and -A*clip(r) = -1.2, 1.2, -0.8, 0.8;
    #   the larger of each pair: -1.2 (clipped), 1.5, -0.5, 0.8 (clipped) -> mean 0.15
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, clip_frac, approx_kl = ppo.clipped_policy_loss(new, old, adv, torch.ones(1, 4), 0.2)
    assert loss.item() == pytest.approx(0.15) and clip_frac == 0.5
    assert approx_kl == pytest.approx(0.5 * (2 * math.log(1.5) ** 2 + 2 * math.log(0.5) ** 2) / 4)
    # a masked token changes nothing
    padded = ppo.clipped_policy_loss(torch.cat([new, torch.zeros(1, 1)], 1), torch.zeros(1, 5),
                                     torch.cat([adv, torch.full((1, 1), 7.0)], 1),
                                     torch.tensor([[1.0, 1, 1, 1, 0]]), 0.2)
    assert padded[0].item() == pytest.approx(0.15) and padded[1] == 0.5

    # values: new 1.0 vs rollout 0.0 for return 2.0 -> max((1-2)^2, (0.2-2)^2) = 3.24;
    #         new 0.1 (inside the clip range) for return 0 -> 0.01; loss = 0.5 * mean = 0.8125
    vf = ppo.clipped_value_loss(torch.tensor([[1.0, 0.1]]), torch.zeros(1, 2), torch.tensor([[2.0, 0.0]]),
                                torch.ones(1, 2), 0.2)
    assert vf.item() == pytest.approx(0.8125)


def test_whiten_and_prompt_order():
    x, mask = torch.tensor([[1.0, 3.0, 100.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    assert torch.allclose(ppo.whiten(x, mask), torch.tensor([[-1.0, 1.0, 0.0]]), atol=1e-6)
    steps = [ppo.prompt_indices(s, 3, 6, seed=0) for s in range(4)]
    assert sorted(steps[0] + steps[1]) == list(range(6)) == sorted(steps[2] + steps[3])
    assert steps[:2] != steps[2:] and steps == [ppo.prompt_indices(s, 3, 6, seed=0) for s in range(4)]


def _one_of_two_ranks(rank: int, port: int, results) -> None:
    """Rank `rank` of two over gloo: its half of a rollout whitened, its gradient and metric averaged."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ranks = ppo.Ranks(rank, 2)
    torch.manual_seed(0)
    x, mask = torch.randn(4, 5), (torch.rand(4, 5) > 0.3).float()
    mine = slice(2 * rank, 2 * rank + 2)
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.full((3,), float(rank + 1))
    ranks.average_gradients([param])
    # Plain lists: a tensor crosses the queue as shared memory that may be gone once this process exits.
    whitened = ppo.whiten(x[mine], mask[mine], ranks=ranks)
    results.put((rank, whitened.tolist(), param.grad.tolist(), ranks.average({"a": float(rank)})))
    torch.distributed.destroy_process_group()


def test_two_ranks_whiten_and_average_as_one_process_over_the_whole_rollout():
    """Data-parallel PPO: each rank whitens its rows with the statistics of every rank's, so the
    halves put together are the one-process whitening of the whole rollout; gradients and metrics
    are the ranks' means."""
    import multiprocessing

    from gristmill.infra.launch import free_port

    context = multiprocessing.get_context("spawn")
    results, port = context.Queue(), free_port()
    procs = [context.Process(target=_one_of_two_ranks, args=(rank, port, results)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    got = {rank: (torch.tensor(whitened), torch.tensor(grad), metrics)
           for rank, whitened, grad, metrics in (results.get(timeout=120) for _ in procs)}
    for proc in procs:
        proc.join(30)
    torch.manual_seed(0)
    x, mask = torch.randn(4, 5), (torch.rand(4, 5) > 0.3).float()
    halves = torch.cat([got[0][0], got[1][0]])
    assert torch.allclose(halves, ppo.whiten(x, mask), atol=1e-6)
    assert not torch.allclose(got[0][0], ppo.whiten(x[:2], mask[:2]), atol=1e-3)  # not each half alone
    assert all(torch.equal(got[r][1], torch.full((3,), 1.5)) and got[r][2] == {"a": 0.5} for r in (0, 1))


# ---------------------------------------------------------------- the one-token bandit

def _next_token_probs(model, tokenizer) -> torch.Tensor:
    ids = torch.tensor([[*prompt_ids(tokenizer, PROMPT), 0]])  # a dummy response token
    with torch.no_grad():
        logprobs, _ = ppo.response_logprobs(model, ids, torch.ones_like(ids), ids.shape[1] - 1, 1.0)
    return logprobs[0, 0].exp()


@pytest.fixture(scope="module")
def bandit(tiny_model_dir):
    """The tiny random model, edited so that at PROMPT its next-token distribution puts ~96% of
    the mass evenly on 8 arm tokens (8 e^8 against ~1016 e^0); a near-uniform spread over all 1024
    tokens would take far more samples per token to pin down. Tied embeddings: arm rows set to
    8 * h / |h|^2 give each arm logit 8 at the prompt's final hidden state h; the arms are not in
    the prompt, so h is unchanged.
    Returns (policy, tokenizer, arm token ids, their decoded texts)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=True)
    counts = Counter(texts)
    # arms whose text no other token decodes to, so a rule on response text rewards exactly them
    arms = [i for i in range(300, len(texts)) if counts[texts[i]] == 1 and texts[i].strip().isalpha()][:8]
    prompt = prompt_ids(tokenizer, PROMPT)
    assert len(arms) == 8 and not set(arms) & set(prompt)
    with torch.no_grad():
        h = policy(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
        policy.get_input_embeddings().weight[arms] = 8.0 * h / h.norm() ** 2
    return policy, tokenizer, arms, [texts[i] for i in arms]


# PPO's optimiser as these tests were measured with: no warmup, no weight decay, beta2 0.999.
ADAMW = {"warmup_frac": 0.0, "weight_decay": 0.0, "beta2": 0.999}
BANDIT = {**ADAMW, "batch_size": 32, "minibatch_size": 8, "ppo_epochs": 4, "kl_coef": 0.5,
          "max_new_tokens": 1, "lr": 3e-3, "max_steps": 24, "checkpoint_every": 100, "seed": 0}


def test_ppo_reaches_the_kl_regularised_optimum(bandit, tmp_path):
    """With one-token responses, E[r] - beta * KL(pi || pi_ref) is maximised by
    pi*(y) = pi_ref(y) exp(r(y) / beta) / Z. Rewarding 2 of the 8 arms (r = 1, beta = 0.5) moves
    their mass from 0.24 to 0.70: TV(pi_ref, pi*) = 0.46. Measured over seeds 0-2 with these
    settings, TV(pi, pi*) after PPO is 0.010-0.014 (~8 s each); the bound 0.04 leaves ~3x that
    margin yet is well below the TV between pi* and the optimum for a beta 20% off (0.07 for
    1.2 beta, 0.09 for 0.8 beta) or the 0.30 of ignoring the KL penalty, so a mis-scaled or
    missing KL term fails it."""
    base, tokenizer, arms, texts = bandit
    policy, reference = copy.deepcopy(base), copy.deepcopy(base)
    rewarded = set(texts[:2])
    config = ppo.PPOConfig(**BANDIT)

    def reward_fn(prompts, responses):
        assert all(p == PROMPT for p in prompts)
        return torch.tensor([float(r in rewarded) for r in responses])

    pi_ref = _next_token_probs(reference, tokenizer)
    reward = torch.zeros_like(pi_ref)
    reward[arms[:2]] = 1.0
    pi_star = pi_ref * torch.exp(reward / config.kl_coef)
    pi_star /= pi_star.sum()

    def tv(p: torch.Tensor, q: torch.Tensor) -> float:
        return 0.5 * (p - q).abs().sum().item()

    assert pi_ref[arms].sum() > 0.95 and tv(pi_ref, pi_star) == pytest.approx(0.46, abs=0.01)
    lower_beta = pi_ref * torch.exp(reward / (0.8 * config.kl_coef))
    assert tv(pi_star, lower_beta / lower_beta.sum()) > 0.08  # the bound below tells them apart

    stats = ppo.ppo_train(policy, reference, tokenizer, [PROMPT], reward_fn, config, checkpoint_place(tmp_path, None),
                          MetricsLog(tmp_path))
    pi = _next_token_probs(policy, tokenizer)
    assert tv(pi, pi_star) < 0.04
    assert tv(pi, pi_ref) > 0.4
    assert torch.equal(_next_token_probs(reference, tokenizer), pi_ref)  # the reference stays frozen

    assert stats["ppo_steps"] == 24 and stats["ppo_score_initial"] < 0.4
    assert stats["ppo_score_final"] > 0.6  # ~0.70 = pi*(rewarded arms)
    # at the optimum the KL is sum pi* log(pi*/pi_ref), ~0.47 nats here; the sampled estimate is noisy
    assert 0.2 < stats["ppo_kl_final"] < 0.8
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 25))
    assert rows[0]["ppo/kl"] == pytest.approx(0.0, abs=1e-5)  # policy == reference on the first rollout
    assert {"ppo/score", "ppo/kl", "ppo/policy_loss", "ppo/value_loss", "ppo/clip_frac",
            "ppo/entropy", "ppo/approx_kl"} <= rows[-1].keys()
    assert rows[-1]["ppo/entropy"] < rows[0]["ppo/entropy"]


# ---------------------------------------------------------------- resume

RESUME = {**ADAMW, "batch_size": 8, "minibatch_size": 4, "ppo_epochs": 2, "kl_coef": 0.1,
          "max_new_tokens": 4, "lr": 1e-3, "max_steps": 5, "checkpoint_every": 2, "seed": 3,
          "missing_eos_penalty": 0.5}
PROMPTS = [[{"role": "user", "content": f"Count to {n}."}] for n in range(5)]


def _length_reward(prompts, responses):
    return torch.tensor([len(r) / 10.0 for r in responses])


TIMED = ("ppo_checkpoint_s", "ppo_checkpoints")  # stats of this invocation's checkpoints


def _untimed(rows: list[dict]) -> list[dict]:
    """Metric rows without each checkpoint's seconds, which differ between two identical runs."""
    return [{k: v for k, v in r.items() if k != "checkpoint_s"} for r in rows]


def _train(tiny_model_dir, out, reward_fn=_length_reward, offset=0):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    stats = ppo.ppo_train(policy, copy.deepcopy(policy), tokenizer, PROMPTS, reward_fn, ppo.PPOConfig(**RESUME),
                          checkpoint_place(out, None), MetricsLog(out), metrics_step_offset=offset)
    return policy, stats


def test_killed_run_resumes_to_the_same_policy(tiny_model_dir, tmp_path):
    """Killed in step 4 with a checkpoint at step 2, then called again: the same policy, stats
    and metric lines as an uninterrupted run (4-token responses, so GAE spans several tokens)."""
    from transformers import AutoModelForCausalLM

    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    whole.mkdir(), crashed.mkdir()
    expected, expected_stats = _train(tiny_model_dir, whole)
    calls = []

    def dies_in_step_4(prompts, responses):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt("simulated kill")
        return _length_reward(prompts, responses)

    # lines of an earlier trainer (e.g. the reward model's, up to step 3) must survive the resume
    MetricsLog(crashed).log(3, **{"rm/loss": 0.5})
    with pytest.raises(KeyboardInterrupt):
        _train(tiny_model_dir, crashed, dies_in_step_4, offset=3)
    assert [s for s, _ in checkpoint_place(crashed, None).complete()] == [2]
    policy, stats = _train(tiny_model_dir, crashed, offset=3)

    assert stats["ppo_resumed_from_step"] == 2 and stats["ppo_steps"] == 5
    # the same run, but for where it resumed and its own checkpoints' count and seconds
    assert {k: v for k, v in stats.items() if k != "ppo_resumed_from_step" and k not in TIMED} == \
        {k: v for k, v in expected_stats.items() if k != "ppo_resumed_from_step" and k not in TIMED}
    assert stats["ppo_checkpoints"] == 2 and stats["ppo_checkpoint_bytes"] > 0
    want, got = expected.state_dict(), policy.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    assert any(not torch.equal(initial[k], got[k]) for k in initial)  # training did move it
    rows, whole_rows = (_untimed(read_metrics(run / "metrics.jsonl")) for run in (crashed, whole))
    assert rows[0] == {"step": 3, "rm/loss": 0.5}
    assert [r["step"] for r in rows[1:]] == [4, 5, 6, 7, 8]
    assert [{**r, "step": r["step"] - 3} for r in rows[1:]] == whole_rows
    assert [s for s, _ in checkpoint_place(crashed, None).complete()] == [4, 5]  # two kept, the last one final

    # a finished run called again changes nothing
    again, again_stats = _train(tiny_model_dir, crashed, offset=3)
    assert again_stats["ppo_resumed_from_step"] == 5 and len(read_metrics(crashed / "metrics.jsonl")) == 6
    assert all(torch.equal(got[k], v) for k, v in again.state_dict().items())


def test_bad_reward_fn_output_is_an_error(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="reward_fn must return 8 finite scores"):
        _train(tiny_model_dir, tmp_path, lambda prompts, responses: torch.zeros(3))
