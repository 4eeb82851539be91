"""The verifiable demo task: checker, answers, generated data."""

import random

import pytest

from align_pipeline.data import demo_task as d


@pytest.mark.parametrize(
    "prompt, right",
    [("reverse: abcd\n", "dcba"), ("reverse: xyz\n", "zyx"), ("add: 23+45\n", "68"), ("add: 99+99\n", "198")],
)
def test_answer_and_check(prompt, right):
    assert d.answer_for(prompt) == right
    assert d.check(prompt, right)
    assert d.check(prompt, right + "\n")  # trailing whitespace
    assert d.check(prompt, f" {right}<eos><pad><pad>")  # decoded with special tokens
    assert d.check(prompt, right + "</s>")
    assert not d.check(prompt, right + "x")
    assert not d.check(prompt, "")
    assert d.check(prompt, right)


def test_wrong_answers_are_wrong_and_plausible():
    rng = random.Random(0)
    for prompt in ["reverse: abcd\n", "reverse: aaa\n", "reverse: abba\n", "add: 27+45\n", "add: 10+10\n"]:
        for _ in range(20):
            wrong = d.wrong_answer_for(prompt, rng)
            assert not d.check(prompt, wrong)
            assert not d.check(prompt, wrong)
            assert abs(len(wrong) - len(d.answer_for(prompt))) <= 1


def test_check_uses_given_answer_and_rejects_unknown_prompts():
    assert d.check("anything\n", "42", answer="42")
    assert not d.check("anything\n", "41", answer="42")
    with pytest.raises(ValueError, match="not a demo-task prompt"):
        d.answer_for("multiply: 2*3\n")


def test_generated_data_is_deterministic_disjoint_and_noisy():
    a = d.make_demo_datasets(n_sft=400, n_preference=200, n_prompts=100, seed=3)
    assert a == d.make_demo_datasets(n_sft=400, n_preference=200, n_prompts=100, seed=3)
    sft = {r["input"] for r in a["sft"]}
    pref = {r["prompt"] for r in a["preference"]}
    held = {r["prompt"] for r in a["prompts"]}
    assert len(held) == 100 and not held & sft and not held & pref
    wrong = sum(not d.check(r["input"], r["output"]) for r in a["sft"]) / len(a["sft"])
    assert 0.2 < wrong < 0.4
    for r in a["preference"]:
        assert d.check(r["prompt"], r["chosen_response"]) and not d.check(r["prompt"], r["rejected_response"])
    assert any("chosen_reward" in r for r in a["preference"]) and any("chosen_reward" not in r for r in a["preference"])
    assert all(d.check(r["prompt"], r["answer"]) for r in a["prompts"])
    adds = [r["input"] for r in a["sft"] if d.task_kind(r["input"]) == "add"]
    assert 0.4 < len(adds) / len(a["sft"]) < 0.6 and len(set(adds)) == len(adds)
    assert not any(d.has_carry(*map(int, p[len("add: ") :].split("+"))) for p in adds)


def test_addition_space_exhausted_keeps_held_out_disjoint():
    a = d.make_demo_datasets(n_sft=3000, n_preference=1000, n_prompts=1000, add_fraction=1.0, seed=0)
    held = {r["prompt"] for r in a["prompts"]}
    assert len(held) == 1000
    assert not held & {r["input"] for r in a["sft"]} and not held & {r["prompt"] for r in a["preference"]}
    assert len({r["input"] for r in a["sft"]}) == len(d.addition_pairs()) - 1000  # the rest of the space, all used
    records = [(r["input"], r["output"]) for r in a["sft"]]
    assert len(set(records)) == len(records)  # a prompt repeats only with another answer: no line twice
    carrying = d.make_demo_datasets(n_sft=200, n_preference=10, n_prompts=10, add_fraction=1.0, carries=True)
    assert any(d.has_carry(*map(int, r["input"][5:].split("+"))) for r in carrying["sft"])


def test_shipped_files_match_the_generator(tmp_path):
    """data/01_raw is exactly what scripts/make_demo_data.py writes with its defaults."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("make_demo_data", root / "scripts" / "make_demo_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--out", str(tmp_path)])
    for name in ("sft.jsonl", "preference.jsonl", "prompts.jsonl"):
        shipped = (root / "data" / "01_raw" / name).read_bytes()
        assert shipped == (tmp_path / name).read_bytes(), name
        assert len(shipped) < 1_000_000
        lines = shipped.decode().splitlines()
        assert len(set(lines)) == len(lines), name  # clean: data_prep's duplicate check finds nothing to warn about
