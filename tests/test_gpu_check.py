"""bench/gpu_check.sh --smoke: the GPU check's code path on CPU (tiny model, both backends, the estimate comparison,
the decode timing, a weight push to a rollout worker), run from another directory, recording real figures in its
JSON file."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.sh"


def test_smoke_records_every_step(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(SCRIPT), "--smoke", "--out", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check (smoke)" in proc.stdout
    rec = json.loads(out.read_text())
    assert rec["ok"] and rec["errors"] == [] and rec["mode"] == "smoke"
    assert rec["device"]["type"] == "cpu" and rec["device"]["torch"]
    assert rec["model"]["parameters"] > 0 and rec["model"]["prompt_tokens"]["max"] > 0
    assert set(rec["backends"]) == {"ddp", "fsdp2"}
    for name, b in rec["backends"].items():
        assert b["ok"], b
        assert b["summary"]["backend"] == name and b["summary"]["world_size"] == 1  # the path really ran
        assert b["steps_in_medians"] >= 1
        for phase in ("rollout", "score", "update", "step"):
            assert b["tokens_per_s"][phase] > 0, (name, phase)
        assert b["medians"]["generated_tokens"] > 0 and b["medians"]["trained_tokens"] > 0
        assert b["memory"]["peak_source"] == "cpu_peak_rss_mb"
        assert all(v > 0 for v in b["memory"]["peak_mb_by_phase"].values())
        est = b["estimate"]
        assert est["ok"] and est["settings"]["backend"] == name and est["total_gpu_bytes"] > 0
        states = est["vs_measured"]["model_states"]
        assert states["measured_bytes"] > 0 and states["estimated_bytes"] > 0
        assert 0.9 < states["ratio"] < 1.1  # fp32 weights, gradients, AdamW moments and the reference: as estimated
        assert est["vs_measured"]["peak"]["measured_bytes"] > 0
    decode = rec["decode"]
    assert decode["ok"] and decode["engine"] == "hf" and decode["device"] == "cpu"
    assert decode["generated_tokens"] > 0 and decode["tokens_per_s"] > 0
    push = rec["push"]  # a rollout worker beside the trainer (on CPU here), taking 4 pushes, then sampling once
    assert push["ok"] and push["worker_device"] == "cpu" and push["transport"] == "gloo" and push["restarts"] == 0
    assert push["push_mib"] > 0 and len(push["push_seconds"]) == 4 and push["mib_per_s"] > 0
    assert push["sampled_rows"] > 0 and push["sampled_version"] == 3  # the worker sampled with the last push
    assert "weight push to a rollout worker on cpu" in proc.stdout
