"""The tiny config end to end through train.py: finite losses, metrics, checkpoints, resume."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import train  # noqa: E402


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, monkeypatch_module):
    out = tmp_path_factory.mktemp("run")
    monkeypatch_module.setenv("PPO_JAX_CACHE", str(tmp_path_factory.mktemp("cache")))
    args = ["--config", str(ROOT / "configs/tiny.yaml"), "--set", f"train.output_dir={out}",
            "--set", f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}",
            "--set", "train.steps=2", "--set", "train.progress=false"]
    assert train.main(args) == 0
    return out, args


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_tiny_run_writes_finite_metrics(run_dir):
    out, _ = run_dir
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2]  # step 0: the held-out eval (eval.at_start)
    records = records[1:]
    for r in records:
        for key in ("pg_loss", "vf_loss", "kl", "score_mean", "entropy", "clipfrac", "approxkl",
                    "advantages_mean", "returns_std", "response_length", "time/generation",
                    "time/experience", "time/update", "tokens_per_s/step", "non_score_reward"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), key
    for r in records:  # `entropy`: mean per-response sum; the update's token mean has its own name
        assert r["entropy"] == pytest.approx(r["entropy_per_token"] * r["response_length"], rel=1e-4)
        assert math.isfinite(r["policy_entropy"])
    assert records[0]["ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-6)
    assert records[1]["data_position"] == 8
    samples = [json.loads(s) for s in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and {"prompt", "response", "score"} <= set(samples[0])
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_tiny_run_writes_checkpoints_and_hf_export(run_dir):
    out, _ = run_dir
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["1", "2"]
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(out / "actor_hf").model_type == "llama"


def test_resume_continues_at_the_next_step(run_dir):
    out, args = run_dir
    assert train.main(args + ["--set", "train.steps=3", "--resume"]) == 0
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3]  # step 0 is not evaluated again
    assert records[3]["data_position"] == 12  # the prompt order continues where it stopped


def test_max_minutes_ends_the_run_at_the_step_that_spends_it(run_dir, tmp_path, capsys):
    """train.max_minutes: the step that crosses the budget is the last (evaluated, saved and
    exported, as train.steps would be) and equals that step of the run without a budget; a
    `--resume` goes on towards train.steps and gives the unbudgeted run's next step."""
    done, args = run_dir
    out = tmp_path / "budgeted"
    budgeted = [a if not a.startswith("train.output_dir=") else f"train.output_dir={out}" for a in args]
    budgeted += ["--set", "eval.every=3", "--set", "train.save_every=0"]
    assert train.main(budgeted + ["--set", "train.max_minutes=1e-9"]) == 0
    assert "train.max_minutes=1e-09 spent at step 1 of 2" in capsys.readouterr().out
    records, full = read_metrics(out), read_metrics(done)
    assert [r["step"] for r in records] == [0, 1]
    assert "eval/reward_mean" in records[1]  # the last step is evaluated though 1 % 3 != 0
    assert records[1]["pg_loss"] == full[1]["pg_loss"] and records[1]["kl"] == full[1]["kl"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]
    assert (out / "actor_hf" / "config.json").is_file()
    assert train.main(budgeted + ["--resume"]) == 0
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[2]["pg_loss"] == full[2]["pg_loss"]


def test_a_wall_clock_budget_is_spent_on_its_own_clock():
    from ppo_jax.trainer.lifecycle.preemption import WallClockBudget

    assert not WallClockBudget(None).spent()
    budget = WallClockBudget(2.0)
    now = budget.deadline - 120.0
    budget._now = lambda: now + 119.0
    assert not budget.spent()
    budget._now = lambda: now + 120.0
    assert budget.spent()


def test_bad_config_fails_before_loading(capsys):
    assert train.main(["--config", str(ROOT / "configs/tiny.yaml"), "--set", "ppo.kl_coeff=1"]) == 2
    assert "kl_coeff" in capsys.readouterr().err


@pytest.mark.slow  # default-run budget (~49 s on 2 cores; the shared-critic update and
# experience are in the default run through test_update.py and test_critic_free.py)
def test_shared_critic_runs_checkpoints_resumes_and_exports(tmp_path, monkeypatch):
    """model.shared_critic (TRL's value head on the actor): no critic state, the value head
    trains (vf_loss finite, head params move), checkpoint/resume and the HF export still work."""
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    from ppo_jax.trainer.config import load_config
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    sets = [f"train.output_dir={tmp_path / 'run'}", f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}",
            "train.steps=2", "train.progress=false", "model.shared_critic=true", "ppo.vf_coef=0.5"]
    trainer = PPOTrainer(load_config(ROOT / "configs/tiny.yaml", sets))
    assert trainer.state["critic"] is None
    assert "value_head" in trainer.state["actor"].params  # a CausalLMWithValueHead actor
    history = trainer.train(progress=False)
    assert [math.isfinite(h["vf_loss"]) and math.isfinite(h["pg_loss"]) for h in history] == [True, True]
    assert history[0]["ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-6)
    import numpy as np

    head = np.asarray(trainer.state["actor"].params["value_head"]["kernel"])
    assert np.abs(head).max() > 0  # zero-initialised, moved by the value loss
    assert (tmp_path / "run" / "actor_hf" / "config.json").is_file()
    from safetensors import safe_open

    with safe_open(str(tmp_path / "run" / "actor_hf" / "model.safetensors"), "np") as f:
        assert not [k for k in f.keys() if k.startswith("score")]  # the LM alone is exported

    resumed = PPOTrainer(load_config(ROOT / "configs/tiny.yaml", sets[:2] + ["train.steps=3"] + sets[3:]),
                         resume=True)
    assert resumed.step_count == 2
    np.testing.assert_array_equal(np.asarray(resumed.state["actor"].params["value_head"]["kernel"]), head)
    assert resumed.train(progress=False)[0]["data_position"] == 12


def test_shared_critic_with_a_critic_path_is_rejected(tmp_path):
    """Refused when the config loads, before any model (the check lives in the config's)."""
    from ppo_jax.trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.critic=.* cannot be used with model.shared_critic"):
        load_config(ROOT / "configs/tiny.yaml", ["model.shared_critic=true", f"model.critic={tmp_path}"])


def test_bfloat16_frozen_models_offloaded_to_host_between_phases(tmp_path, monkeypatch):
    """model.frozen_param_dtype=bfloat16 + model.offload_frozen: the reference lives in bf16 in
    pinned host memory, actor/critic stay float32, and a step still gives finite losses with
    ratio 1 on the first minibatch (the actor's old log-probs do not depend on the reference)."""
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    import jax
    import jax.numpy as jnp
    from ppo_jax.trainer.config import load_config
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    sets = [f"train.output_dir={tmp_path / 'run'}", f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}",
            "train.steps=1", "train.progress=false", "model.frozen_param_dtype=bfloat16",
            "model.offload_frozen=true"]
    trainer = PPOTrainer(load_config(ROOT / "configs/tiny.yaml", sets))
    ref_leaves = jax.tree.leaves(trainer.ref_params)
    assert {x.dtype for x in ref_leaves} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(trainer.state["actor"].params)} == {jnp.dtype(jnp.float32)}
    if trainer.place.can_offload():
        assert {x.sharding.memory_kind for x in ref_leaves} == {"pinned_host"}
    metrics = trainer.step()
    assert math.isfinite(metrics["pg_loss"]) and math.isfinite(metrics["kl"])
    assert metrics["ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-6)
    # still offloaded after the step (the device copy was only for the experience pass)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(trainer.ref_params)} == \
        {x.sharding.memory_kind for x in ref_leaves}


def test_a_forks_registered_loss_runs_through_train_import(tmp_path, monkeypatch):
    """docs/forks.md: `--import examples.my_losses --set ppo.policy_loss=plain_pg`."""
    from ppo_jax.core import unregister

    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    args = ["--config", str(ROOT / "configs/tiny.yaml"), "--set", f"train.output_dir={out}",
            "--set", "train.steps=1", "--set", "train.progress=false", "--set", "train.export_hf=false",
            "--import", "examples.my_losses", "--set", "ppo.policy_loss=plain_pg",
            "--set", "ppo.policy_loss_kwargs.pg_coef=0.0", "--set", "ppo.advantage_kwargs.method=scan"]
    try:
        assert train.main(args) == 0
    finally:  # the module registers two losses: leave neither behind for later tests
        for name in ("plain_pg", "ppo_clip_entropy"):
            unregister("policy loss", name)
        sys.modules.pop("examples.my_losses", None)
    (record,) = [r for r in read_metrics(out) if r["step"] == 1]
    assert record["pg_loss"] == 0.0 and "clipfrac" not in record  # pg_coef reached plain_pg
    assert record["ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-6)
    assert train.main(["--import", "no_such_module_xyz"]) == 2


def test_an_existing_run_is_not_overwritten_without_resume(run_dir, capsys):
    out, args = run_dir
    before = (out / "metrics.jsonl").read_text(), (out / "config.json").read_text()
    assert train.main(args + ["--set", "ppo.kl_coef=0.5"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert ((out / "metrics.jsonl").read_text(), (out / "config.json").read_text()) == before


def test_malformed_jsonl_names_the_file_and_line(tmp_path):
    from ppo_jax.trainer.data.prompts import read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"\n')
    with pytest.raises(ValueError, match=r"data.prompts: .*p.jsonl is not valid JSONL \(line 3"):
        read_prompts(path)


def test_stop_token_ids_outside_the_vocabulary_are_rejected(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    args = ["--config", str(ROOT / "configs/tiny.yaml"), "--set", f"train.output_dir={tmp_path}",
            "--set", f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}",
            "--set", "generation.stop_token_ids=[-1]"]
    assert train.main(args) == 2
    assert "generation.stop_token_ids=[-1]" in capsys.readouterr().err


def test_prompt_ids_outside_the_model_vocabulary_are_rejected(tmp_path, monkeypatch):
    """A tokenizer larger than the model (e.g. an added pad token without resized embeddings)
    would feed ids the embedding cannot look up: rejected when the prompts are built."""
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    from ppo_jax.models import load_tokenizer
    from ppo_jax.trainer.config import ConfigError, load_config
    from ppo_jax.trainer.loading.models import build_prompts, resolve_model_path

    cfg = load_config(ROOT / "configs/tiny.yaml",
                      [f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}"])
    tokenizer = load_tokenizer(resolve_model_path(cfg.model.actor, "model.actor"))
    from ppo_jax.models.tiny_random import tiny_config

    model_cfg = tiny_config(len(tokenizer))
    assert build_prompts(cfg, tokenizer, model_cfg).ids.max() < model_cfg.vocab_size
    small = model_cfg.replace(vocab_size=12)
    with pytest.raises(ConfigError, match="vocab_size 12: tokenizer and model do not match"):
        build_prompts(cfg, tokenizer, small)


def test_a_registered_function_that_cannot_take_the_trainers_call_is_rejected_at_start():
    from ppo_jax.core import register_advantage_estimator, register_policy_loss, unregister
    from ppo_jax.trainer.config import ConfigError, load_config
    from ppo_jax.trainer.stages.ppo.load_checks import check_names

    @register_policy_loss("no_normalizer")
    def no_normalizer(logprobs, old_logprobs, advantages, mask):
        return (advantages * mask).sum(), {}

    @register_advantage_estimator("needs_alpha")
    def needs_alpha(values, rewards, mask, *, gamma, lam, alpha, **unused):
        return rewards, rewards

    base = str(ROOT / "configs/tiny.yaml")
    try:
        with pytest.raises(ConfigError, match="ppo.policy_loss='no_normalizer': no_normalizer.*"
                                              "cannot be called.*LossInputs"):
            check_names(load_config(base, ["ppo.policy_loss=no_normalizer"]))
        with pytest.raises(ConfigError, match="ppo.advantage_estimator='needs_alpha'.*alpha"):
            check_names(load_config(base, ["ppo.advantage_estimator=needs_alpha"]))
        check_names(load_config(base, ["ppo.advantage_estimator=needs_alpha",
                                       "ppo.advantage_kwargs.alpha=0.5"]))
        with pytest.raises(ConfigError, match="ppo.value_loss='clipped_mse'.*huber_delta"):
            check_names(load_config(base, ["ppo.value_loss_kwargs.huber_delta=1.0"]))
        with pytest.raises(ConfigError, match="ppo.policy_loss_kwargs.xs=.*scalars or strings"):
            load_config(base, ["ppo.policy_loss_kwargs.xs=[1,2]"])
    finally:
        unregister("policy loss", "no_normalizer")
        unregister("advantage estimator", "needs_alpha")


def test_registered_functions_with_wrong_outputs_or_names_are_rejected_at_start():
    from ppo_jax.core import register_policy_loss, register_reward_shaping, unregister
    from ppo_jax.trainer.config import ConfigError, load_config
    from ppo_jax.trainer.stages.ppo.load_checks import check_names

    @register_policy_loss("scalar_loss_test")
    def scalar_loss(batch, **unused):  # the pre-issue-11 form: a scalar, not [B, T]
        return batch.advantages.mean(), {"ratio": batch.logprobs.mean()}

    @register_policy_loss("scalar_stats_test")
    def scalar_stats(batch, **unused):
        return batch.advantages, {"ratio": batch.logprobs.mean()}

    @register_reward_shaping("two_outputs_test")
    def two_outputs(scores, ended, logprobs, ref_logprobs, mask, **unused):
        return logprobs, logprobs

    base = str(ROOT / "configs/tiny.yaml")
    try:
        with pytest.raises(ConfigError, match=r"ppo.policy_loss='scalar_loss_test' returns output 0 of "
                                              r"shape \(\) instead of \(1, 2\)"):
            check_names(load_config(base, ["ppo.policy_loss=scalar_loss_test"]))
        with pytest.raises(ConfigError, match=r"stats of shapes \{'ratio': \(\)\} instead of per-token"):
            check_names(load_config(base, ["ppo.policy_loss=scalar_stats_test"]))
        with pytest.raises(ConfigError, match="ppo.reward_shaping='two_outputs_test' returns tuple instead "
                                              "of a tuple of 3"):
            check_names(load_config(base, ["ppo.reward_shaping=two_outputs_test"]))
        with pytest.raises(ConfigError, match="ppo.reward_shaping: unknown reward shaping 'nope'; known: "
                                              ".*kl_penalty"):
            check_names(load_config(base, ["ppo.reward_shaping=nope"]))
        with pytest.raises(ConfigError, match="ppo.reward_shaping='kl_penalty'.*gamma"):
            check_names(load_config(base, ["ppo.reward_shaping_kwargs.gamma=0.5"]))
        check_names(load_config(base, ["ppo.loss_aggregation=seq-mean-token-sum", "ppo.entropy_coef=0.01",
                                       "ppo.kl_loss_coef=0.05", "ppo.kl_loss_estimator=mse"]))
    finally:
        for kind, name in (("policy loss", "scalar_loss_test"), ("policy loss", "scalar_stats_test"),
                           ("reward shaping", "two_outputs_test")):
            unregister(kind, name)


def test_outputs_that_fit_only_the_1x2_test_batch_are_rejected_at_start():
    """A slice or fixed size right on a 1x2 batch but not in training (issue 54, P8) is refused
    at load on the second test batch (2x3), naming the key and the shapes, not a traceback at
    step 1."""
    from ppo_jax.core import ppo_clip_loss, register_advantage_estimator, register_policy_loss, unregister
    from ppo_jax.trainer.config import ConfigError, load_config
    from ppo_jax.trainer.stages.ppo.load_checks import check_names

    @register_policy_loss("first_two_tokens_test")
    def first_two_tokens(batch, **kw):
        per_token, stats = ppo_clip_loss(batch, **kw)
        return per_token[:, :2], stats

    @register_policy_loss("first_row_test")
    def first_row(batch, **kw):
        per_token, stats = ppo_clip_loss(batch, **kw)
        return per_token[:1], stats

    @register_advantage_estimator("two_tokens_estimator_test")
    def two_tokens(values, rewards, mask, **unused):
        return rewards[:, :2], rewards[:, :2]

    base = str(ROOT / "configs/tiny.yaml")
    try:
        with pytest.raises(ConfigError, match=r"^ppo.policy_loss='first_two_tokens_test' returns output 0 "
                                              r"of shape \(2, 2\) instead of \(2, 3\) on a 2x3 test batch "
                                              r"\(right on the 1x2 one"):
            check_names(load_config(base, ["ppo.policy_loss=first_two_tokens_test"]))
        with pytest.raises(ConfigError, match=r"^ppo.policy_loss='first_row_test' returns output 0 of "
                                              r"shape \(1, 3\) instead of \(2, 3\) on a 2x3 test batch"):
            check_names(load_config(base, ["ppo.policy_loss=first_row_test"]))
        with pytest.raises(ConfigError, match=r"^ppo.advantage_estimator='two_tokens_estimator_test' "
                                              r"returns output 0 of shape \(2, 2\) instead of \(2, 3\)"):
            check_names(load_config(base, ["ppo.advantage_estimator=two_tokens_estimator_test"]))
    finally:
        for kind, name in (("policy loss", "first_two_tokens_test"), ("policy loss", "first_row_test"),
                           ("advantage estimator", "two_tokens_estimator_test")):
            unregister(kind, name)


def test_plot_run_draws_the_tiny_runs_metrics(run_dir, tmp_path):
    """scripts/plot_run.py on the tiny run's metrics (twice, overlaid): a PNG with six panels."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_run", ROOT / "scripts/plot_run.py")
    plot_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_run)
    out, _ = run_dir
    png = tmp_path / "run.png"
    assert plot_run.main([str(out), str(out), "--names", "a", "b", "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert plot_run.main([str(tmp_path / "missing"), "--out", str(png)]) == 2
    minutes = plot_run.wall_minutes([{"step": 1, "time/step": 30.0}, {"step": 2, "time/step": 30.0,
                                                                      "time/eval": 60.0}])
    assert minutes == {1: 0.5, 2: 2.0}


def test_summarize_runs_reads_the_eval_figures_of_the_tiny_run(run_dir, capsys):
    """scripts/summarize_runs.py: one table row whose held-out figures are the run's eval/ lines."""
    import importlib.util

    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("summarize_runs", ROOT / "scripts/summarize_runs.py")
    summarize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summarize)
    out, _ = run_dir
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/reward_mean"]) for r in rows if "eval/reward_mean" in r]
    assert len(evals) >= 2
    assert summarize.main([str(out)]) == 0
    cells = [c.strip() for c in capsys.readouterr().out.splitlines()[-1].split("|")[1:-1]]
    start, end = evals[0][1], evals[-1][1]
    best_step, best = max(evals, key=lambda e: e[1])
    assert cells[1:4] == [f"{start:.3f}", f"{end:.3f}", f"{end - start:+.3f}"]
    assert cells[4] == f"{best:.3f} (step {best_step})"
    steps = [r for r in rows if r["step"] > 0]
    assert cells[9] == str(steps[-1]["step"])
    last = steps[-5:]
    assert cells[10] == f"{sum(r['entropy_per_token'] for r in last) / len(last):.2f}"
    assert cells[11] == f"{sum(r['response_length'] for r in last) / len(last):.1f}"
