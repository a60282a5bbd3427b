"""One SFT update of a fixed global batch of 8 rows, each process taking every world-th row; run by
tests/test_distributed.py in one process and under `torchrun --nproc_per_node 2`, for each backend. Rank 0 saves the
world size, the loss, the whole gradient (summed over processes, before the optimizer step), the whole weights after
the step, the bytes this process holds by role, and where it saved the model.

    python tests/update_step.py MODEL_DIR OUT.pt [BACKEND] [KEY=VALUE ...] [uneven]

With `uneven`, the first process takes rows 0-5 and the second rows 6-7, so that under a token budget
(train.micro_batch_tokens) they run different numbers of micro-batches; rank 0 also saves the fewest and most each
ran, and how many every process ran with the empty ones that pair their collectives.
"""

import sys
from pathlib import Path

import torch

from posttrain import backends, config
from posttrain.core.aggregation import Totals
from posttrain.core.batch import collate
from posttrain.data import prompt_ids, response_ids
from posttrain.sources import run_splits
from posttrain.train import build


def whole_grad(backend, param):
    """The whole gradient of a weight, summed over processes, before the step; None where it cannot be read here.
    ZeRO-2 reduces gradients only inside its step, and ZeRO-3 with its optimizer offloaded keeps them where
    DeepSpeed's reader does not look, so there the step's global norm is all there is to compare."""
    if backend.name == "zero2" or (backend.name == "zero3" and backend.offload != "none"):
        return None
    if backend.name == "zero3":
        from deepspeed.utils import safe_get_full_grad

        return safe_get_full_grad(param)  # a collective call
    return None if param.grad is None else backend.whole(param.grad)


def offloaded(backend, trained) -> str:
    """What the backend really put in CPU memory, read from the sharding library's own state."""
    if backend.name == "fsdp2":
        policy = trained.module._get_fsdp_state()._fsdp_param_group.offload_policy
        return "params" if type(policy).__name__ == "CPUOffloadPolicy" else "none"
    if backend.name.startswith("zero"):
        engine = trained.module
        return "params" if engine.zero_offload_param() else "optimizer" if engine.zero_cpu_offload() else "none"
    return "none"


def main(model_dir: str, out: str, backend_name: str = "ddp", *overrides: str) -> None:
    uneven = "uneven" in overrides
    overrides = tuple(o for o in overrides if o != "uneven")
    cfg, _ = config.load("sft_math", [f"model.path={model_dir}", "train.micro_batch_size=3", "train.lr=1e-2",
                                      "data.train_size=50", "data.test_size=5", "train.precision=fp32",
                                      f"train.backend={backend_name}", *overrides])
    backend = backends.get(backend_name)(precision=cfg.train.precision, offload=cfg.train.offload)
    torch.manual_seed(0)
    splits = run_splits(cfg)
    engine = build(cfg, model_dir, backend, splits)
    rows = splits[0][:8]  # responses of different lengths, so per-sequence and per-token totals differ
    batch = collate(prompt_ids(engine.tokenizer, rows, cfg.data), response_ids(engine.tokenizer, rows, cfg.data),
                    engine.tokenizer.pad_token_id)
    local = batch.select(slice(backend.rank, None, backend.world_size)).to(backend.device)
    if uneven and backend.world_size == 2:
        local = batch.select(slice(0, 6) if backend.rank == 0 else slice(6, 8)).to(backend.device)
    micro = engine.micro_batches(local)
    real = torch.tensor(float(sum(rows is not None for rows, _ in micro)), device=backend.device)
    counts = {"fewest": float(backend.reduce(real, "min")), "most": float(backend.reduce(real, "max")),
              "run": len(micro), "packed": engine.packed}
    totals = engine.totals(local)
    assert totals == Totals.of(batch.mask), (totals, Totals.of(batch.mask))  # the whole step's denominators
    loss = backend.reduce(engine.accumulate(local, totals)["loss"], "sum")
    model = backend.generation_model(engine.policy)
    params = dict(model.named_parameters())
    grads = {n: g.detach().clone() for n, g in ((n, whole_grad(backend, p)) for n, p in params.items())
             if g is not None}
    roles = {"weights": backend.weight_bytes(model), "gradients": backend.gradient_bytes(engine.policy)}
    norm = backend.step(engine.policy, cfg.train.max_grad_norm)
    roles["optimizer_state"] = backend.optimizer_bytes(engine.policy)
    weights = {n: backend.whole(p).detach().clone() for n, p in params.items()}
    top = float(backend.reduce(torch.tensor(float(backend.rank), device=backend.device), "max"))  # the highest rank
    saved = Path(out).with_suffix(".model")
    backend.save(engine.policy, engine.tokenizer, saved)
    if backend.is_main:
        torch.save({"world_size": backend.world_size, "backend": type(backend).__name__,
                    "offload": offloaded(backend, engine.policy),
                    "loss": float(loss), "norm": float(norm),
                    "grads": grads, "weights": weights, "roles": roles, "head": type(model.lm_head).__name__,
                    "max": top, "saved": str(saved), "dtype": str(next(iter(weights.values())).dtype),
                    "micro": counts}, out)
    backend.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
    from posttrain.backends.ddp import exit_process

    exit_process(0)  # as the CLI does: no teardown, where gloo's threads can abort a finished process
