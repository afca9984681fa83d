"""Run two steps of stage 1 (SFT) and stage 2 (reward model) on the tiny random Llama under
several meshes; save the final params of each as `DIR/<stage>_<d>x<f>x<t><tag>.npz`.
`--set KEY=VALUE` adds an override to both stages' configs, `{stage}` in it standing for the
stage's section (`--set {stage}.packing=true`).

Run in a fresh process (the device count is fixed when jax starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/parallel/sharded_stages.py \
        --out DIR --sft SFT.jsonl --pairs PAIRS.jsonl --mesh 1,1,1 --mesh 2,2,2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sft", required=True)
    parser.add_argument("--pairs", required=True)
    parser.add_argument("--mesh", action="append", required=True)
    parser.add_argument("--set", action="append", default=[], dest="sets")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    import jax
    import numpy as np

    from ppo_jax.models.functional import flat_params
    from ppo_jax.parallel.host import to_host
    from ppo_jax.trainer.config import load_config
    from ppo_jax.trainer.stages import trainer_class

    out = Path(args.out)
    stages = {"sft": ["stage=sft", "model.actor=tiny-random", f"sft.data={args.sft}"],
              "reward_model": ["stage=reward_model", "model.reward_model=tiny-random",
                               f"reward_model.data={args.pairs}"]}
    for mesh in [tuple(int(x) for x in m.split(",")) for m in args.mesh]:
        name = "x".join(map(str, mesh)) + args.tag
        for stage, sets in stages.items():
            cfg = load_config(ROOT / "configs/tiny.yaml", [
                *sets, f"{stage}.batch_size=8", f"{stage}.micro_batch_size=4", f"{stage}.lr=1e-4",
                f"{stage}.eval_fraction=0.25", f"{stage}.max_length=40", "train.steps=2",
                "train.progress=false", "train.tensorboard=false", "train.export_hf=false",
                f"mesh.data={mesh[0]}", f"mesh.fsdp={mesh[1]}", f"mesh.tensor={mesh[2]}",
                f"train.output_dir={out / f'run_{stage}_{name}'}",
                *(s.format(stage=stage) for s in args.sets)])
            size = mesh[0] * mesh[1] * mesh[2]
            trainer = trainer_class(stage)(cfg, devices=jax.devices()[:size])
            history = trainer.train(progress=False)
            params = flat_params(to_host(trainer.state["model"].params))
            spec = str(jax.tree.leaves(trainer.state["model"].params)[0].sharding.spec)
            np.savez(out / f"{stage}_{name}.npz", **params,
                     **{f"metric/{k}": np.float64(v) for k, v in history[-1].items()
                        if k.startswith(("loss", "eval/", "accuracy"))})
            print(stage, name, "first param spec", spec, "loss", history[-1]["loss"])


if __name__ == "__main__":
    main()
