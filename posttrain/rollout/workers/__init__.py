"""Rollout workers: sampling in processes of their own, apart from the trainer (`rollout.placement=separate`).

The training process starts each worker with torch.multiprocessing (spawn). A worker loads the starting policy
itself and runs a registered rollout engine on it (hf, or vllm), on its own cores and threads. It takes:

- sampling requests, from a queue: prompts, group sizes, sampling settings, the oldest policy version it may sample
  with, and the random generator's state to sample from. It answers with the batch, the version that sampled it,
  the generator's state after it, and how long it sat idle before the request;
- scoring requests (`rollout.reference_on=workers`): a batch it sampled, made into training rows, whose log-probs
  under the frozen reference model it holds beside its engine it answers with;
- weights, on a receiver thread: numbered versions over a gloo process group of two (trainer and worker), in
  buckets of at most `rollout.weight_bucket_mb`, into a staging copy. The worker swaps the newest staged version in
  at the start of its next request, so a push never waits for a rollout to end and never changes weights mid-rollout.

Why this machinery: torch.multiprocessing's queues carry tensors through shared memory, and a gloo group gives
collective transfers with a time-out on every operation; both ship with torch, and the group is the same code that
runs NCCL between GPUs. A worker that dies (its process gone) or hangs (a push or a request unanswered for
`rollout.worker_timeout_s`) is killed and started again, takes the last pushed weights, and gets its request again
with the same generator state, so it samples the same tokens; the log says so in a line and metrics.jsonl counts it
(`rollout/worker_restarts`). After `rollout.max_worker_restarts` restarts of one worker the run stops with an error
naming it. A worker whose training process has gone exits within a second.

Ctrl-C sends SIGINT to every process of the terminal's process group, the workers too. They ignore it, from the moment
they start (a worker starts with SIGINT blocked, and ignores it before unblocking it): the interrupt is the training
process's, which says so in one line and stops its workers (`close`), with no traceback from them.

Under LoRA with the hf engine, a worker holds the same adapted model and takes the adapter alone; vllm takes the
merged weights (`weight_sync` in summary.json says which was sent).
"""
from posttrain.rollout.workers.pool import Layout, WorkerPool
from posttrain.rollout.workers.process import reference_logprobs
from posttrain.rollout.workers.spec import FAULT, POLL_S, START_S, WorkerSpec, one_line, prefix, scoring_rows

__all__ = ["FAULT", "POLL_S", "START_S", "Layout", "WorkerPool", "WorkerSpec", "one_line", "prefix",
           "reference_logprobs", "scoring_rows"]
