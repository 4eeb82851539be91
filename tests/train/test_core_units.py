"""Unit tests of the training toolbox's pure pieces (no torchrun): rollout rows, resumable batches, the prompt
stream, DP statistics, sequence rewards and the vocab-parallel entropy, with hand-computed values."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from one_process import dist

from align_pipeline.config import ConfigError, RewardConfig, from_dict
from align_pipeline.config.checks import attribute_weights, check_reward_model
from align_pipeline.model.logprobs import token_entropy
from align_pipeline.model.sequences import attribute_rewards, pair_batch, sequence_rewards
from align_pipeline.rewards import RewardFunctions
from align_pipeline.train.core.batches import ArrayBatches, PromptStream, split_rows, to_rows
from align_pipeline.train.core.metrics import DPStats
from align_pipeline.train.core.rollout import Rollout, rollout_stats, score


def test_to_rows_aligns_labels_and_loss_mask_with_the_response():
    rows = to_rows([[1, 2, 3], [7]], [[4, 5], [8, 9, 6]], seq_length=6, pad_id=0)
    assert rows["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0], [7, 8, 9, 6, 0, 0]]
    assert rows["labels"].tolist() == [[2, 3, 4, 5, 0, 0], [8, 9, 6, 0, 0, 0]]
    # label t = token t+1: the mask marks exactly the positions whose label is a response token
    assert rows["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]]
    assert rows["labels"][rows["loss_mask"] > 0].tolist() == [4, 5, 8, 9, 6]


def test_to_rows_truncates_at_seq_length():
    rows = to_rows([[1, 2]], [[3, 4, 5, 6]], seq_length=4, pad_id=0)
    assert rows["input_ids"].tolist() == [[1, 2, 3, 4]]
    assert rows["loss_mask"].tolist() == [[0, 1, 1, 0]]  # the label of the last position is cut off


def test_array_batches_are_a_pure_function_of_the_step_and_split_over_dp():
    arrays = {"x": np.arange(10)}
    whole = ArrayBatches(arrays, 4, 2, dist(), seed=3)
    again = ArrayBatches(arrays, 4, 2, dist(), seed=3)
    assert [whole.global_indices(s).tolist() for s in range(5)] == [again.global_indices(s).tolist()
                                                                     for s in (0, 1, 2, 3, 4)]
    # steps 0..4 cover 20 samples = two epochs of 10, each a permutation
    first_epoch = np.concatenate([whole.global_indices(s) for s in range(5)])
    assert sorted(first_epoch[:10]) == list(range(10)) and sorted(first_epoch[10:]) == list(range(10))
    ranks = [ArrayBatches(arrays, 4, 2, dist(r, 2), seed=3) for r in range(2)]
    for step in range(3):
        mine = [torch.cat([mb["x"] for mb in b.microbatches(step)]).tolist() for b in ranks]
        assert mine[0] + mine[1] == whole.global_indices(step).tolist()
        assert all(len(b.microbatches(step)) == 1 for b in ranks)  # 4 / DP 2 = 2 = one micro-batch of 2


def test_eval_microbatches_pad_with_masked_rows():
    arrays = {"x": np.arange(5), "loss_mask": np.ones((5, 3), dtype=np.float32)}
    mbs = ArrayBatches(arrays, 2, 2, dist(), seed=0, shuffle=False).eval_microbatches(with_index=True)
    assert [mb["index"].tolist() for mb in mbs] == [[0, 1], [2, 3], [4, -1]]
    assert mbs[-1]["valid"].tolist() == [True, False] and mbs[-1]["loss_mask"][1].sum() == 0


def test_prompt_stream_is_resumable_and_reshuffles_per_epoch():
    records = [{"i": i} for i in range(6)]
    stream = PromptStream(records, 3, dist(), seed=1)
    its = [[r["i"] for r in stream.local(it)] for it in range(4)]
    assert sorted(its[0] + its[1]) == list(range(6)) and sorted(its[2] + its[3]) == list(range(6))
    assert its[:2] != its[2:]  # another order in the next epoch
    assert its == [[r["i"] for r in PromptStream(records, 3, dist(), seed=1).local(it)] for it in range(4)]
    assert stream.consumed(4) == 12
    with pytest.raises(ValueError, match="split over DP=2"):
        PromptStream(records, 3, dist(0, 2), seed=1)


def test_split_rows_follows_the_order():
    rows = {"a": torch.arange(5), "input_ids": torch.ones(5, 8, dtype=torch.long), "loss_mask": torch.ones(5, 8)}
    out, order = split_rows(rows, 2, torch.tensor([4, 0, 3, 1, 2]))
    assert [mb["a"].tolist() for mb in out] == [[4, 0], [3, 1], [2]] and order.tolist() == [4, 0, 3, 1, 2]


def test_split_rows_cuts_each_micro_batch_to_the_columns_its_rows_use():
    """Rows of 300 columns whose sequences end at 10, 150, 290 and 40 tokens (prompt + response; the loss mask ends
    one column earlier): the rows are grouped by length (a stable sort of the given order), and each micro-batch
    keeps its longest row's columns rounded up to a multiple of 128 (at most all 300), in every per-token tensor;
    per-row tensors are only indexed; a row without response tokens keeps everything."""
    ends = [10, 150, 290, 40]
    mask = torch.zeros(4, 300)
    for i, end in enumerate(ends):
        mask[i, 3 : end - 1] = 1  # labels 3 .. end-2: tokens 4 .. end-1 are the response
    rows = {"input_ids": torch.arange(1200).view(4, 300), "loss_mask": mask, "advantages": torch.arange(4.0),
            "ref_logp": torch.randn(4, 300)}
    out, order = split_rows(rows, 2, torch.tensor([1, 3, 0, 2]))  # grouped by length: rows 0, 3 then 1, 2
    assert order.tolist() == [0, 3, 1, 2]
    assert [mb["input_ids"].shape[1] for mb in out] == [128, 300]  # max(10, 40) -> 128; max(150, 290) -> 300
    assert torch.equal(out[0]["input_ids"], rows["input_ids"][[0, 3], :128])
    assert torch.equal(out[1]["ref_logp"], rows["ref_logp"][[1, 2]])
    assert out[1]["advantages"].tolist() == [1.0, 2.0]
    out, order = split_rows(rows, 1, torch.tensor([1, 3]))
    assert order.tolist() == [3, 1] and [mb["input_ids"].shape[1] for mb in out] == [128, 256]
    rows["loss_mask"][3] = 0  # no response token (a prompt that filled seq_length)
    assert split_rows(rows, 1, torch.tensor([3]))[0][0]["loss_mask"].shape[1] == 300


def test_dp_stats_means_and_stds(single_process_group):
    stats = DPStats(dist())
    stats.add("r", torch.tensor([1.0, 2.0, 3.0, 6.0]))
    stats.add("tok", torch.tensor([[1.0, 5.0], [3.0, 100.0]]), mask=torch.tensor([[1, 1], [1, 0]]))
    stats.add("frac", torch.tensor([1.0, 0.0, 0.0, 0.0]), std=False)
    out = stats.reduce()
    assert out["r_mean"] == pytest.approx(3.0) and out["r_std"] == pytest.approx(math.sqrt(3.5))  # population std
    assert out["tok_mean"] == pytest.approx(3.0) and out["tok_std"] == pytest.approx(math.sqrt(8 / 3))
    assert out["frac"] == pytest.approx(0.25) and "frac_mean" not in out


def test_dp_stats_maxima_and_quantiles(single_process_group):
    stats = DPStats(dist())
    stats.add_max("diff/max", torch.tensor([[0.5, 9.0], [2.0, 1.0]]), mask=torch.tensor([[1, 0], [1, 1]]))
    stats.add_max("none/max", torch.tensor([1.0]), mask=torch.tensor([0]))
    # lengths 1..10: torch.quantile interpolates linearly, p50 = 5.5, p90 = 9.1, max = 10
    stats.add_quantiles("len", torch.arange(1.0, 11.0), {"p50": 0.5, "p90": 0.9, "max": 1.0})
    out = stats.reduce()
    assert out["diff/max"] == 2.0 and math.isnan(out["none/max"])  # 9.0 is outside the mask
    assert out["len/p50"] == pytest.approx(5.5) and out["len/p90"] == pytest.approx(9.1) and out["len/max"] == 10


def test_sequence_rewards_last_and_mean_pooling():
    values = torch.tensor([[10.0, 1.0, 2.0, 3.0, 99.0]]).unsqueeze(-1)  # [1, 5, 1]
    loss_mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0]])  # labels 1, 2 = input tokens 2, 3 are the response
    assert sequence_rewards(values, loss_mask, "last").tolist() == [3.0]  # value at input position 3
    assert sequence_rewards(values, loss_mask, "mean").tolist() == [2.5]  # mean of positions 2, 3
    with pytest.raises(ValueError, match="pooling"):
        sequence_rewards(values, loss_mask, "max")


def test_attribute_rewards_combine_the_outputs_of_a_multi_attribute_model():
    values = torch.tensor([[[0.0, 0.0], [1.0, 10.0], [3.0, 30.0], [99.0, 99.0]]])  # [1, 4, A=2]
    loss_mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])  # the response is input positions 1, 2
    assert attribute_rewards(values, loss_mask, "mean", None).tolist() == [2.0]  # output 0 alone
    assert attribute_rewards(values, loss_mask, "mean", [1.0, 0.5]).tolist() == [2.0 + 0.5 * 20.0]
    assert attribute_rewards(values, loss_mask, "last", [0.0, -1.0]).tolist() == [-30.0]
    with pytest.raises(ValueError, match="3 attribute weights for a reward model with 2 outputs"):
        attribute_rewards(values, loss_mask, "mean", [1.0, 1.0, 1.0])


def test_attribute_weights_are_required_for_a_multi_attribute_reward_model(tmp_path):
    assert attribute_weights(None, 1, "params:ppo.reward", "rm") is None  # one output: its score as it is
    assert attribute_weights([2.0], 1, "params:ppo.reward", "rm") == [2.0]
    assert attribute_weights([1.0, 0.0, 0.5], 3, "params:ppo.reward", "rm") == [1.0, 0.0, 0.5]
    with pytest.raises(ConfigError, match=r"^params:ppo.reward.reward_model_attribute_weights is not set, but the "
                                          r"reward model /m/rm has 3 outputs \(a multi-attribute regression model\)"):
        attribute_weights(None, 3, "params:ppo.reward", "/m/rm")
    with pytest.raises(ConfigError, match=r"^params:ppo.reward.reward_model_attribute_weights has 2 weights, but the "
                                          r"reward model rm has 3 outputs"):
        attribute_weights([1.0, 1.0], 3, "params:ppo.reward", "rm")
    (tmp_path / "meta.json").write_text('{"head": "value", "num_outputs": 2}')
    cfg = from_dict(RewardConfig, {}, "params:reinforce.reward")
    with pytest.raises(ConfigError, match=r"params:reinforce.reward.reward_model_attribute_weights is not set"):
        check_reward_model(cfg, tmp_path, "params:reinforce.reward")
    check_reward_model(from_dict(RewardConfig, {"reward_model_attribute_weights": [1, 1]}), tmp_path, "k")
    check_reward_model(cfg, None, "k")  # no reward model
    check_reward_model(cfg, tmp_path / "missing", "k")  # no meta.json: loading it reports that


def _rollout(records: list[dict], texts: list[str], eos: list[bool]) -> Rollout:
    return Rollout(records, [[5]] * len(texts), eos, {"loss_mask": torch.ones(len(texts), 4)}, texts)


def test_score_weights_the_reward_functions_and_the_eos_penalty(single_process_group):
    cfg = from_dict(RewardConfig, {"reward_model_weight": 0.0, "missing_eos_penalty": 0.25, "functions": [
        {"name": "align_pipeline.rewards:demo_task", "weight": 2.0},
        {"name": "align_pipeline.rewards:exact_match", "weight": 0.5}]})
    fns = RewardFunctions.load(cfg, "reward")
    recs = [{"prompt": "add: 12+34\n", "answer": "46", "prompt_ids": [1]},
            {"prompt": "reverse: abc\n", "answer": "cba", "prompt_ids": [1]}]
    r = _rollout([recs[0], recs[0], recs[1]], ["46", "47", "cba"], [True, True, False])
    s = score(r, cfg, fns, None, None, 2, dist())
    assert s.total.tolist() == [2.5, 0.0, 2.5 - 0.25] and s.correct.tolist() == [1.0, 0.0, 1.0]
    assert s.functions.tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]] and s.rm is None
    out = rollout_stats(r, s, fns, dist()).reduce()
    assert out["rollout/accuracy"] == pytest.approx(2 / 3)
    assert out["rollout/reward_demo_task"] == pytest.approx(2 / 3) and "rollout/reward_exact_match" in out


def test_score_without_reward_functions_has_no_accuracy_and_needs_no_answer(single_process_group):
    cfg = from_dict(RewardConfig, {"reward_model_weight": 1.0, "missing_eos_penalty": 1.0})
    fns = RewardFunctions.load(cfg, "reward")
    r = _rollout([{"prompt": "what?", "answer": None, "prompt_ids": [1]}] * 2, ["a", "b"], [True, False])
    s = score(r, cfg, fns, None, None, 2, dist())
    assert s.total.tolist() == [0.0, -1.0] and s.correct is None and s.functions is None
    out = rollout_stats(r, s, fns, dist()).reduce()
    assert "rollout/accuracy" not in out and out["rollout/rewards_mean"] == pytest.approx(-0.5)


def test_score_adds_dapos_overlong_punishment_over_the_budget(single_process_group):
    # budget 8, buffer 4: lengths 3, 5, 7, 8 -> R_length 0, -0.25, -0.75, -1; scaled by overlong_penalty 0.5
    cfg = from_dict(RewardConfig, {"reward_model_weight": 0.0, "overlong_buffer": 4, "overlong_penalty": 0.5,
                                   "functions": [{"name": "align_pipeline.rewards:exact_match", "weight": 1.0}]})
    fns = RewardFunctions.load(cfg, "reward")
    rec = {"prompt": "say x", "answer": "x", "prompt_ids": [1]}
    r = Rollout([rec] * 4, [[5] * n for n in (3, 5, 7, 8)], [True] * 4, {"loss_mask": torch.ones(4, 8)},
                ["x", "x", "y", "x"])
    s = score(r, cfg, fns, None, None, 2, dist(), max_tokens=8)
    assert s.overlong.tolist() == [0.0, -0.25, -0.75, -1.0]
    assert s.total.tolist() == pytest.approx([1.0, 1 - 0.125, 0 - 0.375, 1 - 0.5])
    assert rollout_stats(r, s, fns, dist()).reduce()["rollout/overlong_shaping"] == pytest.approx(-0.5)
    off = score(r, dataclasses.replace(cfg, overlong_buffer=0), fns, None, None, 2, dist(), max_tokens=8)
    assert off.overlong is None and off.total.tolist() == [1.0, 1.0, 0.0, 1.0]


def test_pair_batch_stacks_chosen_over_rejected():
    batch = {f"{side}_{k}": torch.full((2, 3), v) for side, v in (("chosen", 1), ("rejected", 2))
             for k in ("input_ids", "labels", "loss_mask")}
    ids, labels, mask = pair_batch(batch)
    for t in (ids, labels, mask):
        assert t.shape == (4, 3) and t[:2].eq(1).all() and t[2:].eq(2).all()


def test_token_entropy_is_over_the_real_vocabulary():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)  # 6 real tokens + 2 padded columns
    h = token_entropy(logits, vocab_size=6, tp_rank=0)
    p = torch.softmax(logits[..., :6], dim=-1)
    plain = -(p * torch.log(p)).sum(-1)
    assert torch.allclose(h.double(), plain, atol=1e-6)
    (g,) = torch.autograd.grad(h.sum(), logits)
    (g_plain,) = torch.autograd.grad(plain.sum(), logits)
    assert torch.allclose(g, g_plain, atol=1e-6) and g[..., 6:].abs().max() == 0


def test_run_log_reports_peak_memory_per_phase(tmp_path, monkeypatch, capsys):
    """A job's end: each phase's peak (training step, validation, save) as a line, MLflow metrics at the last step and
    in result.json; nothing without an accelerator (no phase ran)."""
    import json

    from align_pipeline.model import memory
    from align_pipeline.train.core import progress
    from align_pipeline.train.core.progress import RunLog

    monkeypatch.setattr(progress, "shutdown", lambda: None)  # other tests' process group stays

    class Logger:
        def __init__(self):
            self.logged = []

        def log_metrics(self, metrics, step=None):
            self.logged.append((dict(metrics), step))

        def close(self):
            pass

        def copy_metrics_to(self, path):
            pass

    logger = Logger()
    monkeypatch.setattr(memory, "_PEAKS", {"train": int(33.7 * 2**30), "save": 20 * 2**30})
    result = RunLog("sft", dist(), logger, total=30, start=0, interval=10).finish(tmp_path, {"step": 30})
    assert result["peak_memory_by_phase_gib"] == {"train": 33.7, "save": 20.0}
    assert logger.logged == [({"memory/peak_train_gib": 33.7, "memory/peak_save_gib": 20.0}, 30)]
    assert json.loads((tmp_path / "result.json").read_text())["peak_memory_by_phase_gib"]["train"] == 33.7
    assert "peak accelerator memory (rank 0): train 33.7 GiB, save 20.0 GiB" in capsys.readouterr().out

    monkeypatch.setattr(memory, "_PEAKS", {})
    logger = Logger()
    result = RunLog("sft", dist(), logger, total=30, start=0, interval=10).finish(tmp_path, {"step": 30})
    assert "peak_memory_by_phase_gib" not in result and logger.logged == []


def test_to_rows_puts_the_engines_logprobs_where_the_loss_mask_is():
    rows = to_rows([[1, 2, 3], [7]], [[4, 5], [8, 9, 6]], seq_length=6, pad_id=0,
                   logprobs=[[-0.1, -0.2], [-0.3, -0.4, -0.5]])
    expected = np.array([[0, 0, -0.1, -0.2, 0, 0], [-0.3, -0.4, -0.5, 0, 0, 0]], dtype=np.float32)
    assert np.array_equal(rows["rollout_logp"], expected) and rows["rollout_logp"].dtype == np.float32
    cut = to_rows([[1, 2]], [[3, 4, 5, 6]], seq_length=4, pad_id=0, logprobs=[[-1.0, -2.0, -3.0, -4.0]])
    assert cut["rollout_logp"].tolist() == [[0.0, -1.0, -2.0, 0.0]]  # the tokens that fit, as loss_mask
