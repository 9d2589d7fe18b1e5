"""CPU tests of the benchmark tooling that needs no GPU."""

from __future__ import annotations

import csv


def test_sass_summary_counts_per_opcode_and_region(tmp_path, capsys):
    """``benchmarks.sass_summary`` reads an Nsight Compute per-SASS export (preamble lines, then the header row
    starting with "Address"), strips predicates and opcode modifiers, and sums executed instructions, stall samples
    and shared wavefronts per opcode and per region."""
    from benchmarks import sass_summary

    cols = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
            "L1 Wavefronts Shared", "L1 Wavefronts Shared Excessive"]
    rows = [["0x0", "      LDS.128 R4, [R2]", "10", "1,000", "400", "100"],
            ["0x10", "  @!P0 LDS R5, [R3+0x10]", "5", "500", "500", "0"],
            ["0x20", "      FMUL R1, R2, R3", "1", "3000", "0", "0"],
            ["0x30", "      MUFU.EX2 R1, R1", "4", "-", "-", "-"]]
    path = tmp_path / "sass.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "main_kernel"])
        w.writerow(cols)
        w.writerows(rows)
    got = sass_summary.load(str(path))
    assert [r["op"] for r in got] == ["LDS", "LDS", "FMUL", "MUFU"]
    assert got[0]["inst"] == 1000.0 and got[3]["inst"] == 0.0
    assert sass_summary.main([str(path), "--regions", "2"]) == 0
    out = capsys.readouterr().out
    assert "total 4500 warp instructions, stall samples 20, shared wavefronts 0.0 M (excess 0.0 M)" in out
    lds = next(line for line in out.splitlines() if line.startswith("LDS"))
    assert "0.0 M  33.3%" in lds and "stall      15 (75.0%)" in lds
    assert "region 0" in out and "region 1" in out


def test_benchmark_imports_and_its_selftest_passes(capsys):
    """``benchmarks.bench`` imports on a CPU host and its ``--selftest`` (the report, plot and section logic on
    synthetic rows) passes; the kernels it prebuilds include the two-warpgroup state pass that its batched H = 32
    prefill shapes run (``kernels.chunk_fwd.inference_options``)."""
    from benchmarks import bench
    from benchmarks import bench_lib as L

    assert bench.main(["--selftest"]) == 0
    assert "selftest:" in capsys.readouterr().out
    cfgs = [c for name, c in L.bench_kernel_configs() if name == "chunk_gdn2"]
    assert any(c.get("block_v") == 128 and c.get("state_threads") == 256 and c["HV"] == 32 for c in cfgs)
    assert any("block_v" not in c and c["HV"] == 16 for c in cfgs)
