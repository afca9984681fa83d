"""The abstract trainer `--compile-for` compiles is the trainer a run builds: same train states,
frozen params, shapes, dtypes and shardings, and its programs are the trainer's own jitted
functions (issue 22: "compile from the functions the trainer really runs, not a copy")."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from ppo_jax.trainer.config import load_config
from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

ROOT = Path(__file__).resolve().parents[2]


def layout(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype), str(x.sharding.spec),
                                   x.sharding.memory_kind), tree)


@pytest.mark.parametrize("extra", [
    [], ["model.lora.rank=4", "model.lora.critic=true"],
    pytest.param(["model.shared_critic=true"], marks=pytest.mark.slow),
    pytest.param(["ppo.advantage_estimator=grpo", "generation.samples_per_prompt=2"],
                 marks=pytest.mark.slow)])
def test_abstract_build_has_the_real_builds_arrays(tmp_path, monkeypatch, extra):
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    sets = [f"train.output_dir={tmp_path / 'run'}",
            f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}",
            f"eval.prompts={ROOT / 'configs/prompts/quotes_eval.jsonl'}", "train.progress=false",
            *extra]
    cfg = load_config(ROOT / "configs/tiny.yaml", sets)
    real, abstract = PPOTrainer(cfg), PPOTrainer.abstract(cfg)
    assert layout(abstract.state) == layout(real.state)
    assert layout(abstract.ref_params) == layout(real.ref_params)
    assert layout(abstract.frozen) == layout(real.frozen)  # a LoRA run's base ({} without)
    assert abstract.stop_ids == real.stop_ids
    assert abstract.settings.sampling.pad_token_id == real.settings.sampling.pad_token_id
    programs = {p.name: p for p in abstract.programs()}
    assert programs["update"].fn is abstract.jit.update
    assert programs["sampler"].fn is abstract.jit.sampler.static(abstract.settings.sampling)
    # the widest batch a run can meet: prompts max_prompt_length wide (the real set's width is
    # at most that), responses max_new_tokens long
    exp = programs["update"].args[3]  # (actor, critic, frozen base, experience, key)
    assert real.prompts.ids.shape[1] <= cfg.data.max_prompt_length
    assert exp.query_ids.shape == (cfg.ppo.batch_size, cfg.data.max_prompt_length)
    assert exp.response_ids.shape == (cfg.ppo.batch_size, cfg.generation.max_new_tokens)


def test_abstract_build_reads_no_weights_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    cfg = load_config(ROOT / "configs/default.yaml", [f"train.output_dir={out}"])
    trainer = PPOTrainer.abstract(cfg)  # smollm2: the shipped config.json, no GGUF conversion
    assert trainer.models.actor.cfg.num_layers == 30 and trainer.tokenizer is None
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(trainer.state))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_offloaded_frozen_params_leave_hbm_on_a_multi_host_slice():
    """model.offload_frozen on v5p-16 (two hosts; process 0 sees only its own devices'
    memories): the reference lives in pinned host memory, so no program counts it in HBM."""
    pytest.importorskip("libtpu")
    from ppo_jax.aot.compile_for import per_chip_bytes
    from ppo_jax.aot.topology import resolve_slice, slice_devices

    devices = slice_devices(resolve_slice("v5p-16"))
    cfg = load_config(ROOT / "configs/tiny.yaml", ["model.offload_frozen=true", "mesh.tensor=2"])
    trainer = PPOTrainer.abstract(cfg, devices)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(trainer.ref_params)} == {"pinned_host"}
    assert per_chip_bytes(trainer.resident()["reference"]) == 0
    experience = {p.name: p for p in trainer.programs()}["experience"]
    assert {x.sharding.memory_kind for x in jax.tree.leaves(experience.args[1])} == {"device"}


@pytest.mark.parametrize("engine", ["static", "paged"])
def test_an_environment_run_lists_the_engines_turn_loop_and_the_episodes_experience(
        tmp_path, monkeypatch, engine):
    """With env.name, a step samples on the engine's turn loop whichever engine (static: one
    page per row), so --compile-for lists its prefill, decode chunk and resume after an
    observation, and the experience of an action mask; no single-turn static sampler."""
    import importlib

    importlib.import_module("tests.trainer.scripted_environment")  # registers scripted_tool
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    sets = [f"train.output_dir={tmp_path / 'run'}", "env.name=scripted_tool",
            "eval.every=0", "eval.at_start=false", f"generation.engine={engine}"]
    if engine == "paged":
        sets.append("generation.page_size=8")
    cfg = load_config(ROOT / "configs/tiny.yaml", sets)
    trainer = PPOTrainer.abstract(cfg)
    programs = {p.name: p for p in trainer.programs()}
    assert {"engine_prefill", "engine_decode", "engine_resume"} <= set(programs)
    assert "sampler" not in programs
    resume = programs["engine_resume"]
    assert resume.per_step == programs["engine_prefill"].per_step * (cfg.env.max_turns - 1)
    batch = programs["experience"].args[2]
    assert batch.action_mask.shape == (cfg.ppo.batch_size, cfg.generation.max_new_tokens)
    assert batch.ended.shape == (cfg.ppo.batch_size,)
