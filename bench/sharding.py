"""Per-rank bytes by role under each training backend on 2 processes, against `posttrain estimate`.

    python bench/sharding.py                       # about 2 minutes on 2 CPU cores
    python bench/sharding.py --backends ddp,fsdp2 --layers 8 --hidden 256

One short GRPO run per backend (`torchrun --nproc_per_node 2 -m posttrain run recipe=grpo_math`, fp32, β > 0 so
that a reference model is loaded), on a random Llama built here with the embedded tokenizer. Each run's summary.json
holds rank 0's bytes by role, counted from the tensors themselves (`memory.roles_bytes`); the estimate for the same
model, method, backend and process count gives its rows. The script prints both and their ratio, and the rank's peak
resident memory. DeepSpeed backends are skipped when DeepSpeed is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# summary role -> estimate rows that predict it
ROLES = {
    "policy_weights": ["policy parameters"],
    "policy_gradients": ["policy gradients"],
    "policy_optimizer_state": ["policy AdamW moments", "policy fp32 master weights"],
    "reference_weights": ["reference model"],
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backends", default="ddp,fsdp2,zero2,zero3")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    args = p.parse_args()
    from posttrain.apps.estimate import estimate, model_spec
    from posttrain.models.embedded import build_model_dir

    root = Path(tempfile.mkdtemp(prefix="posttrain-sharding-"))
    model = build_model_dir(root / "model", hidden=args.hidden, layers=args.layers, heads=4)
    spec = model_spec(str(model))
    print(f"model: {spec.n_params:,} parameters ({args.layers} layers, hidden {args.hidden}); GRPO, fp32, 2 processes; "
          "bytes held by rank 0")
    print("| backend | role | measured | estimate | measured / estimate |\n|---|---|---:|---:|---:|")
    for backend in args.backends.split(","):
        if backend.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
            print(f"| {backend} | (skipped: DeepSpeed is not installed) | | | |")
            continue
        out = root / backend
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "posttrain",
             "run", "recipe=grpo_math", f"model.path={model}", f"output_dir={out}", "train.precision=fp32",
             "train.steps=2", "train.batch_size=2", "algorithm.group_size=4", "rollout.max_new_tokens=16",
             "eval.num_problems=0", "data.train_size=50", "data.test_size=4", f"train.backend={backend}"],
            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        summary = json.loads((out / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["backend"] == backend, summary
        measured = summary["memory"]["roles_bytes"]
        rows = {r.role: r.gpu_bytes for r in estimate(spec, "grpo", gpus=2, dtype="fp32", backend=backend,
                                                      beta=0.04).rows}
        for role, names in ROLES.items():
            predicted = sum(rows.get(n, 0) for n in names)
            got = measured.get(role, 0)
            ratio = f"{got / predicted:.3f}" if predicted else "-"
            print(f"| {backend} | {role} | {got:,} | {predicted:,} | {ratio} |")
        print(f"| {backend} | peak RSS of rank 0 (MB) | {summary['peak_rss_mb']:.0f} | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
