"""Rollout workers as Ray actors (rollout.launcher=ray), on a Ray cluster of three simulated nodes on this machine
(ray.cluster_utils.Cluster): a head, where the trainer joins and which offers no CPU to actors, and two nodes of one
CPU each, where the placement group must put the workers.

Every run first asserts where its workers ran: the launcher was Ray, and each worker's actor reported the node its
bundle named, a node other than the trainer's. Then what tests/test_async.py shows of local workers holds: at k = 0
the run is the colocated one byte for byte, also with a worker's actor killed by Ray (while sampling, scoring the
reference, taking weights) or hung and timed out; at k = 1 a trainer killed with kill -9 and run again with the same
command trains every prompt exactly once.

Ray is an extra (`pip install 'posttrain[ray]'`): without it these tests skip, and POSTTRAIN_REQUIRE_RAY=1 (.ci/run)
turns the skip into a failure."""

import collections
import os
import signal

import pytest
from cli_helpers import assert_one_line_error, posttrain
from conftest import needs_ray
from test_async import REFERENCE, SEPARATE, metrics, run, summary, trained_prompts, weights

from posttrain.rollout.workers import FAULT

pytestmark = needs_ray


@pytest.fixture(scope="module")
def cluster():
    """A head node without CPUs for actors (the trainer joins here) and two nodes of one CPU each; their node ids."""
    from ray.cluster_utils import Cluster

    os.environ.pop("RAY_CLIENT_MODE", None)  # set by importing ray, to its default: commands can still be forked
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [c.add_node(num_cpus=1) for _ in range(2)]
    c.wait_for_nodes()
    yield c.address, c.head_node.node_id, [n.node_id for n in nodes]
    c.shutdown()


def on_ray(cluster, *extra):
    address, _, _ = cluster
    return [*SEPARATE, "rollout.launcher=ray", f"ray.address={address}", *extra]


def assert_placed(out, cluster, workers=1, restarts=0):
    """The workers were Ray actors, each on the node its bundle named, none on the trainer's (the head)."""
    _, head, nodes = cluster
    s = summary(out)
    w = s["rollout_workers"]
    assert s["placement"] == "separate" and w["launcher"] == "ray" and w["workers"] == workers
    assert w["trainer_node"] == head
    assert w["nodes"] == w["bundle_nodes"] and set(w["nodes"]) <= set(nodes)
    assert all(pid != os.getpid() for pid in w["pids"])
    assert w["restarts"] == restarts
    return w


# The N-th request (die), reference scoring request (die_scoring) and weight push (die_weights) has Ray kill the
# worker's actor, which Ray starts again; a hung push is timed out by the trainer, which has Ray kill it.
@pytest.mark.parametrize("fault", [None, "die:2", pytest.param("die_weights:2", marks=pytest.mark.slow),
                                   "hang_weights:2"])
def test_staleness_0_on_ray_is_the_colocated_run_byte_for_byte(warm_model_dir, colocated, cluster, tmp_path,
                                                               fault):
    out = tmp_path / "ray"
    proc = run(warm_model_dir, out, *on_ray(cluster, "rollout.worker_timeout_s=6"),
               env={FAULT: fault} if fault else None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_placed(out, cluster, restarts=int(fault is not None))
    if fault:
        assert "posttrain: rollout worker 0 (pid" in proc.stderr and "restarted as pid" in proc.stderr
        assert metrics(out)[-1]["rollout/worker_restarts"] == 1.0
    if fault == "hang_weights:2":  # the second push (version 1), stopped by its watchdog at the bound
        assert "pushing weights version 1 did not finish within 6 s" in proc.stderr
    assert [m["staleness/max"] for m in metrics(out)] == [0.0] * 4
    assert weights(out) == colocated


@pytest.mark.parametrize("fault", [None, "die_scoring:2"])
def test_ray_workers_score_the_reference_and_survive_a_kill_while_scoring(warm_model_dir, cluster, tmp_path, fault):
    """Two workers, a bundle each on the two nodes (STRICT_SPREAD), sampling a version ahead and scoring the
    reference; each killed by Ray in its second scoring request is started again and scores it anew."""
    out = tmp_path / "ray"
    proc = run(warm_model_dir, out, *REFERENCE, *on_ray(cluster, "rollout.reference_on=workers",
                                                        "ray.strategy=STRICT_SPREAD"),
               env={FAULT: fault} if fault else None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    w = assert_placed(out, cluster, workers=2, restarts=2 if fault else 0)
    assert len(set(w["nodes"])) == 2  # a node each
    assert summary(out)["reference_on"] == "workers"
    assert all(m["time/reference"] > 0 for m in metrics(out))


@pytest.fixture(scope="module")
def ahead(warm_model_dir, cluster, tmp_path_factory):
    """An uninterrupted run at k = 1 on two workers, a node each: its directory and each step's trained prompts."""
    out = tmp_path_factory.mktemp("ray-ahead") / "out"
    proc = run(warm_model_dir, out, *AHEAD(cluster))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, trained_prompts(out)


def AHEAD(cluster):
    return on_ray(cluster, "rollout.workers=2", "ray.strategy=STRICT_SPREAD", "rollout.max_staleness=1",
                  "train.save_every=2", "train.steps=5", "train.log_samples=true")


def test_staleness_1_on_ray_runs_a_version_ahead_on_two_nodes(ahead, cluster):
    out, prompts = ahead
    w = assert_placed(out, cluster, workers=2)
    assert len(set(w["nodes"])) == 2
    stale = [m["staleness/max"] for m in metrics(out)]
    assert stale[0] == 0.0 and max(stale) == 1.0
    assert len(prompts) == 5 and all(len(p) == 8 for p in prompts)


def test_a_trainer_killed_on_ray_and_run_again_trains_every_prompt_exactly_once(warm_model_dir, ahead, cluster,
                                                                                tmp_path):
    """kill -9 of the trainer between step 3 and its checkpoint: Ray stops the actors it owned with it, and the
    same command, run again, places new ones and trains each step's prompts of the uninterrupted run, once."""
    out = tmp_path / "killed"
    killed = run(warm_model_dir, out, *AHEAD(cluster), env={"POSTTRAIN_CRASH_AT": "step:3"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run(warm_model_dir, out, *AHEAD(cluster))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_placed(out, cluster, workers=2)
    assert summary(out)["resumed_from"]["step"] == 2
    prompts, whole = trained_prompts(out), ahead[1]
    assert prompts == whole
    assert collections.Counter(p for step in prompts for p in step) == \
        collections.Counter(p for step in whole for p in step)


@pytest.mark.slow  # a hung push (above) is timed out the same way, by the same restart
def test_a_ray_worker_hung_in_sampling_is_timed_out(warm_model_dir, cluster, tmp_path):
    out = tmp_path / "ray"
    proc = run(warm_model_dir, out, *on_ray(cluster, "rollout.worker_timeout_s=6"), env={FAULT: "hang:3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_placed(out, cluster, restarts=1)
    assert "did not answer a sampling request within 6 s" in proc.stderr


def test_bundles_the_cluster_cannot_place_are_a_one_line_error(warm_model_dir, cluster, tmp_path):
    """Three workers of one CPU each on a cluster of two CPUs, or a worker on a GPU of its own on a cluster without
    one (rollout.gpus: Ray's bundle asks for it): refused in one line, naming what the nodes hold."""
    for extra, fragments in ((["rollout.workers=3"], ["rollout.workers: 3 bundle(s) of {'CPU': 1}",
                                                      "nodes, of 1 CPUs, 1 CPUs, 0 CPUs"]),
                             (["rollout.gpus=1"], ["rollout.workers: 1 bundle(s) of {'CPU': 1, 'GPU': 1}",
                                                   "nodes, of 1 CPUs and 0 GPUs, 1 CPUs and 0 GPUs, 0 CPUs and 0 GPUs"])):
        proc = posttrain("run", "recipe=grpo_math", f"model.path={warm_model_dir}", f"output_dir={tmp_path / 'out'}",
                         "train.steps=1", *on_ray(cluster, *extra), "-q")
        assert_one_line_error(proc, "do not fit", *fragments)
        assert not (tmp_path / "out").exists()
