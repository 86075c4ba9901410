"""Train the DFlash drafter of kdtree-mini against the frozen target (the DFlash recipe, arXiv 2602.06036).

Each step: the target runs over the batch and its tapped layers (dflash target_layer_ids) give the features; many
random anchors per sequence each open a block [token, MASK x (L-1)] that sees the features strictly before its
anchor plus its own block; loss = position-decayed CE (w_k = exp(-(k-1)/gamma)) on block positions 1..L-1 against
the true continuation, + distill_weight * KL(target || drafter). Embedding and lm_head are the target's (frozen).

    python scripts/train_drafter.py                                  # real run (after train_target.py)
    python scripts/train_drafter.py --data regen --block-size 8      # target-regenerated data, L = 8
    python scripts/train_drafter.py --tiny --steps 20 --target DIR   # CPU smoke run on a --tiny target

Data (--data): corpus windows; regen = corpus prompts + the target's own greedy continuation (anchors only in the
continuation); mix = half of each batch from each. Saves the z-lab HF layout (bf16) to --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout, uninstalled

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from kdtree_jax import train as T  # noqa: E402
from kdtree_jax.checkpoint.drafter import drafter_from_hf_tensors, hf_tensors, save_drafter  # noqa: E402
from kdtree_jax.checkpoint.hf import HFCheckpoint  # noqa: E402
from kdtree_jax.checkpoint.tokenizer import KimiTokenizer  # noqa: E402
from kdtree_jax.checkpoint.weights import load_model  # noqa: E402
from kdtree_jax.model.config import ModelConfig  # noqa: E402
from kdtree_jax.model.drafter import DFlashDrafter, train_logits  # noqa: E402
from kdtree_jax.model.drafter_config import DrafterConfig, default_target_layer_ids  # noqa: E402
from kdtree_jax.model.target import LatentCache, forward_prefill  # noqa: E402

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DATA_MODES = ("corpus", "regen", "mix")
DEFAULT_GAMMA = {8: 4.0, 16: 7.0}  # DFlash paper: gamma 7 for L = 16, 4 for L = 8
GAMMA_PER_BLOCK = 7.0 / 16  # other block sizes: scale gamma with L
CORPUS_ANCHOR_LO = 1  # corpus windows: a block needs at least one context feature before its anchor


@dataclasses.dataclass(frozen=True)
class DrafterTrainConfig:
    # architecture (hidden / vocab / tapped layers follow the target)
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    block_size: int = 16
    mask_token_id: int = 4094  # [UNK]: a reserved row of the target's embedding
    target_layer_ids: str = dataclasses.field(default="", metadata={"help": "comma list; empty = z-lab formula"})
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # loss
    gamma: float = dataclasses.field(default=0.0, metadata={"help": "CE decay; 0 = 7 for L=16, 4 for L=8"})
    distill_weight: float = 0.5
    n_anchors: int = dataclasses.field(default=0, metadata={"help": "blocks per sequence; 0 = seq_len // L"})
    # data
    data: str = dataclasses.field(default="mix", metadata={"choices": DATA_MODES})
    seq_len: int = 256
    regen_prompt_len: int = 64
    regen_sequences: int = 16384
    regen_batch: int = 512
    # optimisation
    steps: int = 12000
    batch_size: int = 64
    lr: float = 2e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    compute_dtype: str = dataclasses.field(default="float32", metadata={"choices": tuple(DTYPES)})
    target_dtype: str = dataclasses.field(default="float32", metadata={"choices": tuple(DTYPES)})
    seed: int = 0
    max_train_seconds: float = dataclasses.field(default=400.0, metadata={"help": "safety stop (recorded)"})
    # logging / eval
    log_every: int = 50
    eval_sequences: int = 128
    eval_anchor_stride: int = 2
    eval_batch: int = 16
    # paths
    target: str = "checkpoints/kdtree-mini/target"
    corpus: str = "data/corpus"
    out: str = "checkpoints/kdtree-mini/drafter"
    log_dir: str = "out/train_drafter"
    tiny: bool = dataclasses.field(default=False, metadata={"help": "toy drafter + batch for CPU tests"})


TINY = dict(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=128, block_size=8,
            seq_len=64, regen_prompt_len=16, regen_sequences=16, regen_batch=16, steps=20, batch_size=8,
            lr=3e-3, warmup_steps=2, log_every=5, eval_sequences=4, eval_batch=4, eval_anchor_stride=4, tiny=True)


def gamma_for(c: DrafterTrainConfig) -> float:
    return c.gamma or DEFAULT_GAMMA.get(c.block_size, GAMMA_PER_BLOCK * c.block_size)


def drafter_config(c: DrafterTrainConfig, target: ModelConfig) -> DrafterConfig:
    if c.target_layer_ids:
        ids = tuple(int(x) for x in c.target_layer_ids.split(","))
    else:
        ids = default_target_layer_ids(target.num_hidden_layers, c.num_layers)
    bad = [i for i in ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise ValueError(f"target_layer_ids {list(ids)} fall outside the target's layers "
                         f"0..{target.num_hidden_layers - 1} (the default formula needs more target layers; "
                         "pass --target-layer-ids)")
    return DrafterConfig(
        hidden_size=target.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        vocab_size=target.vocab_size, target_layer_ids=ids, mask_token_id=c.mask_token_id, block_size=c.block_size,
        num_target_layers=target.num_hidden_layers, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=target.max_position_embeddings,
    )


def n_anchors_for(c: DrafterTrainConfig) -> int:
    return c.n_anchors or max(1, c.seq_len // c.block_size)


def check_config(c: DrafterTrainConfig, target: ModelConfig) -> None:
    if c.seq_len > target.max_position_embeddings:
        raise ValueError(f"--seq-len {c.seq_len} exceeds the target's max_position_embeddings "
                         f"{target.max_position_embeddings}")
    if c.data != "corpus" and not 1 <= c.regen_prompt_len <= c.seq_len - c.block_size:
        raise ValueError(f"--regen-prompt-len {c.regen_prompt_len} must leave a block: 1..seq_len - block_size")
    lo = CORPUS_ANCHOR_LO if c.data == "corpus" else c.regen_prompt_len - 1
    if c.seq_len - c.block_size - lo + 1 < n_anchors_for(c):
        raise ValueError(f"--n-anchors {n_anchors_for(c)} does not fit the anchor range [{lo}, "
                         f"{c.seq_len - c.block_size}]")
    if c.data == "mix" and c.batch_size % 2:
        raise ValueError(f"--data mix splits the batch in halves; --batch-size {c.batch_size} is odd")


class DrafterBatches:
    """Batches (tokens [B, T], anchor lower bound [B]) from corpus windows, the regen pool, or half of each."""

    def __init__(self, mode: str, corpus: T.PackedBatches | None, regen: np.ndarray | None, lo_regen: int,
                 batch: int, seed: int):
        self.mode, self.corpus, self.regen, self.lo_regen, self.batch = mode, corpus, regen, lo_regen, batch
        self.rng = np.random.default_rng(seed)
        self._order, self._pos = np.zeros(0, np.int64), 0

    def _regen(self, n: int) -> np.ndarray:
        if self._pos + n > len(self._order):
            self._order, self._pos = self.rng.permutation(len(self.regen)), 0
        idx = self._order[self._pos: self._pos + n]
        self._pos += n
        return self.regen[idx]

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        if self.mode == "corpus":
            return self.corpus.next(), np.full(self.batch, CORPUS_ANCHOR_LO)
        if self.mode == "regen":
            return self._regen(self.batch), np.full(self.batch, self.lo_regen)
        half = self.batch // 2
        toks = np.concatenate([self.corpus.next()[:half], self._regen(self.batch - half)])
        return toks, np.concatenate([np.full(half, CORPUS_ANCHOR_LO), np.full(self.batch - half, self.lo_regen)])


def make_step(dgraph, tgraph, tx: optax.GradientTransformation, weights: np.ndarray, distill_weight: float,
              taps: tuple[int, ...], block_size: int):
    """jitted (dstate, opt_state, tstate, tokens [B, T], anchors [B, n]) -> (dstate, opt_state, metrics)."""
    w = jnp.asarray(weights)

    def loss_fn(dstate, tstate, tokens, anchors):
        target = nnx.merge(tgraph, tstate)
        cache = LatentCache.zeros(target.cfg, tokens.shape[0], tokens.shape[1], target.cache_dtype)
        out = forward_prefill(target, tokens, 0, cache, taps=taps)  # frozen: only dstate is differentiated
        hidden, t_logits = jax.lax.stop_gradient(out.hidden), jax.lax.stop_gradient(out.logits)
        logits = train_logits(nnx.merge(dgraph, dstate), hidden, tokens, anchors, target.embed_table(),
                              target.lm_head_table())  # [B, n, L-1, V]
        labels = T.block_labels(tokens, anchors, block_size)
        block_t = T.block_target_logits(t_logits, anchors, block_size) if distill_weight > 0 else None
        return T.dflash_loss(logits, labels, w, block_t, distill_weight)

    @jax.jit
    def step(dstate, opt_state, tstate, tokens, anchors):
        (loss, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(dstate, tstate, tokens, anchors)
        updates, opt_state = tx.update(grads, opt_state, dstate)
        dstate = optax.apply_updates(dstate, updates)
        return dstate, opt_state, {**m, "loss": loss, "grad_norm": T.global_norm(grads)}

    return step


def regen_pool(target, train_tokens: np.ndarray, c: DrafterTrainConfig, n: int, seed: int) -> np.ndarray:
    """n sequences [n, seq_len]: random corpus prompts of regen_prompt_len + the target's greedy continuation."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(train_tokens) - c.regen_prompt_len, size=n)
    prompts = train_tokens[starts[:, None] + np.arange(c.regen_prompt_len)]
    return T.greedy_continue(target, prompts, c.seq_len - c.regen_prompt_len, min(c.regen_batch, n))


def run(c: DrafterTrainConfig) -> dict:
    """Train, evaluate and save; returns {"drafter", "target", "config", "metrics", "paths"}."""
    t_start = time.perf_counter()
    with HFCheckpoint.open(c.target) as ckpt:
        target = load_model(ckpt, param_dtype=jnp.float32, dtype=DTYPES[c.target_dtype], moe_impl="dense")
    tcfg = target.cfg
    dcfg = drafter_config(c, tcfg)
    check_config(c, tcfg)
    dcfg.check_compatible(tcfg)
    tokenizer = KimiTokenizer.from_dir(c.target)
    corpus = T.corpus_info(c.corpus)
    train_tokens = T.load_tokens(os.path.join(c.corpus, "train.txt"), tokenizer, c.target)
    held_tokens = T.load_tokens(os.path.join(c.corpus, "heldout.txt"), tokenizer, c.target)
    L, n_anchors, gamma = c.block_size, n_anchors_for(c), gamma_for(c)
    print(f"drafter: {dcfg.num_hidden_layers} layers, L={L}, taps {list(dcfg.target_layer_ids)}, gamma {gamma}, "
          f"{n_anchors} anchors/seq, data {c.data}; {T.device_summary()}")

    t0 = time.perf_counter()
    regen = None
    if c.data != "corpus":
        regen = regen_pool(target, train_tokens, c, c.regen_sequences, c.seed)
    regen_s = time.perf_counter() - t0
    if regen is not None:
        new = c.regen_sequences * (c.seq_len - c.regen_prompt_len)
        print(f"regen: {c.regen_sequences} greedy continuations ({new:,} tokens) in {regen_s:.1f}s "
              f"({new / max(regen_s, 1e-9):,.0f} tok/s incl. compile)")
    corpus_batches = T.PackedBatches(train_tokens, c.seq_len, c.batch_size, c.seed) if c.data != "regen" else None
    batches = DrafterBatches(c.data, corpus_batches, regen, c.regen_prompt_len - 1, c.batch_size, c.seed + 1)
    anchor_rng = np.random.default_rng(c.seed + 2)

    drafter = DFlashDrafter(dcfg, rngs=nnx.Rngs(c.seed), param_dtype=jnp.float32,
                            compute_dtype=DTYPES[c.compute_dtype])
    dgraph, dstate = nnx.split(drafter)
    tgraph, tstate = nnx.split(target)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(dstate))
    oc = T.OptimConfig(lr=c.lr, warmup_steps=c.warmup_steps, total_steps=c.steps, weight_decay=c.weight_decay,
                       grad_clip=c.grad_clip, min_lr_ratio=c.min_lr_ratio)
    tx = T.make_optimizer(oc, dstate)
    opt_state = tx.init(dstate)
    weights = T.dflash_position_weights(L, gamma)
    step_fn = make_step(dgraph, tgraph, tx, weights, c.distill_weight, tuple(dcfg.target_layer_ids), L)
    print(f"drafter: {n_params:,} params ({2 * n_params / 2**20:.1f} MiB bf16); {c.steps} steps x {c.batch_size} "
          f"seqs x {n_anchors} blocks")

    log = T.CurveLog(c.log_dir, "drafter")
    compile_s, t_loop, steps_done, stopped_early = 0.0, None, 0, False
    for step in range(1, c.steps + 1):
        t0 = time.perf_counter()
        tokens, lo = batches.next()
        anchors = T.sample_anchors(anchor_rng, lo, c.seq_len - L, n_anchors)
        dstate, opt_state, m = step_fn(dstate, opt_state, tstate, jnp.asarray(tokens), jnp.asarray(anchors))
        steps_done = step
        if step == 1:
            jax.block_until_ready(m["loss"])
            compile_s, t_loop = time.perf_counter() - t0, time.perf_counter()
        if step % c.log_every == 0 or step == c.steps:
            m = jax.device_get(m)
            elapsed = time.perf_counter() - t_loop
            bps = c.batch_size * n_anchors * (step - 1) / elapsed if step > 1 and elapsed > 0 else float("nan")
            extra = {"kl": m["kl"]} if "kl" in m else {}
            rec = log.add(step, loss=m["loss"], ce=m["ce"], grad_norm=m["grad_norm"], acc_per_pos=m["acc_per_pos"],
                          blocks_per_s=bps, **extra)
            acc = np.asarray(m["acc_per_pos"])
            print(f"step {step:5d}  loss {rec['loss']:.4f}  ce {rec['ce']:.4f}"
                  + (f"  kl {rec['kl']:.4f}" if "kl" in rec else "")
                  + f"  acc@1 {acc[0]:.3f} acc@{L - 1} {acc[-1]:.3f}  {bps:,.0f} blocks/s", flush=True)
        if time.perf_counter() - t_start > c.max_train_seconds:
            stopped_early = True
            print(f"stopping at step {step}: --max-train-seconds {c.max_train_seconds} reached")
            break
    jax.block_until_ready(dstate)
    train_s = time.perf_counter() - t_loop if t_loop else 0.0

    trained = nnx.merge(dgraph, dstate)
    bf16 = {k: v.astype(T.BF16) for k, v in hf_tensors(trained).items()}
    save_drafter(drafter_from_hf_tensors(dcfg, bf16, jnp.bfloat16), dcfg, c.out)
    saved = drafter_from_hf_tensors(dcfg, bf16, jnp.float32, compute_dtype=DTYPES[c.compute_dtype])

    rng = np.random.default_rng(c.seed + 3)
    held_prompts = held_tokens[rng.integers(0, len(held_tokens) - c.regen_prompt_len, c.eval_sequences)[:, None]
                               + np.arange(c.regen_prompt_len)]
    held_seqs = T.greedy_continue(target, held_prompts, c.seq_len - c.regen_prompt_len, c.eval_batch)
    agree = T.drafter_agreement(target, saved, held_seqs, c.regen_prompt_len - 1, c.eval_anchor_stride,
                                c.eval_batch)
    size = os.path.getsize(os.path.join(c.out, "model.safetensors"))
    metrics = {
        "config": dataclasses.asdict(c),
        "drafter_config": dcfg.to_hf_dict(),
        "gamma": gamma,
        "n_anchors": n_anchors,
        "params": n_params,
        "safetensors_bytes": size,
        "corpus": corpus,
        "regen_s": regen_s,
        "steps_done": steps_done,
        "stopped_early": stopped_early,
        "final_loss": log.records[-1]["loss"] if log.records else None,
        "final_train_acc_per_pos": log.records[-1]["acc_per_pos"] if log.records else None,
        "heldout_greedy_agreement": agree,
        "blocks_per_s": c.batch_size * n_anchors * (steps_done - 1) / train_s if steps_done > 1 and train_s else None,
        "compile_s": compile_s,
        "train_s": train_s,
        "wall_s": time.perf_counter() - t_start,
        "device": T.device_summary(),
    }
    paths = log.save(("loss", "ce", "kl"))
    metrics.update(paths)
    metrics_path = os.path.join(c.log_dir, "drafter_metrics.json")
    T.write_json(metrics_path, metrics)
    acc = agree["acc_per_pos"]
    print(f"held-out greedy agreement: acc@1 {acc[0]:.3f}, acc@{L - 1} {acc[-1]:.3f}, chain tau "
          f"{agree['chain_tau_mean']:.2f}; wrote {c.out} ({size / 2**20:.1f} MiB) and {metrics_path}")
    return {"drafter": trained, "saved": saved, "target": target, "config": dcfg, "metrics": metrics,
            "paths": {"out": c.out, "metrics": metrics_path, **paths}}


def parse(argv: list[str] | None = None) -> DrafterTrainConfig:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    T.add_config_args(ap, DrafterTrainConfig)
    args = ap.parse_args(argv)
    base = dataclasses.replace(DrafterTrainConfig(), **TINY) if args.tiny else DrafterTrainConfig()
    return T.config_from_args(DrafterTrainConfig, args, base)


def main(argv: list[str] | None = None) -> int:
    run(parse(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
