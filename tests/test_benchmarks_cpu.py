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
    # every launch of every prefill grid shape's pipeline, with the options its public call chooses, is prebuilt
    from kernels import build, registry

    prebuilt = {la.key for la in build.plan_launches(cfgs, ("chunk_gdn2",), "sm_90a")}
    for B, _, H in bench.PREFILL_GRID:
        call = registry.get("chunk_gdn2").options_for_call(N=B, HV=H, V=L.D)
        for la in L.chunk_pipeline(H, H, **call).launches:
            assert la.key in prebuilt, (B, H, call, la.name)


def test_source_digest_follows_the_measured_code(tmp_path, monkeypatch):
    """``env.source_digest`` of the benchmark JSON names the code a run measured (kernels, the JAX package, the
    benchmark): a copy of those files made in reverse order digests the same as the checkout; one changed byte in a
    kernel, or a renamed file, changes it; files that are not Python source, hidden paths, ``__pycache__`` and
    links do not."""
    import os
    import shutil

    from benchmarks import bench_lib as L

    srcs = sorted(f for d in L.DIGEST_DIRS for f in (L.REPO / d).rglob("*.py")
                  if "__pycache__" not in f.parts and not any(p.startswith(".") for p in f.relative_to(L.REPO).parts))
    for f in reversed(srcs):  # (the copy's directory order is not the checkout's)
        dst = tmp_path / f.relative_to(L.REPO)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dst)
    base = L.source_digest()
    assert len(base) == 64 and L.source_digest(tmp_path) == base
    # the order in which the file system lists the files does not matter
    rglob = type(tmp_path).rglob
    monkeypatch.setattr(type(tmp_path), "rglob", lambda self, pat: reversed(list(rglob(self, pat))))
    assert L.source_digest(tmp_path) == base
    monkeypatch.undo()
    (tmp_path / "kernels" / "notes.txt").write_text("not code")
    (tmp_path / "kernels" / "__pycache__").mkdir(exist_ok=True)
    (tmp_path / "kernels" / "__pycache__" / "x.py").write_text("x = 1")
    (tmp_path / "kernels" / ".ipynb_checkpoints").mkdir()
    (tmp_path / "kernels" / ".ipynb_checkpoints" / "y.py").write_text("y = 1")
    os.symlink(tmp_path / "nowhere", tmp_path / "kernels" / ".#chunk_fwd.py")  # (an editor's lock: dangling)
    os.symlink(tmp_path / "kernels" / "chunk_fwd.py", tmp_path / "kernels" / "alias.py")
    assert L.source_digest(tmp_path) == base
    k = tmp_path / "kernels" / "chunk_fwd.py"
    k.write_bytes(k.read_bytes() + b"\n")
    changed = L.source_digest(tmp_path)
    assert changed != base
    k.rename(tmp_path / "kernels" / "chunk_fwd2.py")
    (tmp_path / "kernels" / "alias.py").unlink()
    assert L.source_digest(tmp_path) not in (base, changed)
    assert L.env_info()["source_digest"] == base
