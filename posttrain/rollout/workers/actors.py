"""rollout.launcher=ray: each rollout worker a Ray actor, placed by a placement group bundle of its own on any node
of a Ray cluster (docs/distributed.md).

Ray is the placement, lifecycle and health layer here, nothing more. The placement group reserves one bundle a
worker (its CPUs) and Ray starts each actor in its bundle, on the node the group chose; an actor that dies, or that
the trainer kills after `rollout.worker_timeout_s`, Ray starts again in the same bundle (`max_restarts`), and the
pool reconnects it as the next incarnation and sends its requests again, as it does for a local process. The
trainer bounds the restarts (`rollout.max_worker_restarts`) and stops the actors with the run; an actor whose
trainer has died Ray stops itself, since the trainer owns it.

Tensors do not travel through a hand-made RPC: requests are Ray actor calls and the sampled batches come back as
their Ray objects, while the weights go as today, over the versioned, bucketed gloo group of two per worker, whose
rendezvous is the trainer's TCP store, at the address of the trainer's node as Ray knows it.

The actor runs the same `Core` as a local worker process: requests in one concurrency group, served in order, weight
pushes in another, on a thread of their own, so a push never waits for a rollout to end.
"""

from __future__ import annotations

import os
import time
from typing import Any

from posttrain.core.errors import TrainingError, UserError
from posttrain.rollout.workers.process import Core
from posttrain.rollout.workers.spec import FAULT, POLL_S, WorkerSpec, one_line

INSTALL = "pip install 'posttrain[ray]'"


def ray_module():
    """Ray, or a one-line error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UserError(f"rollout.launcher=ray needs Ray: {INSTALL}") from None
    return ray


def join_cluster(address: str) -> bool:
    """Connects this process to the Ray cluster at `address` (ray.address); `auto`: the cluster `ray start` made on
    this machine (or RAY_ADDRESS), else a local one started here. Returns whether this process started it (and so
    stops it). A process already connected (a Ray job, the Python API) keeps its connection."""
    ray = ray_module()
    if ray.is_initialized():
        return False
    quiet = dict(logging_level="warning", include_dashboard=False, configure_logging=True)
    if address != "auto":
        try:
            ray.init(address=address, **quiet)
        except (ConnectionError, ValueError, RuntimeError) as err:
            raise UserError(f"ray.address: cannot join the Ray cluster at {address!r} ({one_line(err)[:200]})") \
                from None
        return False
    if not os.environ.get("RAY_ADDRESS") and not cluster_here():  # a local one, for this run ("local": Ray's record
        # of a cluster that died with its process, in /tmp/ray, would have `auto` wait for it for minutes)
        ray.init(address="local", **quiet)
        return True
    ray.init(address="auto", **quiet)
    return False


def cluster_here() -> bool:
    """Whether a Ray cluster runs on this machine (a GCS process of `ray start`)."""
    try:
        from ray._private.services import find_gcs_addresses

        return bool(find_gcs_addresses())
    except Exception:  # noqa: BLE001 - Ray's own helper moved: let `auto` look, as Ray does
        return True


class RolloutActor:
    """The Ray actor around a worker's `Core` (made remote by `RayLauncher`, since Ray is imported only then)."""

    def __init__(self, spec: WorkerSpec, index: int, fault: str | None):
        if fault:  # the tests' fault injection, carried to the actor's process
            os.environ[FAULT] = fault
        self.spec, self.index, self.core = spec, index, None

    def where(self) -> tuple[str, int, str]:
        """The node this actor runs on (Ray's node id), its process, and the node's address."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid(), ray.util.get_node_ip_address()

    def start(self, incarnation: int, host: str, port: int) -> tuple[str, str]:
        """Builds the core as incarnation `incarnation` and joins the trainer's weights group; the attention it
        samples with, and its device."""
        import ray

        def kill():  # the tests' `die` fault: Ray kills this actor, and starts it again
            ray.kill(ray.get_runtime_context().current_actor, no_restart=False)

        self.core = Core(self.spec, self.index, incarnation, None, kill=kill)
        return self.core.connect(host, port, ray.util.get_node_ip_address()), str(self.core.device)

    def request(self, rid: int, kind: str, payload) -> tuple:
        return self.core.answer(rid, kind, payload)

    def take(self, version: int, layout: list) -> None:
        try:
            self.core.take(version, layout)
        except Exception:  # the trainer gave up on this push and restarts this worker
            os._exit(3)


class RayWorker:
    """A worker actor as the pool holds it: the calls of `LocalWorker`, made as Ray actor calls."""

    def __init__(self, actor, index: int, incarnation: int, host: str, port: int, last_pid: int | None = None):
        self.actor, self.index, self.incarnation, self.host, self.port = actor, index, incarnation, host, port
        self.group = self.pid = self.attention = self.node = self.device = None
        self.last_pid = last_pid  # the process of the incarnation before, which a restart must not answer from
        self.started = None  # the start call, until it has answered
        self.pending: dict[Any, int] = {}  # request calls in flight -> request id
        self.dead: str | None = None

    @property
    def who(self) -> str:
        return f"rollout worker {self.index} (pid {self.pid})"

    def _get(self, call, limit: float, what: str):
        """A call's answer within `limit` seconds, or a one-line TrainingError."""
        import ray

        try:
            return ray.get(call, timeout=limit)
        except ray.exceptions.GetTimeoutError:
            raise TrainingError(f"{self.who} did not {what} within {limit:g} s") from None
        except ray.exceptions.RayError as err:
            raise TrainingError(f"{self.who} could not start: {one_line(err)[:300]}") from None

    def hello(self, limit: float) -> int:
        """Waits until the actor runs (Ray may be starting it again, after a death or a kill), then has it build its
        engine; its pid."""
        import ray

        deadline = time.monotonic() + limit
        while True:
            try:
                node, pid, _ = ray.get(self.actor.where.remote(), timeout=max(deadline - time.monotonic(), 0.1))
            except ray.exceptions.GetTimeoutError:
                raise TrainingError(f"rollout worker {self.index}: its Ray actor did not start within {limit:g} s "
                                    "(is its bundle placed? `ray status`)") from None
            except ray.exceptions.RayActorError:  # the incarnation before, on its way out
                pid = self.last_pid
            if pid != self.last_pid:
                break
            if time.monotonic() > deadline:
                raise TrainingError(f"rollout worker {self.index}: its Ray actor was not started again within "
                                    f"{limit:g} s")
            time.sleep(POLL_S / 4)
        self.node, self.pid = node, pid
        self.started = self.actor.start.remote(self.incarnation, self.host, self.port)
        return pid

    def ready(self, limit: float) -> str:
        (self.attention, self.device), self.started = self._get(self.started, limit, "load its engine"), None
        return self.attention

    def send(self, message: tuple) -> None:
        self.pending[self.actor.request.remote(*message)] = message[0]

    def announce(self, version: int, layout: list) -> None:
        # a failure to take it ends the actor: the push and the requests see its death
        self.actor.take.options(concurrency_group="weights").remote(version, layout)

    def poll(self, timeout: float) -> tuple | None:
        import ray

        if not self.pending:
            time.sleep(timeout)
            return None
        done, _ = ray.wait(list(self.pending), num_returns=1, timeout=timeout)
        if not done:
            return None
        rid = self.pending.pop(done[0])
        try:
            return ray.get(done[0])
        except ray.exceptions.RayActorError as err:
            self.dead = f"died ({type(err).__name__})"
        except ray.exceptions.RayError as err:
            return ("error", rid, one_line(err)[:300])
        return None

    def gone(self) -> str | None:
        return self.dead

    def kill(self) -> None:
        """Has Ray kill the actor (it starts it again, for the next incarnation); nothing to do once it died."""
        import ray

        if self.dead is None:
            ray.kill(self.actor, no_restart=False)
            self.dead = "killed"

    def stop(self) -> None:
        """Has Ray kill the actor for good (the run is over): `kill` then has nothing left to do."""
        import ray

        ray.kill(self.actor, no_restart=True)
        self.dead = "stopped"

    def join(self, timeout: float) -> None:
        pass


def fits(nodes: list[dict], bundle: dict, bundles: int, strategy: str) -> bool:
    """Whether `bundles` copies of `bundle` ({resource: amount}) can be placed by `strategy` on nodes holding the
    given resources (all of them free): STRICT_PACK on one node, STRICT_SPREAD on as many different ones, PACK and
    SPREAD anyhow."""
    def holds(node: dict) -> int:  # copies of the bundle one node holds
        return min(int(node.get(k, 0) // v) for k, v in bundle.items() if v > 0)

    if strategy == "STRICT_PACK":
        return any(holds(n) >= bundles for n in nodes)
    if strategy == "STRICT_SPREAD":
        return sum(holds(n) >= 1 for n in nodes) >= bundles
    return sum(holds(n) for n in nodes) >= bundles


class RayLauncher:
    """rollout.launcher=ray: a placement group of one bundle a worker ({"CPU": threads}), laid out by
    `strategy`, and each worker an actor in its bundle, which Ray restarts when it dies."""

    name = "ray"

    def __init__(self, spec: WorkerSpec, workers: int, *, address: str, strategy: str, max_restarts: int,
                 start_s: float):
        ray = ray_module()
        from ray.util.placement_group import placement_group, placement_group_table

        self.spec, self.ours, self.actors, self.group = spec, join_cluster(address), {}, None
        self.host = self.device_host = ray.util.get_node_ip_address()  # the trainer's node, as the workers reach it
        self.trainer_node = ray.get_runtime_context().get_node_id()
        bundle = {"CPU": spec.threads, **({"GPU": spec.gpus} if spec.gpus else {})}
        nodes = [{k: n["Resources"].get(k, 0) for k in bundle} for n in ray.nodes() if n.get("Alive")]
        if not fits(nodes, bundle, workers, strategy):
            self.close()
            have = ", ".join(" and ".join(f"{n[k]:g} {k}s" for k in bundle)
                             for n in sorted(nodes, key=lambda n: tuple(n.values()), reverse=True))
            raise UserError(f"rollout.workers: {workers} bundle(s) of {bundle} (ray.strategy={strategy}) do not fit "
                            f"the Ray cluster's nodes, of {have}")
        self.group = placement_group([dict(bundle) for _ in range(workers)], strategy=strategy)
        try:
            ray.get(self.group.ready(), timeout=start_s)
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise UserError(f"rollout.workers: Ray did not place {workers} bundle(s) of {bundle} "
                            f"(ray.strategy={strategy}) within {start_s:g} s: the cluster's CPUs are held by others "
                            "(`ray status` shows what is free)") from None
        table = placement_group_table(self.group)["bundles_to_node_id"]
        self.bundle_nodes = [table[i] for i in range(workers)]
        # weight pushes on a thread of their own; the rest one at a time, in order
        self.actor_class = ray.remote(concurrency_groups={"weights": 1})(RolloutActor)
        self.max_restarts = max_restarts

    def spawn(self, index: int, incarnation: int, port: int, started: list | None = None) -> RayWorker:
        """Worker `index`'s actor: created in its bundle for incarnation 0; afterwards the same actor, which Ray
        starts again."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        last = self.actors.get(index)
        if last is None:
            actor = self.actor_class.options(
                num_cpus=self.spec.threads, num_gpus=self.spec.gpus, max_restarts=-1, max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index),
                name=f"posttrain-rollout-{index}-{os.getpid()}",
            ).remote(self.spec, index, os.environ.get(FAULT))
        else:
            actor = last.actor
        worker = RayWorker(actor, index, incarnation, self.host, port, last_pid=last.pid if last else None)
        self.actors[index] = worker
        if started is not None:
            started.append(worker)
        return worker

    def report(self) -> dict:
        """Where the placement group put each bundle, and the trainer's node (Ray node ids)."""
        return {"bundle_nodes": self.bundle_nodes, "trainer_node": self.trainer_node}

    def close(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        from ray.util.placement_group import remove_placement_group

        for w in self.actors.values():
            try:
                ray.kill(w.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - gone already
                pass
        self.actors = {}
        if self.group is not None:
            try:
                remove_placement_group(self.group)
            except Exception:  # noqa: BLE001 - gone with its job
                pass
        if self.ours:
            ray.shutdown()
