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
