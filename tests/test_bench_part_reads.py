"""benchmarks/part_reads.py: the page worker's part reads beside the disk's speed (issue 43)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from mapoffload.pagecache.pages import FOLIO_BYTES

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
sys.path.insert(0, BENCH)

from part_reads import OFFSET, layout, windows  # noqa: E402

MIB = 1 << 20


def test_the_parts_are_packed_as_safetensors_packs_them_off_the_folio_boundaries():
    parts = layout(2, 4 * MIB, 14 * MIB)
    assert len(parts) == 14 and parts[0][0] == OFFSET
    assert [n for _, n in parts[:7]] == [4 * MIB] * 4 + [14 * MIB] * 3
    for (a, n), (b, _) in zip(parts, parts[1:]):
        assert b in (a + n, a + n + 4096)  # packed; a norm's 4 KiB between layers
    assert all(off % FOLIO_BYTES for off, _ in parts)


def test_a_part_widened_to_its_windows_covers_it_on_folio_boundaries():
    parts = layout(1, 4 * MIB, 14 * MIB)
    size = parts[-1][0] + parts[-1][1] + 4096
    for (off, n), (lo, m) in zip(parts, windows(parts, size)):
        assert lo % FOLIO_BYTES == 0 and lo <= off and off + n <= lo + m
        assert m - n < 2 * FOLIO_BYTES


def test_it_runs_and_reports_each_way_alone_and_beside_a_compute(tmp_file_dir, tmp_path):
    out = tmp_path / "out.json"
    run = subprocess.run([sys.executable, os.path.join(BENCH, "part_reads.py"), "--dir", str(tmp_file_dir),
                          "--layers", "1", "--attn-mib", "0.5", "--mlp-mib", "2", "--repeat", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = json.loads(out.read_text())
    assert set(got["results"]) == {"alone", "beside a compute"}
    for where, rows in got["results"].items():
        assert set(rows) == {"file", "parts", "windows"}
        assert all(r["gb_s"] > 0 for r in rows.values())
        assert (rows["parts"]["compute_per_s"] is None) == (where == "alone")
    assert not list(tmp_file_dir.glob("mapoffload-part-reads-*"))  # its file removed
