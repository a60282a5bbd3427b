"""One SFT update of a fixed global batch of 8 rows, each process taking every world-th row; run by test_ddp.py once
in one process and once under `torchrun --nproc_per_node 2`. Rank 0 saves the world size, the gradient (all-reduced
over processes, before the optimizer step) and the weights after the step.

    python tests/ddp_update.py MODEL_DIR OUT.pt
"""

import sys

import torch

from posttrain import config
from posttrain.backends.ddp import DDP
from posttrain.core.aggregation import Totals
from posttrain.core.batch import collate
from posttrain.data import prompt_ids, response_ids
from posttrain.sources import run_splits
from posttrain.train import Engine


def main(model_dir: str, out: str) -> None:
    cfg, _ = config.load("sft_math", [f"model.path={model_dir}", "train.micro_batch_size=3", "train.lr=1e-2",
                                      "data.train_size=50", "data.test_size=5"])
    backend = DDP()
    torch.manual_seed(0)
    engine = Engine(cfg, model_dir, backend, run_splits(cfg))
    rows = engine.train_rows[:8]  # responses of different lengths, so per-sequence and per-token totals differ
    batch = collate(prompt_ids(engine.tokenizer, rows, cfg.data), response_ids(engine.tokenizer, rows, cfg.data),
                    engine.tokenizer.pad_token_id)
    local = batch.select(slice(backend.rank, None, backend.world_size)).to(backend.device)
    totals = engine.totals(local)
    assert totals == Totals.of(batch.mask), (totals, Totals.of(batch.mask))  # the whole step's denominators
    engine.accumulate(local, totals)
    model = backend.generation_model(engine.policy)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    backend.step(engine.policy, cfg.train.max_grad_norm)
    top = float(backend.reduce(torch.tensor(float(backend.rank), device=backend.device), "max"))  # the highest rank
    if backend.is_main:
        torch.save({"world_size": backend.world_size, "grads": grads, "head": type(model.lm_head).__name__, "max": top,
                    "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}, out)
    backend.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
    from posttrain.backends.ddp import exit_process

    exit_process(0)  # as the CLI does: no teardown, where gloo's threads can abort a finished process
