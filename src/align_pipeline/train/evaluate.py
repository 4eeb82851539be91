"""Evaluation entry point: every policy vs the SFT reference on held-out prompts.

    torchrun --nproc_per_node 1 -m align_pipeline.train.evaluate --config run/config.json

Per policy: sample responses (KV-cached generation) and report accuracy (the accuracy function of
``reward.functions`` returns >= 1), greedy accuracy, the reward functions' weighted mean (``function_reward``; per
function ``reward_<name>`` when there are several), the reward-model score (a multi-attribute model's outputs
combined by ``reward.reward_model_attribute_weights``), KL to the reference (mean over generated tokens of
log pi - log pi_ref, the k1 estimator under the policy's samples), response length and EOS rate, plus validation
perplexity on the SFT data; with ``group_by``, accuracy and RM score per value of that prompt-record field
(``accuracy_<value>``). Without reward functions the accuracy metrics are absent. Also the reward model's accuracy on
held-out preference pairs. The report ranks the policies (``ranking``: best first by sampled accuracy (RM score
without reward functions), then greedy accuracy, then lower KL to the reference). Rank 0 writes ``report.json``, the ranked
table ``report.md`` and PNG plots to ``output_dir`` and logs them (and the numbers) to the MLflow run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch.distributed as tdist

from align_pipeline.config.checks import attribute_weights, check_job
from align_pipeline.config.common import GenerationConfig, ModelConfig
from align_pipeline.config.evaluation import EvaluationJob
from align_pipeline.data.formats import load_jsonl
from align_pipeline.data.store import load_sequences
from align_pipeline.data.tokenizer import load_tokenizer
from align_pipeline.evaluation.report import flat_metrics, group_labels, group_means, rank_policies, report_table
from align_pipeline.model import init
from align_pipeline.model.checkpoint import reward_pooling
from align_pipeline.model.generate import generate
from align_pipeline.model.sequences import nll_forward, rewards_forward
from align_pipeline.rewards.base import RewardFunctions
from align_pipeline.rewards.check import check_records
from align_pipeline.tracking.mlflow_logger import RunLogger
from align_pipeline.train.core.batches import to_rows
from align_pipeline.train.core.cli import cli
from align_pipeline.train.core.distributed import init_distributed, shutdown
from align_pipeline.train.core.optimizer import build_frozen
from align_pipeline.train.core.progress import log
from align_pipeline.train.core.schedule import per_sample


def sample(model, prompts: list[list[int]], g: GenerationConfig, tok, vocab: int, dist, greedy: bool,
           seq_length: int):
    """Responses of ``model`` to every prompt (DP ranks split them; all ranks get all): tokens, log-probs, EOS."""
    max_new = min(g.max_new_tokens, seq_length - max(len(p) for p in prompts))  # stay within the trained length
    mine = list(range(dist.dp_rank, len(prompts), dist.dp_size))  # DP ranks split the prompts
    out_tokens, out_logps, out_eos = [], [], []
    if mine:  # continuous batching over at most batch_size rows; the samples of static batches of that size
        gen = generate(model, [prompts[i] for i in mine], max_new_tokens=max_new, eos_id=tok.stop_ids,
                       pad_id=tok.pad_id, vocab_size=vocab, temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                       greedy=greedy, seed=g.seed + 1000 * dist.dp_rank, cuda_graphs=g.cuda_graphs,
                       tp_group=dist.pgs.tp, prefill_bucket=g.prefill_bucket, max_rows=g.batch_size,
                       kv_cache_gib=g.kv_cache_gib, compile_step=g.compile_step)
        out_tokens, out_logps, out_eos = gen.tokens, gen.logprobs, gen.ended_with_eos
    gathered = [None] * dist.world_size
    tdist.all_gather_object(gathered, (mine, out_tokens, out_logps, out_eos))
    tokens, logps, eos = [None] * len(prompts), [None] * len(prompts), [None] * len(prompts)
    for idx, t, lp, e in gathered:
        for j, i in enumerate(idx):
            tokens[i], logps[i], eos[i] = t[j], lp[j], e[j]
    return tokens, logps, eos


def main(job: EvaluationJob) -> dict:
    cfg, paths = job.evaluation, job.paths
    dist = init_distributed(job.parallel, seed=cfg.generation.seed)
    logger = RunLogger(rank=dist.rank)
    tok = load_tokenizer(paths.tokenizer)
    reward_fns = RewardFunctions.load(cfg.reward, "evaluation.reward")
    records = load_jsonl(paths.prompts)
    check_records(records, paths.prompts, reward_fns)
    g = cfg.generation
    rows_of = [r for r in records for _ in range(g.samples_per_prompt)]  # the prompt record of each sampled row
    prompts = [r["prompt_ids"] for r in rows_of]
    groups = group_labels(rows_of, cfg.group_by)  # [n] or None
    if cfg.group_by is not None and groups is None:
        log(dist, f"[evaluation] no prompt record has the field {cfg.group_by!r} (evaluation.group_by): "
                  "no per-group metrics")
    mb = cfg.micro_batch_size
    sdpa = ModelConfig(attention_backend="sdpa")

    ref_path = paths.reference or paths.policies.get("sft") or next(iter(paths.policies.values()))
    ref_src = init.resolve(ref_path, sdpa, 0)
    check_job("evaluation", cfg, job.parallel, dist.world_size, ref_src.model, ref_path, ref_src.parent["kind"])
    seq_length = ref_src.model.seq_length
    reference = build_frozen(ref_src, job.parallel, dist)
    rm = rm_forward = None
    if paths.reward_model:
        rm_src = init.resolve(paths.reward_model, sdpa, 0)
        weights = attribute_weights(cfg.reward.reward_model_attribute_weights, rm_src.num_outputs, "evaluation.reward",
                                    paths.reward_model)
        rm = build_frozen(rm_src, job.parallel, dist, head="value")
        rm_forward = rewards_forward(reward_pooling(paths.reward_model), weights)

    report: dict = {"policies": {}, "settings": {"prompts": len(records), **vars(g)}}
    for name, path in paths.policies.items():
        src = init.resolve(path, sdpa, 0)
        policy = reference if path == ref_path else build_frozen(src, job.parallel, dist)
        tokens, logps, eos = sample(policy, prompts, g, tok, src.vocab_size, dist, greedy=False,
                                    seq_length=seq_length)
        responses = [tok.decode(t) for t in tokens]
        values = np.array([reward_fns.values(r["prompt"], resp, r) for r, resp in zip(rows_of, responses)],
                          dtype=np.float64).reshape(len(rows_of), len(reward_fns.terms))  # [n, F]
        correct = ([float(reward_fns.correct(v)) for v in values] if reward_fns.accuracy is not None
                   else None)  # [n]
        rows = to_rows(prompts, tokens, seq_length, tok.pad_id)
        ref_stats = per_sample(reference, rows, nll_forward(ref_src.vocab_size, dist.tp_rank), mb, dist)  # [n, 2]
        n_tok = np.array([len(t) for t in tokens], dtype=np.float64)
        policy_logp = np.array([sum(lp) for lp in logps])
        kl = (policy_logp + ref_stats[:, 0]).sum() / max(n_tok.sum(), 1)  # sum(log pi - log pi_ref) / tokens
        m: dict = {"samples": len(rows_of), "prompts": len(records)}  # the counts behind the means (their noise)
        if correct is not None:
            m["accuracy"] = float(np.mean(correct))
        m.update({
            "kl_to_reference": float(kl),
            "response_length": float(n_tok.mean()),
            "ended_with_eos": float(np.mean(eos)),
        })
        if groups is not None and correct is not None:
            m.update(group_means(correct, groups, "accuracy"))
        if reward_fns.terms:
            m["function_reward"] = float(np.mean([reward_fns.weighted(v) for v in values]))
        if len(reward_fns.terms) > 1:
            for i, term in enumerate(reward_fns.terms):
                m[f"reward_{term.key}"] = float(values[:, i].mean())
        if cfg.greedy and correct is not None:
            gt, _, _ = sample(policy, [r["prompt_ids"] for r in records], g, tok, src.vocab_size, dist, greedy=True,
                              seq_length=seq_length)
            m["greedy_accuracy"] = float(np.mean([reward_fns.correct(reward_fns.values(r["prompt"], tok.decode(t), r))
                                                  for r, t in zip(records, gt)]))
        if rm is not None:
            rm_scores = per_sample(rm, rows, rm_forward, mb, dist)[:, 0]  # [n]
            m["reward_model_score"] = float(rm_scores.mean())
            if groups is not None:
                m.update(group_means(rm_scores, groups, "reward_model_score"))
        if paths.sft_data:
            val = per_sample(policy, load_sequences(paths.sft_data), nll_forward(src.vocab_size, dist.tp_rank), mb, dist)
            m["sft_val_perplexity"] = float(math.exp(val[:, 0].sum() / val[:, 1].sum()))
        m["examples"] = [{"prompt": r["prompt"], "response": resp,
                          **({"correct": bool(correct[i])} if correct is not None else {}),
                          **({"function_reward": reward_fns.weighted(values[i])} if reward_fns.terms else {})}
                         for i, (r, resp) in enumerate(list(zip(rows_of, responses))[:8])]
        report["policies"][name] = m
        log(dist, f"[evaluation] {name}: " + ", ".join(f"{k} {v:.4f}" for k, v in m.items()
                                                             if isinstance(v, float)))
        if policy is not reference:
            del policy
    if rm is not None and paths.preference_data:
        pairs = load_sequences(paths.preference_data)
        r = per_sample(rm, pairs, rm_forward, mb, dist)  # [n, 2]
        report["reward_model"] = {"accuracy": float(np.mean(r[:, 0] > r[:, 1])),
                                  "mean_margin": float(np.mean(r[:, 0] - r[:, 1])), "pairs": len(r)}
        log(dist, f"[evaluation] reward model accuracy on held-out pairs: {report['reward_model']['accuracy']:.4f}")

    report["ranking"] = rank_policies(report["policies"])
    table = report_table(report)
    # one line: the table is report.md (the Kedro node prints it once, with the gates)
    log(dist, f"[evaluation] ranked: {' > '.join(report['ranking'])} (the table: report.md of the output)")
    if dist.is_logging_rank:
        out = Path(paths.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report, indent=2))
        (out / "report.md").write_text(table + "\n")
        plots = write_plots(report, out)
        (out / "meta.json").write_text(json.dumps({"stage": "evaluation", "lineage": job.lineage,
                                                   "policies": paths.policies}, indent=2))
        logger.log_metrics(flat_metrics(report), step=0)
        for f in [out / "report.json", out / "report.md", *plots]:
            logger.log_artifact(f, "eval_report")
        (Path(paths.run_dir) / "result.json").write_text(json.dumps({"output_dir": str(out), "report": report}))
    logger.close()
    shutdown()
    return report


def write_plots(report: dict, out: Path) -> list[Path]:
    """One bar chart per metric: policy vs metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["policies"])
    keys = [k for k, v in report["policies"][names[0]].items() if isinstance(v, float)]
    paths = []
    for key in keys:
        fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(names), 3))
        values = [report["policies"][n].get(key, float("nan")) for n in names]
        ax.bar(names, values, color="tab:blue")
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(key)
        fig.tight_layout()
        path = out / f"{key}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


if __name__ == "__main__":
    cli(EvaluationJob, main, __doc__)
