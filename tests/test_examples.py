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
def test_train_lm_track_limit_fails(tmp_path, capsys, flag):
    rc, log = run_tiny(tmp_path, "--steps", "2", "--track-backend", "xla", flag, "-1")
    err = capsys.readouterr().err
    assert rc == 1
    assert err.count("FAIL: ") == 1 and f"> {flag} -1" in err
    assert log["summary"]["max_abs_diff"] == 0.0


def test_train_lm_train_backend_reaches_the_layers(tmp_path):
    """``--train-backend`` is the layers' ``train_backend``: ``tilelang`` cannot train on a CPU, and says so before
    any step (on a Hopper GPU the same flag trains with the backward kernels)."""
    import jax

    if jax.devices()[0].platform == "gpu":
        pytest.skip("on a GPU the TileLang backward can run")
    with pytest.raises(NotImplementedError, match="`train_backend`='tilelang' cannot run here"):
        train_lm.main([*TINY, "--steps", "1", "--checkpoint", str(tmp_path / "ck.npz"), "--train-backend", "tilelang"])


def test_train_lm_track_limits_need_track_backend(capsys):
    with pytest.raises(SystemExit):
        train_lm.parse_args(["--max-track-diff", "0.1"])
    assert "--max-track-diff needs --track-backend" in capsys.readouterr().err
