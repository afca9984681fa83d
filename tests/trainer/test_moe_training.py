"""A Qwen3-MoE actor in the trainer (issue 56): PPO on the paged engine with LoRA and router
replay, where the float32 rollout's log-probs are the update's own (no mismatch) and the
router's load-balancing loss is part of the actor's loss and logged; SFT logs it too; replay
with a dense actor is refused by name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import train

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs/tiny.yaml"


def args(config: Path, out: Path, *sets: str) -> list[str]:
    out_args = ["--config", str(config), "--set", f"train.output_dir={out}",
                "--set", "train.steps=1", "--set", "train.progress=false",
                "--set", "model.actor=tiny-random-moe"]
    for s in sets:
        out_args += ["--set", s]
    return out_args


def last_metrics(out: Path) -> dict:
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])


def test_ppo_with_replay_on_the_paged_engine_with_lora(tmp_path):
    out = tmp_path / "ppo"
    assert train.main(args(TINY, out, "model.router_replay=rollout",
                           "generation.engine=paged", "generation.page_size=8",
                           "model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj]",
                           "eval.prompts=null", "train.export_hf=false")) == 0
    m = last_metrics(out)
    # float32 sampler and update, the same weights, the same experts: the same log-probs
    assert m["mismatch/abs_logprob_diff"] < 1e-5, m["mismatch/abs_logprob_diff"]
    assert m["ratio_first_minibatch"] == 1.0
    # k = 2 of E = 8 experts: transformers' loss is about k when the routing is balanced
    assert 1.5 < m["router_aux_loss"] < 4.0
    assert m["actor_grad_norm"] > 0


def test_sft_adds_and_logs_the_aux_loss_unless_its_coefficient_is_zero(tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"tell me about the {w}",
                                        "response": f"the {w} was good and nice"}) + "\n"
                            for w in ("train", "food", "film", "town")))
    sft = ("stage=sft", f"sft.data={data}", "sft.batch_size=4", "sft.micro_batch_size=2",
           "sft.max_length=48", "train.export_hf=false")
    assert train.main(args(TINY, tmp_path / "on", *sft)) == 0
    assert 1.5 < last_metrics(tmp_path / "on")["router_aux_loss"] < 4.0
    assert train.main(args(TINY, tmp_path / "off", *sft, "model.router_aux_loss_coef=0")) == 0
    assert "router_aux_loss" not in last_metrics(tmp_path / "off")


def test_replay_with_a_dense_actor_is_refused_by_name(tmp_path, capsys):
    out = tmp_path / "dense"
    assert train.main(args(TINY, out, "model.actor=tiny-random",
                           "model.router_replay=rollout")) != 0
    assert re.search(r"model.router_replay='rollout': the actor \(llama\) has no MoE layer",
                     capsys.readouterr().err)
    assert not (out / "metrics.jsonl").exists()
