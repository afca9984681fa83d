"""The TRL 0.11 side of bench/ppo_step.py (runs in .venv-bench): `PPOTrainer` with a value head
on the actor and a frozen reference copy, the same prompt ids, batch, sampled token count
(checked), VADER reward and PPO settings; emits one `BENCH_JSON` line. Run by ppo_step.py:
--model-dir DIR --prompt-ids FILE.json [...]
"""

from __future__ import annotations

import json
import platform
import time
import warnings
from pathlib import Path

from harness import emit, log, options, ppo_step_record, ppo_step_summary  # stdlib only


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer.json with its tokenizer_config.json's special tokens, left padding
    (as TRL generates). Built directly: transformers 5, which wrote the checkpoint, names the class
    `TokenizersBackend`, which 4.x cannot resolve; the prompts come tokenised (no chat template)."""
    from transformers import PreTrainedTokenizerFast

    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    special = {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")
               if isinstance(cfg.get(k), str)}
    tok = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"), **special)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def build_trainer(args):
    """(PPOTrainer, tokenizer, load seconds): the value-head actor and a frozen reference copy,
    dropout off (as in ppo_jax; TRL's value head defaults to 0.1)."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

    t0 = time.perf_counter()
    tok = load_tokenizer(args.model_dir)

    def value_head_model():  # ppo_jax writes legacy `rope_theta` / `rope_scaling` beside `rope_parameters`
        base = AutoModelForCausalLM.from_pretrained(args.model_dir, torch_dtype=torch.float32)
        return AutoModelForCausalLMWithValueHead.from_pretrained(base, summary_dropout_prob=0.0)

    config = PPOConfig(
        model_name=str(args.model_dir), batch_size=args.batch, mini_batch_size=args.batch,
        gradient_accumulation_steps=1, ppo_epochs=args.epochs, learning_rate=args.lr,
        init_kl_coef=args.kl_coef, adap_kl_ctrl=False, kl_penalty="kl", cliprange=0.2,
        cliprange_value=0.2, vf_coef=0.1, gamma=1.0, lam=0.95, max_grad_norm=1.0,
        seed=args.seed, log_with=None)
    trainer = PPOTrainer(config=config, model=value_head_model(), ref_model=value_head_model(), tokenizer=tok)
    return trainer, tok, time.perf_counter() - t0


def timed_step(ppo_trainer, rows, queries, gen_kwargs: dict, reward, args) -> dict:
    """One timed PPO step: generate, reward, `ppo_trainer.step()`; its phase record (experience:
    the reward and `step()`'s forward pass, rewards and advantages; update: the rest)."""
    t0 = time.perf_counter()
    responses = ppo_trainer.generate(queries, batch_size=args.batch, return_prompt=False, **gen_kwargs)
    t1 = time.perf_counter()
    scores = reward(responses)
    t2 = time.perf_counter()
    out = ppo_trainer.step(queries, responses, scores)
    t3 = time.perf_counter()
    lengths = [int(r.shape[0]) for r in responses]
    if any(n != args.new_tokens for n in lengths):
        raise SystemExit(f"TRL generated {lengths} tokens, expected {args.new_tokens} each")
    timing = {k: float(v) for k, v in out.items() if k.startswith("time/ppo/")}
    in_step = sum(timing[f"time/ppo/{k}"] for k in ("forward_pass", "compute_rewards", "compute_advantages"))
    return ppo_step_record(
        {"time/generation": t1 - t0, "time/reward": t2 - t1, "time/experience": (t2 - t1) + in_step,
         "time/update": (t3 - t2) - in_step, "time/step_call": t3 - t2, "time/step": t3 - t0, **timing},
        sum(lengths), sum(len(r) for r in rows), args.epochs,
        padded_seq_len=max(len(r) for r in rows) + args.new_tokens)


def main() -> None:
    args = options(__doc__, model_dir=None, prompt_ids=None, epochs=4, batch=8, new_tokens=48,
                   steps=3, warmup=1, kl_coef=0.05, lr=1e-5, seed=0)
    if args.model_dir is None or args.prompt_ids is None:
        raise SystemExit("--model-dir and --prompt-ids are required")
    warnings.filterwarnings("ignore")
    import numpy as np
    import torch
    import transformers
    import trl
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    transformers.logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    ppo_trainer, tok, load_s = build_trainer(args)
    prompts = [list(map(int, row)) for row in json.loads(args.prompt_ids.read_text())["prompt_ids"]]
    analyzer = SentimentIntensityAnalyzer()
    gen_kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=True,
                      temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id)
    n_params = sum(p.numel() for p in ppo_trainer.model.parameters())
    log(f"[trl] {args.model_dir.name}: {n_params / 1e6:.1f}M params (actor + value head), "
        f"{len(prompts)} prompts; torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"transformers {transformers.__version__}, trl {trl.__version__}")

    def batch_queries(i: int):
        rows = [prompts[(i * args.batch + k) % len(prompts)] for k in range(args.batch)]
        return rows, [torch.tensor(r, dtype=torch.long) for r in rows]

    def reward(responses) -> list:
        return [torch.tensor(analyzer.polarity_scores(t)["compound"], dtype=torch.float32)
                for t in tok.batch_decode(responses, skip_special_tokens=True)]

    steps = []
    for i in range(args.warmup + args.steps):
        steps.append(rec := timed_step(ppo_trainer, *batch_queries(i), gen_kwargs, reward, args))
        log(f"[trl] step {i + 1} ({'warm-up' if i < args.warmup else 'measured'}): "
            + ", ".join(f"{k} {rec[f'time/{k}']:.2f} s" for k in ("generation", "experience", "update")))
    emit({**ppo_step_summary(steps, args.warmup), "compile_s": None, "epochs": args.epochs,
          "batch": args.batch, "new_tokens": args.new_tokens, "dtype": "float32", "device": "cpu",
          "model": args.model_dir.name, "n_params": n_params, "load_s": load_s,
          "versions": {"python": platform.python_version(), "torch": torch.__version__,
                       "transformers": transformers.__version__, "trl": trl.__version__,
                       "torch_threads": torch.get_num_threads()}})


if __name__ == "__main__":
    main()
