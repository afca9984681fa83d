"""The shipped prompt sets: the default run's training prompts (configs/prompts/everyday.jsonl)
never share a prompt or the quotation style with the held-out set, and every one fits the
default config's `data.max_prompt_length` under SmolLM2's chat template (the tokenizer shipped
in bench/smollm2_tokenizer/)."""

import importlib.util
import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _prompts(name: str) -> list[str]:
    path = ROOT / "configs/prompts" / name
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


def test_everyday_prompts_are_distinct_and_never_held_out():
    everyday, held_out = _prompts("everyday.jsonl"), _prompts("quotes_eval.jsonl")
    assert len(everyday) == 465 and len(set(everyday)) == 465
    assert not set(everyday) & set(held_out)
    assert not [p for p in everyday if '"' in p or "proverb" in p.lower() or "saying" in p.lower()]


def test_default_prompts_fit_the_default_prompt_length(tmp_path):
    from transformers import AutoTokenizer

    spec = importlib.util.spec_from_file_location("bench_harness", ROOT / "bench/harness.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    tok = AutoTokenizer.from_pretrained(harness.unpack_tokenizer(tmp_path / "tok"))
    cfg = yaml.safe_load((ROOT / "configs/default.yaml").read_text())
    widths = [len(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                          add_generation_prompt=True, return_dict=True)["input_ids"])
              for p in _prompts(Path(cfg["data"]["prompts"]).name)]
    assert (min(widths), max(widths)) == (39, 52)  # the widths configs/default.yaml's comment gives
    assert max(widths) <= cfg["data"]["max_prompt_length"]
