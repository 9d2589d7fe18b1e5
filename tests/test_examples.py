"""CPU tests of examples/train_lm.py: --track-backend reproduces a run bit for bit with the same train backend
(same seed, data stream and steps), and its limits set the exit status."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("train_lm", ROOT / "examples" / "train_lm.py")
train_lm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_lm)

TINY = ("--d-model 64 --num-layers 1 --head-dim 16 --mlp-hidden 64 --batch-size 2 --seq-len 32 --max-bytes 200000 "
        "--eval-batches 1 --gen-tokens 4 --min-loss-drop 0").split()


def run_tiny(tmp_path, *extra):
    log = tmp_path / "losses.json"
    rc = train_lm.main([*TINY, "--checkpoint", str(tmp_path / "ck.npz"), "--loss-log", str(log), *extra])
    return rc, json.loads(log.read_text())


def test_train_lm_track_same_backend_is_bit_identical(tmp_path, capsys):
    rc, log = run_tiny(tmp_path, "--steps", "6", "--train-backend", "xla", "--track-backend", "xla")
    out = capsys.readouterr()
    assert rc == 0, out.err
    track = [json.loads(line[len("TRACK "):]) for line in out.out.splitlines() if line.startswith("TRACK ")]
    assert len(track) == 1 and track[0] == log["summary"]
    s = log["summary"]
    assert (s["backend"], s["track_backend"], s["steps"]) == ("xla", "xla", 6)
    assert len(log["main"]["losses"]) == 6
    assert log["track"]["losses"] == log["main"]["losses"]  # same backend, data and seed: bit-identical
    assert s["max_abs_diff"] == 0.0 and s["ema_max_abs_diff"] == 0.0 and s["final_rel_diff"] == 0.0
    assert log["track"]["final_loss"] == log["main"]["final_loss"]
    assert log["config"]["train_backend"] == "xla" and log["main"]["backend"] == "xla"  # (read from the layers)
    ck = train_lm.np.load(tmp_path / "ck.npz")
    assert json.loads(str(ck["__config__"]))["train_backend"] == "xla"  # in the checkpoint's config


@pytest.mark.parametrize("flag", ["--max-track-diff", "--max-final-rel-diff"])
def test_train_lm_track_limit_fails(tmp_path, capsys, monkeypatch, flag):
    """Limits are >= 0 and the same backend tracks itself exactly, so the comparison is made to report 1e-3 on both
    measures: only the limit set to 0 fails (the defaults 0.05 / 0.01 hold)."""
    compare = train_lm.compare_runs
    monkeypatch.setattr(train_lm, "compare_runs",
                        lambda run, ref: dict(compare(run, ref), ema_max_abs_diff=1e-3, final_rel_diff=1e-3))
    rc, log = run_tiny(tmp_path, "--steps", "2", "--track-backend", "xla", flag, "0")
    err = capsys.readouterr().err
    assert rc == 1
    assert err.count("FAIL: ") == 1 and f"> {flag} 0.0" in err
    assert log["summary"]["max_abs_diff"] == 0.0


def _tilelang_runs_here() -> bool:
    return train_lm._tilelang_unavailable_reason(("chunk_gdn2", "fused_recurrent_gdn2")) is None


def test_train_lm_train_backend_reaches_the_layers(tmp_path, monkeypatch):
    """``--train-backend`` is the layers' ``train_backend``: with the command line's TileLang check switched off,
    ``tilelang`` cannot train on a CPU, and the layers say so before any step (on a Hopper GPU the same flag trains
    with the backward kernels)."""
    if _tilelang_runs_here():
        pytest.skip("on a Hopper GPU the TileLang backward can run")
    monkeypatch.setattr(train_lm, "_tilelang_unavailable_reason", lambda ops: None)
    with pytest.raises(NotImplementedError, match="`train_backend`='tilelang' cannot run here"):
        train_lm.main([*TINY, "--steps", "1", "--checkpoint", str(tmp_path / "ck.npz"), "--train-backend", "tilelang"])


def test_train_lm_track_limits_need_track_backend(capsys):
    with pytest.raises(SystemExit):
        train_lm.parse_args(["--max-track-diff", "0.1"])
    assert "--max-track-diff needs --track-backend" in capsys.readouterr().err


def _no_corpus(*_):
    raise AssertionError("the corpus was loaded before the arguments were checked")


@pytest.mark.parametrize("flag", ["--backend", "--train-backend", "--track-backend"])
def test_train_lm_tilelang_fails_at_parsing(capsys, monkeypatch, flag):
    """Where the TileLang kernels cannot run (the library's check), a tilelang backend is a usage error naming the
    flag, before the corpus is read."""
    if _tilelang_runs_here():
        pytest.skip("on a Hopper GPU the TileLang kernels can run")
    monkeypatch.setattr(train_lm, "load_corpus", _no_corpus)
    with pytest.raises(SystemExit) as e:
        train_lm.main([flag, "tilelang"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert f"error: {flag} tilelang: the TileLang kernels need an NVIDIA Hopper GPU (sm_90)" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--steps", "-1"], "--steps must be >= 1"),
    (["--seq-len", "0"], "--seq-len must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--d-model", "0"], "--d-model must be >= 1"),
    (["--num-layers", "0"], "--num-layers must be >= 1"),
    (["--num-heads", "0"], "--num-heads must be >= 1"),
    (["--head-dim", "0"], "--head-dim must be >= 1"),
    (["--mlp-hidden", "0"], "--mlp-hidden must be >= 1"),
    (["--eval-batches", "0"], "--eval-batches must be >= 1"),
    (["--max-bytes", "0"], "--max-bytes must be >= 1"),
    (["--max-bytes", "387"], "--max-bytes must be > 3 * (--seq-len + 1) = 387"),
    (["--num-v-heads", "3"], "--num-v-heads must be a multiple of --num-heads 2"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--gen-tokens", "-1"], "--gen-tokens must be >= 0"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--lr", "0"], "--lr must be finite and > 0"),
    (["--lr", "nan"], "--lr must be finite and > 0"),
    (["--weight-decay", "-0.1"], "--weight-decay must be finite and >= 0"),
    (["--max-train-seconds", "0"], "--max-train-seconds must be > 0"),
    (["--min-loss-drop", "-1"], "--min-loss-drop must be finite and in [0, 100]"),
    (["--temperature", "0"], "--temperature must be finite and > 0"),
    (["--track-backend", "xla", "--max-track-diff", "-1"], "--max-track-diff must be >= 0"),
    (["--track-backend", "xla", "--max-final-rel-diff", "nan"], "--max-final-rel-diff must be >= 0"),
    (["--gen-batch", "1,0"], "argument --gen-batch: batch sizes must be >= 1"),
    (["--gen-batch", "1,x"], "argument --gen-batch: expected comma-separated integers"),
    (["--prompt", ""], "--prompt must not be empty"),
])
def test_train_lm_bad_values_fail_at_parsing(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(train_lm, "load_corpus", _no_corpus)
    with pytest.raises(SystemExit) as e:
        train_lm.main(argv)
    assert e.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err


def test_train_lm_defaults_parse():
    args = train_lm.parse_args([])
    assert (args.steps, args.seq_len, args.gen_batch) == (150, 128, [1])
    assert (args.max_track_diff, args.max_final_rel_diff) == (0.05, 0.01)  # the --track-backend limits' defaults
    assert train_lm.parse_args(["--gen-batch", "1,64"]).gen_batch == [1, 64]


def test_train_lm_help_shows_each_default_once(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option
    with pytest.raises(SystemExit) as e:
        train_lm.parse_args(["--help"])
    assert e.value.code == 0
    entries = []  # one per option: its line and continuation lines, joined
    for ln in capsys.readouterr().out.split("options:")[1].splitlines():
        if ln.startswith("  -"):
            entries.append(ln.strip())
        elif ln.strip():
            entries[-1] += "  " + ln.strip()
    lines = {e.split()[0]: e for e in entries}
    assert "(default: None)" not in "".join(lines.values())
    assert lines["--steps"].endswith("training steps (default: 150)")
    assert lines["--seq-len"].endswith("bytes per training sequence (default: 128)")
    for flag, ln in lines.items():
        if flag not in ("-h,", "--loss-log"):  # (no default: the log is written only when asked for)
            assert ln.count("default") == 1, ln
    for flag, default in (("--max-track-diff", "0.05"), ("--max-final-rel-diff", "0.01")):
        assert lines[flag].startswith(f"{flag} {flag[2:].upper().replace('-', '_')}  only with --track-backend:")
        assert lines[flag].endswith(f"(default with --track-backend: {default})")
