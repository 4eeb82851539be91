"""Multi-turn episodes without a model: the tokens of policy and environment turns (the loss mask decodes back to
exactly the policy's turns; the whole row is the chat template's rendering of the conversation), and environments in
worker processes (a hung step ends its episode and is counted, an exception or a protocol breach names the call)."""

from __future__ import annotations

import pathlib
import time

import pytest
from chat_tokenizers import make_chat_tokenizer_dir

from align_pipeline.config import ConfigError, EnvConfig, from_dict
from align_pipeline.data.tokenizer import load_tokenizer
from align_pipeline.envs.base import EnvError, load_environment_class
from align_pipeline.envs.pool import EnvPool
from align_pipeline.train.core.batches import to_rows
from align_pipeline.train.core.episodes import Episode, Turns

HERE = pathlib.Path(__file__).parent
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(make_chat_tokenizer_dir(tmp_path_factory.mktemp("tok") / "chatml", "chatml_tools"))


def test_policy_and_environment_turns_make_the_templates_conversation_and_mask_only_the_policy(tok):
    turns = Turns(tok)
    end = tok.stop_ids[0]  # <|im_end|>
    ep = Episode({"prompt": "What is 12 + 30?"}, "episode 0", [{"role": "user", "content": "What is 12 + 30?"}],
                 TOOLS, [])
    ep.prompt_ids = turns.first(ep.messages, ep.tools, ep.label)
    call = tok.encode('<tool_call>{"name": "calculator", "arguments": {"expression": "12 + 30"}}</tool_call>') + [end]
    ep.add(call, True, [-0.5] * len(call))
    ep.messages.append({"role": "assistant", "content": tok.decode(call[:-1])})
    result = [{"role": "tool", "content": "42"}]
    ep.add(turns.environment(ep, call, result), False)
    ep.messages += result
    answer = tok.encode("The answer is 42.") + [end]
    ep.add(answer, True, [-0.25] * len(answer))
    ep.messages.append({"role": "assistant", "content": tok.decode(answer[:-1])})

    rows = to_rows([ep.prompt_ids], [ep.tokens], 256, tok.pad_id, [ep.logprobs], masks=[ep.policy])
    mask = rows["loss_mask"][0] == 1
    assert rows["labels"][0][mask].tolist() == call + answer  # the loss: the policy's tokens, nothing else
    assert set(rows["rollout_logp"][0][mask].tolist()) == {-0.5, -0.25} and not rows["rollout_logp"][0][~mask].any()
    text = tok.decode(ep.ids, skip_special_tokens=False)
    assert text + "\n" == tok.chat_template.render(ep.messages, tools=TOOLS)  # what the template renders
    assert "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n" in tok.decode(
        [t for t, p in zip(ep.tokens, ep.policy) if not p], skip_special_tokens=False)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    forgetful = load_tokenizer(make_chat_tokenizer_dir(tmp_path / "f", "forgetful"))  # drops non-last assistant text
    turns = Turns(forgetful)
    ep = Episode({}, "episode 3 (prompt 'x', sample 1)", [{"role": "user", "content": "hi"}], None, [])
    ep.prompt_ids = turns.first(ep.messages, None, ep.label)
    said = forgetful.encode("hello") + [forgetful.stop_ids[0]]
    ep.messages.append({"role": "assistant", "content": "hello"})
    with pytest.raises(EnvError, match=r"episode 3 \(prompt 'x', sample 1\): the chat template does not render"):
        turns.environment(ep, said, [{"role": "user", "content": "again"}])


@pytest.fixture
def on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # spawned workers inherit sys.path


def test_a_hung_step_ends_its_call_is_counted_and_the_others_answer(on_path):
    pool = EnvPool("toy_envs:Nudge", {"hang_on": 1, "turns": 3}, workers=2, timeout_s=2.0)
    try:
        user = [{"role": "user", "content": "q"}]
        calls = [(user + [{"role": "assistant", "content": "a"}], {"answer": 1}),  # turn 1: hangs
                 (user + [{"role": "assistant", "content": "a"}] * 2, {"answer": 1}),
                 (user + [{"role": "assistant", "content": "1"}] * 3, {"answer": 1})]
        t0 = time.monotonic()
        answers, timeouts = pool.run("step", calls, ["e0", "e1", "e2"])
        assert time.monotonic() - t0 < 60 and timeouts == 1 and answers[0] is None
        assert answers[1] == {"messages": [{"role": "user", "content": " more:"}], "reward": 0.25, "done": False,
                              "info": {}}
        assert answers[2] == {"messages": [], "reward": 1.0, "done": True, "info": {"correct": True}}
    finally:
        pool.close()


def test_exceptions_and_protocol_breaches_name_the_call(on_path):
    pool = EnvPool("toy_envs:Nudge", {"raise_on": 2}, workers=1, timeout_s=30.0)
    try:
        with pytest.raises(EnvError, match=r"toy_envs:Nudge: step\(\) of episode 5, turn 2 failed: ValueError: boom"):
            pool.run("step", [([{"role": "assistant", "content": "a"}] * 2, {})], ["episode 5, turn 2"])
    finally:
        pool.close()
    bad = EnvPool("toy_envs:BadStep", {}, workers=1, timeout_s=30.0)
    try:
        with pytest.raises(EnvError, match=r"episode 0, turn 1 failed: EnvError: step\(\): step\(\) must return"):
            bad.run("step", [([], {})], ["episode 0, turn 1"])
    finally:
        bad.close()


def test_env_config_is_checked_when_the_parameters_load(on_path):
    assert load_environment_class("toy_envs:Nudge", "k").__name__ == "Nudge"
    with pytest.raises(ConfigError, match=r"params:reinforce.env.name='toy_envs:nothing': toy_envs has no attribute"):
        from_dict(EnvConfig, {"name": "toy_envs:nothing"}, "params:reinforce.env")
    with pytest.raises(ConfigError, match="max_turns"):
        from_dict(EnvConfig, {"name": "toy_envs:Nudge", "max_turns": 0}, "params:reinforce.env")


def test_ppo_places_each_turns_reward_on_its_last_token_and_skips_the_environment():
    """One episode: prompt, policy turn (2 tokens), environment turn (2 tokens), policy turn (1 token). Turn rewards
    0.25 and 1.0, score = their sum + 0.5 from the reward section; no KL (beta 0), values 0, gamma = lambda = 1:
    every policy token's advantage is the rewards from its turn on: [1.75, 1.75, -, -, 1.5]."""
    import torch

    from align_pipeline.config import PPOConfig, PPOLossConfig
    from align_pipeline.train.ppo import advantages_and_returns

    cfg = from_dict(PPOConfig, {"loss": {"gamma": 1.0, "lam": 1.0, "whiten_advantages": False},
                                "env": {"name": "toy_envs:Nudge", "reward_weight": 1.0}}, "ppo")
    assert isinstance(cfg.loss, PPOLossConfig)
    mask = torch.tensor([[0.0, 1, 1, 0, 0, 1, 0]])
    turns = torch.tensor([[0.0, 0, 0.25, 0, 0, 1.0, 0]])
    zeros = torch.zeros(1, 7)
    scores = torch.tensor([0.25 + 1.0 + 0.5])
    _, advantages, returns, _ = advantages_and_returns(cfg, scores, zeros, zeros, zeros, mask, 0.0, None, turns)
    assert advantages.tolist() == [[0.0, 1.75, 1.75, 0.0, 0.0, 1.5, 0.0]] and torch.equal(returns, advantages)
