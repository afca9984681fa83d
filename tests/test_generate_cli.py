"""`python -m ppo_jax.generate` and `python -m ppo_jax.evaluate` on a tiny LoRA PPO run (2 steps,
trained once per module): the generate command answers with the tokens the project's sampler
draws under the same key from the actor_hf export, the PEFT adapter and a checkpoint step; the
evaluate command gives the figures the run logged at that step; bad input exits 2, naming the
path or flag, before any model loads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs/tiny.yaml"
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optim.actor_lr=1e-2", "optim.critic_lr=1e-2"]
PROMPTS = ["the movie was great", "I did not like"]


def run_sets(out: Path, *extra: str) -> list[str]:
    return [f"train.output_dir={out}", f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}",
            f"eval.prompts={ROOT / 'configs/prompts/quotes_eval.jsonl'}", "train.progress=false",
            "train.tensorboard=false", "ppo.ppo_epochs=1", "eval.every=2", "eval.num_prompts=2",
            "train.save_every=0", *extra]


def train_tiny(out: Path, *extra: str) -> Path:
    """A 2-step tiny PPO run into `out` (checkpoint 2, actor_hf, eval at steps 0 and 2)."""
    from ppo_jax.trainer.config import load_config
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    PPOTrainer(load_config(TINY, run_sets(out, *extra))).train(progress=False)
    return out


@pytest.fixture(scope="module")
def lora_run(cache, tmp_path_factory) -> Path:
    return train_tiny(tmp_path_factory.mktemp("lora") / "run", *LORA)


def logged(run: Path, step: int) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if r["step"] == step)
    return {k: v for k, v in row.items() if k.startswith("eval/")}


def answers(capsys, *argv: str) -> list[dict]:
    from ppo_jax import generate

    capsys.readouterr()
    assert generate.main([*argv, *sum((["--prompt", p] for p in PROMPTS), []), "--json",
                          "--seed", "3"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def sampler_answers(run: Path, graphdef, params, tokenizer, model_cfg):
    """The sampler called directly with the run's template and generation settings and key 3:
    the response ids of each prompt and their summed log-probs `[2]`."""
    from ppo_jax.rollout.static_batch import generate
    from ppo_jax.trainer.config import load_config
    from ppo_jax.trainer.data.prompts import tokenize_prompts
    from ppo_jax.trainer.loading.models import pad_token_id, stop_token_ids

    cfg = load_config(run / "config.json")
    d, g = cfg.data, cfg.generation
    pad = pad_token_id(tokenizer)
    prompts = tokenize_prompts(PROMPTS, tokenizer, max_prompt_length=d.max_prompt_length,
                               use_chat_template=d.use_chat_template, pad_token_id=pad)
    ids, mask, logp = generate(graphdef, params, prompts.ids, prompts.mask, jax.random.PRNGKey(3),
                               max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                               top_k=g.top_k, top_p=g.top_p, pad_token_id=pad,
                               stop_token_ids=stop_token_ids(cfg, tokenizer, model_cfg),
                               return_logprobs=True)
    ids, mask, logp = map(np.asarray, (ids, mask, logp))
    return [r[m > 0].tolist() for r, m in zip(ids, mask)], (logp * mask).sum(axis=1)


def hf_model(path: Path, **kwargs):
    from ppo_jax.models import load_model, load_tokenizer, split_model

    model, cfg = load_model(path, "causal_lm", **kwargs)
    return (*split_model(model), load_tokenizer(path), cfg)


def base_dir() -> Path:
    from ppo_jax.trainer.loading.models import resolve_model_path

    return resolve_model_path("tiny-random", "model.actor")


def adapter_model(run: Path):
    """The run's base (tiny-random) with the saved PEFT adapter, loaded with peft_io directly."""
    from ppo_jax.models import load_model_config as model_config
    from ppo_jax.models.lora import LoraSettings
    from ppo_jax.models.peft_io import load_adapter

    base = base_dir()
    conf = json.loads((run / "actor_adapter" / "adapter_config.json").read_text())
    lora = LoraSettings(conf["r"], conf["lora_alpha"], tuple(conf["target_modules"]))
    adapters = load_adapter(run / "actor_adapter", model_config(base, **lora.config_fields()))
    return hf_model(base, lora=lora, adapters=adapters)


# --- generate -------------------------------------------------------------------------------

def test_generate_from_actor_hf_draws_the_samplers_tokens(lora_run, capsys):
    got = answers(capsys, str(lora_run / "actor_hf"))
    model = hf_model(lora_run / "actor_hf")
    ids, logp = sampler_answers(lora_run, *model)
    tokenizer = model[2]
    assert [r["prompt"] for r in got] == PROMPTS
    assert [r["response_ids"] for r in got] == ids and all(len(i) == 8 for i in ids)
    np.testing.assert_allclose([r["logprob"] for r in got], logp, rtol=1e-5)
    assert got[0]["response"] == tokenizer.decode(ids[0], skip_special_tokens=True)


def test_param_dtype_casts_the_weights_the_sampler_reads(lora_run, capsys):
    """--param-dtype bfloat16: the sampler's tokens from the bf16-cast actor_hf weights, and
    log-probs that differ from the float32 ones (so the cast happened)."""
    from ppo_jax.rollout.weights import cast_floats

    graphdef, params, tokenizer, cfg = hf_model(lora_run / "actor_hf")
    ids, logp = sampler_answers(lora_run, graphdef, cast_floats(params, "bfloat16"), tokenizer,
                                cfg)
    got = answers(capsys, str(lora_run / "actor_hf"), "--param-dtype", "bfloat16")
    assert [r["response_ids"] for r in got] == ids
    np.testing.assert_allclose([r["logprob"] for r in got], logp, rtol=1e-5)
    f32 = answers(capsys, str(lora_run / "actor_hf"))
    assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(got, f32)) > 1e-4


def test_generate_from_the_adapter_and_from_a_checkpoint_step(lora_run, capsys):
    ids, logp = sampler_answers(lora_run, *adapter_model(lora_run))
    for source in ([str(lora_run / "actor_adapter")], ["--run", str(lora_run), "--step", "2"],
                   ["--run", str(lora_run)]):  # no --step: the latest checkpoint, 2
        got = answers(capsys, *source)
        assert [r["response_ids"] for r in got] == ids, source
        np.testing.assert_allclose([r["logprob"] for r in got], logp, rtol=1e-5)
    # step 0 is the starting actor: the base, whose log-probs the trained adapter has moved
    base = answers(capsys, "--run", str(lora_run), "--step", "0")
    b_ids, b_logp = sampler_answers(lora_run, *hf_model(base_dir()))
    assert [r["response_ids"] for r in base] == b_ids
    np.testing.assert_allclose([r["logprob"] for r in base], b_logp, rtol=1e-5)
    assert np.abs(np.asarray(b_logp) - logp).max() > 1e-3


def test_generate_reads_a_prompt_file_and_stdin_lines_alike(lora_run, tmp_path, capsys):
    from ppo_jax import generate

    file = tmp_path / "p.jsonl"
    file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    args = [str(lora_run / "actor_hf"), "--json", "--greedy", "--max-new-tokens", "4"]
    capsys.readouterr()
    assert generate.main(args + ["--prompts", str(file)]) == 0
    from_file = capsys.readouterr().out

    class Piped:  # stdin of `... | python -m ppo_jax.generate`
        def __iter__(self):
            return iter([PROMPTS[0] + "\n", "\n", PROMPTS[1] + "\n"])

        def isatty(self):
            return False

    assert generate.main(args, stdin=Piped()) == 0
    assert capsys.readouterr().out == from_file
    records = [json.loads(x) for x in from_file.splitlines()]
    assert [len(r["response_ids"]) for r in records] == [4, 4]


def test_the_interactive_loop_answers_line_n_as_row_n(lora_run, capsys, monkeypatch):
    from ppo_jax import generate

    batch = answers(capsys, str(lora_run / "actor_hf"))
    lines = iter(PROMPTS + ["/quit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))

    class Terminal:
        def isatty(self):
            return True

    assert generate.main([str(lora_run / "actor_hf"), "--json", "--seed", "3"],
                         stdin=Terminal()) == 0
    chat = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["response_ids"] for r in chat] == [r["response_ids"] for r in batch]


# --- evaluate -------------------------------------------------------------------------------

def test_evaluate_a_step_gives_the_figures_the_run_logged(lora_run, tmp_path, capsys):
    from ppo_jax import evaluate

    out = tmp_path / "eval.json"
    assert evaluate.main(["--run", str(lora_run), "--step", "2", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["figures"]
    want = {k: v for k, v in logged(lora_run, 2).items() if k != "time/eval"}
    assert set(figures) == set(want) and want["eval/kl"] > 1e-3
    assert figures == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert "eval/reward_mean" in capsys.readouterr().out
    assert evaluate.main(["--run", str(lora_run), "--actor", str(lora_run / "actor_adapter"),
                          "--json"]) == 0
    from_adapter = json.loads(capsys.readouterr().out)["figures"]
    assert from_adapter == pytest.approx(want, rel=1e-6, abs=1e-7)


# --- bad input ------------------------------------------------------------------------------

@pytest.fixture
def no_loading(monkeypatch):
    """Any model load fails the test: a refusal must come before."""
    import ppo_jax.saved_actor as saved

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    for module in ("ppo_jax.generate", "ppo_jax.evaluate"):  # imported before the patch:
        __import__(module)  # a first import after it would keep `refuse` past the test
    for name in ("build_trainer", "load_actor"):
        monkeypatch.setattr(saved, name, refuse)
    for module in ("ppo_jax.generate", "ppo_jax.evaluate"):
        for name in ("build_trainer", "load_actor"):
            if hasattr(sys.modules[module], name):
                monkeypatch.setattr(sys.modules[module], name, refuse)


@pytest.mark.parametrize("command, argv, named", [
    ("generate", ["{tmp}/nowhere", "--prompt", "x"], "{tmp}/nowhere"),
    ("generate", ["--run", "{run}", "--step", "7", "--prompt", "x"], "--step 7"),
    ("generate", ["--run", "{tmp}/nowhere", "--step", "2", "--prompt", "x"], "--run"),
    ("generate", ["{run}/actor_hf", "--prompts", "{tmp}/missing.jsonl"], "missing.jsonl"),
    ("generate", ["{run}/actor_hf", "--prompt", "x", "--top-p", "1.5"], "--top-p 1.5"),
    ("generate", ["{run}", "--prompt", "x"], "neither an HF model directory"),
    ("evaluate", ["--run", "{run}", "--step", "7"], "--step 7"),
    ("evaluate", ["--run", "{tmp}/nowhere"], "{tmp}/nowhere"),
    ("evaluate", ["--run", "{run}", "--actor", "{tmp}/nowhere"], "--actor"),
    ("evaluate", ["--run", "{run}", "--set", "model.lora.rank=0"],
     "--set model.lora.rank: evaluate changes eval.* keys only"),
    ("evaluate", ["--run", "{run}", "--set", "eval.prompts=null"], "eval.prompts"),
    ("generate", ["{run}/actor_hf", "--prompt", "x", "--import", "no_such_fork_55"],
     "error: --import no_such_fork_55: No module named 'no_such_fork_55'"),
    ("evaluate", ["--run", "{run}", "--import", "no_such_fork_55"],
     "error: --import no_such_fork_55: No module named 'no_such_fork_55'"),
])
def test_bad_input_exits_2_naming_it_before_any_model_loads(lora_run, tmp_path, capsys, no_loading,
                                                             command, argv, named):
    module = __import__(f"ppo_jax.{command}", fromlist=["main"])
    fill = {"tmp": tmp_path, "run": lora_run}
    argv = [a.format(**fill) for a in argv]
    try:
        code = module.main(argv)
    except SystemExit as e:  # argparse's refusals
        code = e.code
    assert code == 2
    assert named.format(**fill) in capsys.readouterr().err


def test_a_forks_module_is_imported_before_the_run_config_is_read(lora_run, capsys,
                                                                  monkeypatch):
    """A run whose config names a fork's registered loss loads in generate only with the
    fork's module given to --import, as train.py's (examples/my_losses.py registers plain_pg)."""
    from ppo_jax import generate
    from ppo_jax.core.registry import unregister

    monkeypatch.chdir(ROOT)
    argv = ["--run", str(lora_run), "--step", "2", "--set", "ppo.policy_loss=plain_pg",
            "--prompt", "x"]
    def forget():  # the module registers two losses: a fresh process, before and after
        for name in ("plain_pg", "ppo_clip_entropy"):
            unregister("policy loss", name)
        sys.modules.pop("examples.my_losses", None)

    forget()
    try:
        assert generate.main(argv) == 2
        assert "plain_pg" in capsys.readouterr().err
        assert generate.main([*argv, "--import", "examples.my_losses"]) == 0
    finally:
        forget()


def test_evaluate_refuses_an_adapter_in_a_run_without_lora(lora_run):
    from ppo_jax import evaluate
    from ppo_jax.saved_actor import read_run_config
    from ppo_jax.trainer.config import ConfigError

    cfg = read_run_config(lora_run, ["model.lora.rank=0"])
    with pytest.raises(ConfigError, match="model.lora.rank is 0"):
        evaluate.check_actor(cfg, str(lora_run / "actor_adapter"))


# --- a full (non-LoRA) run (slow), and RLVR's accuracy and pass@k ---------------------------

@pytest.mark.slow
def test_full_run_checkpoint_export_and_evaluate_agree(cache, tmp_path, capsys):
    from ppo_jax import evaluate

    run = train_tiny(tmp_path / "run")
    from_step = answers(capsys, "--run", str(run), "--step", "2")
    ids, logp = sampler_answers(run, *hf_model(run / "actor_hf"))
    assert [r["response_ids"] for r in from_step] == ids
    np.testing.assert_allclose([r["logprob"] for r in from_step], logp, rtol=1e-6)
    want = {k: v for k, v in logged(run, 2).items() if k != "time/eval"}
    for which in (["--step", "2"], ["--actor", str(run / "actor_hf")]):
        assert evaluate.main(["--run", str(run), *which, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["figures"] == pytest.approx(want, rel=1e-6)
    assert evaluate.main(["--run", str(run), "--step", "0", "--json"]) == 0
    start = {k: v for k, v in logged(run, 0).items() if k != "time/eval"}
    assert json.loads(capsys.readouterr().out)["figures"] == pytest.approx(start, rel=1e-6)


def test_evaluate_an_rlvr_run_gives_its_accuracy_and_pass_at_k(cache, tmp_path, capsys):
    from ppo_jax import evaluate
    from ppo_jax.trainer.config import load_config
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    run = tmp_path / "rlvr"
    PPOTrainer(load_config(ROOT / "configs/rlvr/tiny.yaml", [
        f"train.output_dir={run}", "train.progress=false", "train.tensorboard=false",
        "train.save_every=0", "eval.every=2"])).train(progress=False)
    assert evaluate.main(["--run", str(run), "--json"]) == 0  # the latest step: 2
    figures = json.loads(capsys.readouterr().out)["figures"]
    want = {k: v for k, v in logged(run, 2).items() if k != "time/eval"}
    assert {"eval/accuracy", "eval/pass@2"} <= set(figures)
    assert figures == pytest.approx(want, rel=1e-6, abs=1e-7)
