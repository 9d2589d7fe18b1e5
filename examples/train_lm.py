#!/usr/bin/env python
"""Train a small byte-level Gated DeltaNet-2 language model in Flax NNX, then generate text with a cache.

By default the text is the source code of the running Python's standard library (``*.py`` under
``sysconfig.get_paths()["stdlib"]``, without site-packages), so nothing is downloaded. The model is
embeddings -> N x [RMSNorm -> GatedDeltaNet2 -> residual, RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm ->
tied (default) or untied byte head. Training uses optax AdamW and differentiates the op with ``--train-backend``
(default ``xla``: forward and backward in jnp; ``tilelang`` / ``auto``: the TileLang forward and backward kernels on
a Hopper GPU, ``auto`` where they exist); generation uses a jit-compiled prefill (chunk / fused-recurrent op on the
prompt, filling the cache) and a jit-compiled decode loop (``lax.scan`` of single-token steps with the
fused-recurrent op), with the ``--backend`` of your choice (``auto`` picks the TileLang kernels on a Hopper GPU
where they exist).

``--track-backend B`` then trains a second model from the same seed on the same batches, in the same order and for
as many steps, with train backend B, and prints ``TRACK {json}``: the per-step differences of the two training-loss
curves (raw and EMA(0.9)) and the relative difference of the final held-out losses; exit status 1 when these exceed
``--max-track-diff`` / ``--max-final-rel-diff``. ``--loss-log PATH`` writes the curves and held-out losses as JSON.

The default configuration trains on a 2-core CPU in a few minutes, until the held-out loss has fallen by at
least ``--min-loss-drop`` percent (exit status 1 otherwise).

Examples::

    python examples/train_lm.py                                   # CPU defaults
    python examples/train_lm.py --data-dir ~/my_texts --glob '*.txt'
    python examples/train_lm.py --backend tilelang --show-hlo     # H200 (bfloat16 by default on a GPU)
    python examples/train_lm.py --train-backend tilelang --track-backend xla   # kernel backward tracks xla's
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from flax_layers import GatedDeltaNet2  # noqa: E402
from gdn2_jax import backends  # noqa: E402

VOCAB = 256  # bytes
DEFAULT_PROMPT = 'import os\nimport sys\n\n\ndef main(argv):\n    """Parse the command line."""\n    '


# ---------------------------------------------------------------------------------------------------------- model
class MLP(nnx.Module):
    def __init__(self, d: int, hidden: int, *, dtype, rngs: nnx.Rngs):
        lin = dict(use_bias=False, dtype=dtype, rngs=rngs)
        self.gate = nnx.Linear(d, hidden, **lin)
        self.up = nnx.Linear(d, hidden, **lin)
        self.down = nnx.Linear(hidden, d, **lin)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, cfg: dict, *, rngs: nnx.Rngs):
        d, dtype = cfg["d_model"], cfg["dtype"]
        self.attn_norm = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.attn = GatedDeltaNet2(d, head_dim=cfg["head_dim"], num_heads=cfg["num_heads"],
                                   num_v_heads=cfg["num_v_heads"], backend=cfg["backend"],
                                   train_mode=cfg["train_mode"], train_backend=cfg["train_backend"], dtype=dtype,
                                   rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.mlp = MLP(d, cfg["mlp_hidden"], dtype=dtype, rngs=rngs)

    def __call__(self, x, cache):
        h, cache = self.attn(self.attn_norm(x), cache=cache)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), cache


class GDN2LM(nnx.Module):
    """Byte-level GDN-2 language model. ``__call__(tokens [B, T], caches) -> (logits [B, T, 256] f32, caches)``."""

    def __init__(self, cfg: dict, *, rngs: nnx.Rngs):
        d = cfg["d_model"]
        self.embed = nnx.Embed(VOCAB, d, dtype=cfg["dtype"],
                               embedding_init=nnx.initializers.normal(stddev=0.02), rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg["num_layers"])])
        self.norm = nnx.RMSNorm(d, dtype=cfg["dtype"], rngs=rngs)
        self.head = None if cfg["tie_embeddings"] else nnx.Linear(d, VOCAB, use_bias=False, dtype=cfg["dtype"],
                                                                 rngs=rngs)

    def init_cache(self, batch_size: int):
        return [blk.attn.init_cache(batch_size) for blk in self.blocks]

    def __call__(self, tokens, caches=None):
        x = self.embed(tokens)
        caches = caches if caches is not None else [None] * len(self.blocks)
        new = []
        for blk, c in zip(self.blocks, caches):
            x, c = blk(x, c)
            new.append(c)
        x = self.norm(x)
        logits = self.embed.attend(x) if self.head is None else self.head(x)
        return logits.astype(jnp.float32), new


# ----------------------------------------------------------------------------------------------------------- data
def load_corpus(data_dir: str | None, pattern: str, max_bytes: int) -> tuple[np.ndarray, int]:
    """Concatenate the files (sorted, each followed by a blank line) into one uint8 array of at most max_bytes."""
    if data_dir is None:
        root = pathlib.Path(sysconfig.get_paths()["stdlib"])
        skip = {"site-packages", "dist-packages", "__pycache__"}
    else:
        root, skip = pathlib.Path(data_dir).expanduser(), {"__pycache__"}
    files = sorted(p for p in root.rglob(pattern) if p.is_file() and not skip.intersection(p.parts))
    if not files:
        raise SystemExit(f"no files matching {pattern!r} under {root}")
    chunks, total = [], 0
    for p in files:
        try:
            b = p.read_bytes()
        except OSError:
            continue
        chunks.append(b + b"\n\n")
        total += len(b) + 2
        if total >= max_bytes:
            break
    data = np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)
    return data, len(chunks)


def batches(data: np.ndarray, batch: int, seq: int, rng: np.random.Generator):
    """Random windows of seq + 1 bytes (inputs and next-byte targets)."""
    while True:
        starts = rng.integers(0, len(data) - seq - 1, size=batch)
        yield np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32)


# ------------------------------------------------------------------------------------------------- checkpointing
def save_checkpoint(path: pathlib.Path, model: nnx.Module, cfg: dict, step: int):
    """Plain numpy .npz: one array per parameter path ('blocks/0/attn/q_proj/kernel', ...) + the config."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    arrays = {"/".join(map(str, k)): np.asarray(v[...]).astype(np.float32) for k, v in flat}
    meta = {k: (str(v) if k == "dtype" else v) for k, v in cfg.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, __config__=json.dumps(meta), __step__=step, **arrays)


def load_checkpoint(path: pathlib.Path, model: nnx.Module):
    """Load a :func:`save_checkpoint` file into ``model`` (same config), in place."""
    ck = np.load(path)
    state = nnx.state(model, nnx.Param)
    for k, v in nnx.to_flat_state(state):
        v.set_value(jnp.asarray(ck["/".join(map(str, k))], v.dtype))
    nnx.update(model, state)


# ------------------------------------------------------------------------------------------------------ training
def make_optimizer(args) -> optax.GradientTransformation:
    """AdamW with warmup + cosine decay, global-norm clipping, no weight decay on A_log / dt_bias / norm scales /
    biases (as in the reference training code)."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1),
                                                  end_value=args.lr * 0.1)
    no_decay = ("A_log", "dt_bias", "scale", "bias")

    def wd_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: not any(n in jax.tree_util.keystr(path) for n in no_decay), params)

    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay, mask=wd_mask))


def loss_fn(m, batch):
    logits, _ = m(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@nnx.jit
def train_step(m, opt, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(m, batch)
    opt.update(m, grads)
    return loss


eval_loss = nnx.jit(loss_fn)


def train_model(model: GDN2LM, tx, args, train: np.ndarray, held_out: np.ndarray, steps: int, *,
                deadline: float) -> dict:
    """Train ``model`` in place for ``steps`` steps (fewer when ``time.perf_counter()`` passes ``deadline``) on the
    batch stream of ``--seed`` (a fresh numpy generator: the held-out batches, then the training batches, so two
    calls see the same data in the same order). Returns backend, steps, per-step training losses, held-out loss
    before and after, training seconds and tokens/s."""
    backend = model.blocks[0].attn.train_backend
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    rng = np.random.default_rng(args.seed)
    eval_data = [b for b, _ in zip(batches(held_out, args.batch_size, args.seq_len, rng), range(args.eval_batches))]
    train_iter = batches(train, args.batch_size, args.seq_len, rng)

    def held_out_loss():
        return float(np.mean([float(eval_loss(model, jnp.asarray(b))) for b in eval_data]))

    model.train()  # deterministic=False: the layers differentiate train_mode's op with train_backend
    start_loss = held_out_loss()
    print(f"[train backend {backend}] start held-out loss: {start_loss:.4f} (ln 256 = {math.log(256):.4f})")
    tok_per_step = args.batch_size * args.seq_len
    bar = tqdm(range(steps), desc=f"train ({backend})", unit="step", dynamic_ncols=True)
    t_train = time.perf_counter()
    losses, ema, t_first = [], None, None
    for step in bar:
        loss = float(train_step(model, optimizer, jnp.asarray(next(train_iter))))
        if step == 0:
            t_first = time.perf_counter()  # excludes the compile of the first step from tokens/s
        losses.append(loss)
        ema = loss if ema is None else 0.9 * ema + 0.1 * loss
        if step > 0:
            tps = step * tok_per_step / (time.perf_counter() - t_first)
            bar.set_postfix(loss=f"{ema:.3f}", tok_s=f"{tps:,.0f}")
        if time.perf_counter() > deadline:
            bar.write(f"stopping after {len(losses)} steps: --max-train-seconds={args.max_train_seconds} reached")
            break
    bar.close()
    train_s = time.perf_counter() - t_train
    n = len(losses)
    train_tps = (n - 1) * tok_per_step / max(time.perf_counter() - t_first, 1e-9) if n > 1 else 0.0
    final_loss = held_out_loss()
    print(f"[train backend {backend}] trained {n} steps in {train_s:.1f}s ({train_tps:,.0f} tokens/s after the "
          f"first step); final held-out loss {final_loss:.4f}")
    return dict(backend=backend, steps=n, losses=losses, start_loss=start_loss, final_loss=final_loss,
                train_s=train_s, train_tok_s=train_tps)


def ema_curve(xs, decay: float = 0.9) -> np.ndarray:
    out, e = [], None
    for x in xs:
        e = x if e is None else decay * e + (1 - decay) * x
        out.append(e)
    return np.asarray(out, np.float64)


def compare_runs(run: dict, ref: dict) -> dict:
    """Per-step differences of two runs' training losses (raw and EMA(0.9)) and the relative difference of their
    final held-out losses (relative to ``ref``'s)."""
    raw = np.abs(np.asarray(run["losses"], np.float64) - np.asarray(ref["losses"], np.float64))
    ema = np.abs(ema_curve(run["losses"]) - ema_curve(ref["losses"]))
    return dict(backend=run["backend"], track_backend=ref["backend"], steps=run["steps"],
                final_loss=run["final_loss"], track_final_loss=ref["final_loss"],
                max_abs_diff=float(raw.max(initial=0.0)), mean_abs_diff=float(raw.mean()) if raw.size else 0.0,
                ema_max_abs_diff=float(ema.max(initial=0.0)),
                ema_mean_abs_diff=float(ema.mean()) if ema.size else 0.0,
                final_rel_diff=abs(run["final_loss"] - ref["final_loss"]) / abs(ref["final_loss"]))


# ---------------------------------------------------------------------------------------------------- generation
def custom_calls(compiled) -> list[str]:
    """custom_call targets in compiled HLO text (the TileLang kernels appear here on the GPU)."""
    import re

    return sorted(set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())))


def generate(model: GDN2LM, prompt: bytes, n_new: int, *, temperature: float, seed: int, show_hlo: bool,
             batch: int = 1):
    """jit-compiled prefill + jit-compiled decode loop with the layer caches, for ``batch`` copies of the prompt
    (each row samples its own continuation); returns (text of row 0, stats). Timings are of a second run (the
    first one loads the kernels); tokens/s count all rows."""
    model.eval()  # deterministic=True: FLA dispatch (fused_recurrent for <= 64 tokens) with --backend
    graphdef, params = nnx.split(model)
    tokens = jnp.tile(jnp.asarray(np.frombuffer(prompt, np.uint8).astype(np.int32))[None], (batch, 1))

    def prefill(params, tokens):
        m = nnx.merge(graphdef, params)
        logits, caches = m(tokens, m.init_cache(tokens.shape[0]))
        return logits[:, -1], caches

    def decode(params, logits, caches, key):
        m = nnx.merge(graphdef, params)

        def step(carry, key):
            logits, caches = carry
            tok = jax.random.categorical(key, logits / temperature)[:, None].astype(jnp.int32)
            logits, caches = m(tok, caches)
            return (logits[:, -1], caches), tok[:, 0]

        (_, caches), toks = jax.lax.scan(step, (logits, caches), jax.random.split(key, n_new))
        return toks.T, caches

    t0 = time.perf_counter()
    prefill_c = jax.jit(prefill).lower(params, tokens).compile()
    logits_s, caches_s = jax.eval_shape(prefill, params, tokens)
    decode_c = jax.jit(decode, donate_argnums=(2,)).lower(params, logits_s, caches_s, jax.random.key(0)).compile()
    compile_s = time.perf_counter() - t0
    if show_hlo:
        print(f"custom calls in compiled prefill HLO: {custom_calls(prefill_c) or 'none'}")
        print(f"custom calls in compiled decode  HLO: {custom_calls(decode_c) or 'none'}")

    for _ in range(2):  # the second run is timed (the first one loads the kernels and warms the caches)
        t0 = time.perf_counter()
        logits, caches = prefill_c(params, tokens)
        jax.block_until_ready(logits)
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        toks, caches = decode_c(params, logits, caches, jax.random.key(seed))
        toks = np.asarray(jax.block_until_ready(toks))[0]
        decode_s = time.perf_counter() - t0
    text = bytes(toks.astype(np.uint8)).decode("utf-8", errors="replace")
    return text, dict(compile_s=compile_s, prefill_tok_s=batch * tokens.shape[1] / prefill_s,
                      decode_tok_s=batch * n_new / decode_s, prefill_s=prefill_s, decode_s=decode_s)


# ---------------------------------------------------------------------------------------------------------- main
class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to every option's help, except where the default is None (the help says what
    happens then) or the help describes the default itself (``default:`` in it)."""

    def _get_help_string(self, action):
        if action.default is None or "default:" in action.help:
            return action.help
        return super()._get_help_string(action)


def _tilelang_unavailable_reason(ops) -> str | None:
    """Why the TileLang kernels of ``ops`` (public op names) cannot run here, or None: the library's own check
    (:func:`gdn2_jax.backends.tilelang_unavailable_reason`, which the layers call before they compute)."""
    return next((why for why in map(backends.tilelang_unavailable_reason, ops) if why is not None), None)


def _gen_batches(text: str) -> list[int]:
    """``--gen-batch``: comma-separated batch sizes >= 1."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (e.g. 1,64), got {text!r}") from None
    if not all(b >= 1 for b in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return sizes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter)
    p.add_argument("--data-dir", default=None, help="folder of text (default: this Python's stdlib sources)")
    p.add_argument("--glob", default="*.py", help="file pattern under --data-dir")
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="read at most this much text")
    p.add_argument("--d-model", type=int, default=128, help="model width")
    p.add_argument("--num-layers", type=int, default=2, help="GDN-2 blocks")
    p.add_argument("--num-heads", type=int, default=2, help="query/key heads per layer")
    p.add_argument("--num-v-heads", type=int, default=None,
                   help="value heads, a multiple of --num-heads (GVA when > --num-heads; default: --num-heads)")
    p.add_argument("--head-dim", type=int, default=64, help="key/value head dim")
    p.add_argument("--mlp-hidden", type=int, default=384, help="hidden width of the SwiGLU MLP")
    p.add_argument("--untied", action="store_true", help="separate output head instead of tied embeddings")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="computation dtype (auto: float32 on CPU, bfloat16 on a GPU, where the TileLang kernels "
                        "take bfloat16)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per training step")
    p.add_argument("--seq-len", type=int, default=128, help="bytes per training sequence")
    p.add_argument("--steps", type=int, default=150, help="training steps")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (cosine decay to 0.1x)")
    p.add_argument("--warmup", type=int, default=20, help="linear learning-rate warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW weight decay (not on A_log, dt_bias, norm scales, biases)")
    p.add_argument("--max-train-seconds", type=float, default=420.0,
                   help="stop training early after this much wall time (compile included)")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches for the start/final loss")
    p.add_argument("--min-loss-drop", type=float, default=40.0,
                   help="exit with status 1 unless the held-out loss fell by at least this many percent (0-100)")
    p.add_argument("--backend", default="auto", choices=["auto", "xla", "tilelang"],
                   help="op backend for generation (training uses --train-backend; tilelang needs a Hopper GPU)")
    p.add_argument("--train-backend", default="xla", choices=["auto", "xla", "tilelang"],
                   help="op backend differentiated in training (tilelang: the forward and backward kernels on a "
                        "Hopper GPU; auto: those where they exist, else xla)")
    p.add_argument("--track-backend", default=None, choices=["xla", "tilelang", "auto"],
                   help="after training, train again from the same seed on the same batches with this train "
                        "backend and compare the loss curves (TRACK line); default: no second run")
    p.add_argument("--max-track-diff", type=float, default=None,
                   help="only with --track-backend: exit with status 1 when the EMA(0.9) training-loss curves "
                        "differ by more than this (nats, >= 0) at any step (default with --track-backend: 0.05)")
    p.add_argument("--max-final-rel-diff", type=float, default=None,
                   help="only with --track-backend: exit with status 1 when the final held-out losses differ by "
                        "more than this fraction (>= 0) (default with --track-backend: 0.01)")
    p.add_argument("--loss-log", default=None, help="write the per-step training losses and held-out losses "
                                                     "(of both runs with --track-backend) to this JSON file")
    p.add_argument("--train-mode", default="auto", choices=["auto", "chunk", "fused_recurrent"],
                   help="op differentiated in training (auto: fused_recurrent on CPU, where autodiff of the "
                        "token loop is faster than the chunked form at these sizes; chunk elsewhere)")
    p.add_argument("--checkpoint", default="checkpoints/gdn2_lm.npz", help="where to save the trained model")
    p.add_argument("--prompt", default=DEFAULT_PROMPT,
                   help=f"prompt, not empty (default: the {len(DEFAULT_PROMPT.encode())}-byte start of a Python "
                        "main() with a docstring; longer than 64 bytes, so the prefill takes the chunk path)")
    p.add_argument("--gen-tokens", type=int, default=200, help="bytes to generate after the prompt")
    p.add_argument("--gen-batch", type=_gen_batches, default="1",
                   help="comma-separated batch sizes to generate with (e.g. 1,64)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (> 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialisation, data order and sampling (>= 0)")
    p.add_argument("--show-hlo", action="store_true", help="print custom calls of the compiled prefill/decode")
    args = p.parse_args(argv)

    def flag(name):
        return "--" + name.replace("_", "-")

    for name in ("max_bytes", "d_model", "num_layers", "num_heads", "head_dim", "mlp_hidden", "batch_size",
                 "seq_len", "steps", "eval_batches"):
        if getattr(args, name) < 1:
            p.error(f"{flag(name)} must be >= 1, got {getattr(args, name)}")
    for name in ("warmup", "gen_tokens", "seed"):
        if getattr(args, name) < 0:
            p.error(f"{flag(name)} must be >= 0, got {getattr(args, name)}")
    if args.num_v_heads is not None and (args.num_v_heads < args.num_heads or args.num_v_heads % args.num_heads):
        p.error(f"--num-v-heads must be a multiple of --num-heads {args.num_heads}, got {args.num_v_heads}")
    if args.max_bytes <= 3 * (args.seq_len + 1):
        p.error(f"--max-bytes must be > 3 * (--seq-len + 1) = {3 * (args.seq_len + 1)} (training and held-out "
                f"windows of --seq-len + 1 bytes), got {args.max_bytes}")
    for name, finite, ok, domain in (("lr", True, lambda x: x > 0, "> 0"),
                                     ("weight_decay", True, lambda x: x >= 0, ">= 0"),
                                     ("max_train_seconds", False, lambda x: x > 0, "> 0"),
                                     ("min_loss_drop", True, lambda x: 0 <= x <= 100, "in [0, 100]"),
                                     ("temperature", True, lambda x: x > 0, "> 0"),
                                     ("max_track_diff", False, lambda x: x >= 0, ">= 0"),
                                     ("max_final_rel_diff", False, lambda x: x >= 0, ">= 0")):
        x = getattr(args, name)
        if x is not None and not (ok(x) and (math.isfinite(x) or not finite)):  # (NaN fails ok)
            p.error(f"{flag(name)} must be {'finite and ' if finite else ''}{domain}, got {x}")
    if not args.prompt:
        p.error("--prompt must not be empty")
    for name, default in (("max_track_diff", 0.05), ("max_final_rel_diff", 0.01)):  # limits of --track-backend only
        if getattr(args, name) is not None and args.track_backend is None:
            p.error(f"{flag(name)} needs --track-backend")
        setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
    # TileLang kernels: fail here, before the corpus is read, where they cannot run (the layers would raise
    # NotImplementedError at their first call). Generation uses both ops; training the --train-mode op
    # (auto resolves to chunk wherever the kernels can run, i.e. on a GPU).
    train_ops = ("fused_recurrent_gdn2",) if args.train_mode == "fused_recurrent" else ("chunk_gdn2",)
    for name, ops in (("backend", ("chunk_gdn2", "fused_recurrent_gdn2")), ("train_backend", train_ops),
                      ("track_backend", train_ops)):
        if getattr(args, name) == "tilelang" and (why := _tilelang_unavailable_reason(ops)) is not None:
            p.error(f"{flag(name)} tilelang: the TileLang kernels need an NVIDIA Hopper GPU (sm_90) and the `cuda` "
                    f"extra, and cannot run here ({why}); use {flag(name)} xla or auto")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    print(f"JAX {jax.__version__} on {jax.devices()[0].platform} ({jax.device_count()} device(s))")
    data, n_files = load_corpus(args.data_dir, args.glob, args.max_bytes)
    if len(data) <= 3 * (args.seq_len + 1):  # (--max-bytes is checked in parse_args; the files may hold less)
        raise SystemExit(f"the corpus ({len(data)} bytes) is too small for --seq-len {args.seq_len}: it needs more "
                         f"than 3 * (--seq-len + 1) = {3 * (args.seq_len + 1)} bytes")
    n_eval = max(len(data) // 20, (args.seq_len + 1) * 2)
    train, held_out = data[:-n_eval], data[-n_eval:]
    print(f"corpus: {n_files} files, {len(data) / 1e6:.2f} MB ({len(train) / 1e6:.2f} MB train, "
          f"{len(held_out) / 1e6:.2f} MB held out)")

    if args.dtype == "auto":
        args.dtype = "float32" if jax.devices()[0].platform == "cpu" else "bfloat16"
    cfg = dict(d_model=args.d_model, num_layers=args.num_layers, num_heads=args.num_heads,
               num_v_heads=args.num_v_heads, head_dim=args.head_dim, mlp_hidden=args.mlp_hidden,
               tie_embeddings=not args.untied, backend=args.backend, dtype=jnp.dtype(args.dtype),
               train_mode=args.train_mode, train_backend=args.train_backend)
    if cfg["train_mode"] == "auto":
        cfg["train_mode"] = "fused_recurrent" if jax.devices()[0].platform == "cpu" else "chunk"
    model = GDN2LM(cfg, rngs=nnx.Rngs(args.seed))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"model: {n_params / 1e6:.2f}M parameters, {args.num_layers} GDN-2 blocks, d={args.d_model}, "
          f"heads={args.num_heads}x{args.head_dim}, {args.dtype} compute, training op {cfg['train_mode']} "
          f"(train backend {args.train_backend})")

    tx = make_optimizer(args)
    run = train_model(model, tx, args, train, held_out, args.steps, deadline=t_start + args.max_train_seconds)
    steps_done, start_loss, final_loss = run["steps"], run["start_loss"], run["final_loss"]
    drop = 100.0 * (start_loss - final_loss) / start_loss
    print(f"held-out loss: start {start_loss:.4f} -> final {final_loss:.4f}: fell by {drop:.1f}% "
          f"(required >= {args.min_loss_drop:.0f}%)")

    fails = [] if drop >= args.min_loss_drop else [f"loss fell by {drop:.1f}% < {args.min_loss_drop}%"]
    log = dict(config={k: (str(v) if k == "dtype" else v) for k, v in cfg.items()}, seed=args.seed, main=run)
    if args.track_backend is not None:  # same seed, batches and step count; no time limit
        track_cfg = dict(cfg, train_backend=args.track_backend)
        track = train_model(GDN2LM(track_cfg, rngs=nnx.Rngs(args.seed)), tx, args, train, held_out, steps_done,
                            deadline=math.inf)
        summary = compare_runs(run, track)
        print("TRACK " + json.dumps(summary))
        log.update(track=track, summary=summary)
        if not summary["ema_max_abs_diff"] <= args.max_track_diff:
            fails.append(f"the training-loss curves of train backends {args.train_backend} and {args.track_backend} "
                         f"differ: max |EMA(0.9) difference| {summary['ema_max_abs_diff']:.4g} > --max-track-diff "
                         f"{args.max_track_diff}")
        if not summary["final_rel_diff"] <= args.max_final_rel_diff:
            fails.append(f"final held-out losses {run['final_loss']:.4f} ({args.train_backend}) and "
                         f"{track['final_loss']:.4f} ({args.track_backend}) differ by {summary['final_rel_diff']:.3g} "
                         f"> --max-final-rel-diff {args.max_final_rel_diff}")
    if args.loss_log:
        pathlib.Path(args.loss_log).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.loss_log).write_text(json.dumps(log, indent=1))
        print(f"loss log: {args.loss_log}")

    ckpt = pathlib.Path(args.checkpoint)
    save_checkpoint(ckpt, model, cfg, steps_done)
    print(f"checkpoint: {ckpt} ({os.path.getsize(ckpt) / 1e6:.1f} MB)")
    reloaded = GDN2LM(cfg, rngs=nnx.Rngs(args.seed + 1))
    load_checkpoint(ckpt, reloaded)

    for gb in args.gen_batch:
        text, st = generate(reloaded, args.prompt.encode(), args.gen_tokens, temperature=args.temperature,
                            seed=args.seed, show_hlo=args.show_hlo, batch=gb)
        print(f"generation (backend={args.backend}, batch {gb}, from the reloaded checkpoint): compile "
              f"{st['compile_s']:.1f}s, prefill {st['prefill_tok_s']:,.0f} tokens/s ({gb} x "
              f"{len(args.prompt.encode())} tokens), decode {st['decode_tok_s']:,.0f} tokens/s "
              f"({gb} x {args.gen_tokens} tokens)")
    print("-" * 72)
    print(args.prompt + text)
    print("-" * 72)
    print(f"total wall time: {time.perf_counter() - t_start:.1f}s")
    for msg in fails:
        print(f"FAIL: {msg}", file=sys.stderr)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
