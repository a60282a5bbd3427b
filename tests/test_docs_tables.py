"""The tables `bench/docs_tables.py` regenerates: each lives in its page between its markers, with the columns the
command writes and the stamp that says what measured it (the numbers are the machine's, and are not checked)."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "bench" / "docs_tables.py")
docs_tables = sys.modules["docs_tables"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(docs_tables)


@pytest.mark.parametrize("name", sorted(docs_tables.TABLES))
def test_each_table_has_its_columns_and_stamp(name):
    table = docs_tables.TABLES[name]
    text = (ROOT / table.page).read_text()
    found = re.search(rf"<!-- table:{name} -->\n(.*?)\n<!-- /table:{name} -->", text, re.S)
    assert found, f"{table.page} has no <!-- table:{name} --> block"
    lines = found.group(1).splitlines()
    header = docs_tables.markdown(table.columns, [])
    assert lines[:2] == header, f"{table.page}: the {name} table's columns are not the command's"
    rows = [line for line in lines[2:] if line.startswith("|")]
    assert rows and all(line.count(" | ") == len(table.columns) - 1 for line in rows)
    stamp = docs_tables.STAMP.match(lines[-1])
    assert stamp and stamp.group(1) == name, f"{table.page}: the {name} table's last line is not its stamp"


def test_every_marked_block_is_a_table_the_command_writes():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {m for page in pages for m in re.findall(r"<!-- table:(\w+) -->", page.read_text())}
    assert named == set(docs_tables.TABLES)


def test_a_block_is_replaced_whole_and_only_it():
    text = "intro\n<!-- table:x -->\nold\n| a |\n<!-- /table:x -->\noutro\n"
    assert docs_tables.replace_block(text, "x", "<!-- table:x -->\nnew\n<!-- /table:x -->") == (
        "intro\n<!-- table:x -->\nnew\n<!-- /table:x -->\noutro\n")
    with pytest.raises(SystemExit, match="no <!-- table:y -->"):
        docs_tables.replace_block(text, "y", "")
    stamp = docs_tables.stamp("first_command", "auto (bf16-mixed)", "fitted")
    assert docs_tables.STAMP.match(stamp).group(1) == "first_command"


def test_the_comparison_tables_read_their_commands_output_seed_by_seed(tmp_path, monkeypatch):
    """`variants` and `figure5` turn what `posttrain compare` / `reproduce figure5` wrote into their rows, with each
    seed's difference against the method before (here stood in for by written files, not runs): dapo is above grpo
    by 0.03 in every seed while the seeds move both by 0.1, so its bar on means overlaps and its seed by seed does not."""
    import argparse
    import json

    def run(before, after):
        return {"accuracy_before": before, "accuracy_after": after, "wall_seconds": 10.0, "warmup_seconds": 0.0,
                "memory": {"peak_rss_mb": 100.0}}

    after = {n: (0.7, 0.6, 0.8) for n in docs_tables.VARIANTS}
    after["dapo_math"] = (0.73, 0.63, 0.83)
    finals = {"rft": [0.5, 0.4, 0.6], "online_rft": [0.6, 0.5, 0.7], "grpo": [0.6, 0.55, 0.7],
              "grpo_ps": [0.55, 0.5, 0.6]}

    def fake(args, argv, out):
        out.mkdir(parents=True, exist_ok=True)
        if argv[0] == "compare":
            runs = {n: [run(0.3, a) for a in after[n]] for n in docs_tables.VARIANTS}
            (out / "compare.json").write_text(json.dumps({"seed_runs": runs}))
        else:
            (out / "figure5.json").write_text(json.dumps({"final_accuracy": finals}))
            (out / "compare.json").write_text(json.dumps({"seed_runs": {"grpo_math": [run(0.3, 0.6)] * 3}}))
            (out / "figure5.png").write_bytes(b"")
        return 1.0, "posttrain " + " ".join(argv)

    monkeypatch.setattr(docs_tables, "posttrain", fake)
    args = argparse.Namespace(work=tmp_path, cache=tmp_path / "cache", print=True)
    for name, measure in (("variants", docs_tables.variants), ("figure5", docs_tables.figure5)):
        rows = measure(args).rows
        assert all(len(r) == len(docs_tables.TABLES[name].columns) for r in rows)
    dapo = next(r for r in docs_tables.variants(args).rows if r[0] == "dapo_math")
    assert dapo[4:8] == ["+0.030", "no", "+0.030 ± 0.000", "3/3"]  # bars 0.1 + 0.1 against 0.03; every seed above
    grpo = next(r for r in docs_tables.figure5(args).rows if r[0] == "GRPO")
    assert grpo[3:] == ["GRPO > Online RFT", "+0.017", "0.176", "no", "+0.017 ± 0.029", "1/3"]  # 0, +0.05, 0
