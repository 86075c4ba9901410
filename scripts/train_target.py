"""Train the kdtree-mini target: a small model of the exact Kimi K2 / DeepSeek-V3 architecture (MLA with q_lora,
dense first layer, MoE with shared expert and sigmoid router whose e_score_correction_bias follows the
aux-loss-free rule, YaRN rope) on packed windows of the stdlib corpus, then write it as an HF Kimi checkpoint.

    python scripts/build_corpus.py                      # once: data/corpus/{train,heldout}.txt
    python scripts/train_target.py                      # the real run (one H200: a couple of minutes)
    python scripts/train_target.py --tiny --steps 20    # CPU smoke run

Outputs: --out (HF dir: config.json, model.safetensors bf16, tokenizer files; written atomically) and --log-dir
(target_curve.json / .png, target_metrics.json with held-out loss vs an add-one unigram baseline).
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
from kdtree_jax.checkpoint.tokenizer import KimiTokenizer  # noqa: E402
from kdtree_jax.model.config import ModelConfig, RopeScaling  # noqa: E402

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DETERMINISTIC_FLAG = "--xla_gpu_deterministic_ops=true"


@dataclasses.dataclass(frozen=True)
class TargetTrainConfig:
    # architecture (vocab comes from the tokenizer)
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    q_lora_rank: int = 128
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    dense_intermediate: int = 768
    first_dense_layers: int = 1
    n_experts: int = 8
    experts_per_token: int = 2
    moe_intermediate: int = 96
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    rope_theta: float = 10000.0
    yarn_factor: float = 4.0
    yarn_original_max_position: int = 256
    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-6
    # optimisation
    seq_len: int = 512
    batch_size: int = 32
    steps: int = 2000
    lr: float = 2e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bias_update_rate: float = 1e-3
    compute_dtype: str = dataclasses.field(default="float32", metadata={"choices": tuple(DTYPES)})
    seed: int = 0
    deterministic: bool = dataclasses.field(default=True, metadata={"help": "deterministic XLA GPU ops"})
    max_train_seconds: float = dataclasses.field(default=240.0, metadata={"help": "safety stop (recorded)"})
    # logging / eval
    log_every: int = 50
    eval_every: int = 500
    eval_windows: int = 256
    eval_batch: int = 32
    # paths
    corpus: str = "data/corpus"
    tokenizer: str = "checkpoints/kdtree-mini/tokenizer"
    out: str = "checkpoints/kdtree-mini/target"
    log_dir: str = "out/train_target"
    tiny: bool = dataclasses.field(default=False, metadata={"help": "toy model + batch for CPU tests"})


TINY = dict(hidden_size=64, num_layers=2, num_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, dense_intermediate=128, n_experts=4, moe_intermediate=32,
            yarn_original_max_position=32, max_position_embeddings=256, seq_len=64, batch_size=8, steps=20,
            lr=3e-3, warmup_steps=2, log_every=5, eval_every=0, eval_windows=8, eval_batch=8, tiny=True)


def model_config(c: TargetTrainConfig, tokenizer: KimiTokenizer) -> ModelConfig:
    return ModelConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
        intermediate_size=c.dense_intermediate, moe_intermediate_size=c.moe_intermediate,
        n_routed_experts=c.n_experts, num_experts_per_tok=c.experts_per_token, n_shared_experts=c.n_shared_experts,
        first_k_dense_replace=c.first_dense_layers, n_group=1, topk_group=1, topk_method="noaux_tc",
        scoring_func="sigmoid", routed_scaling_factor=c.routed_scaling_factor, norm_topk_prob=True,
        rope_theta=c.rope_theta,
        rope_scaling=RopeScaling(factor=c.yarn_factor, original_max_position_embeddings=c.yarn_original_max_position,
                                 beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        bos_token_id=tokenizer.bos_id, eos_token_id=(tokenizer.eos_id,) if tokenizer.eos_id is not None else (),
    )


def check_config(c: TargetTrainConfig) -> None:
    if c.seq_len + 1 > c.max_position_embeddings:
        raise ValueError(f"--seq-len {c.seq_len} exceeds --max-position-embeddings {c.max_position_embeddings}")
    if c.first_dense_layers < 1 or c.first_dense_layers >= c.num_layers:
        raise ValueError(f"--first-dense-layers must be in 1..num_layers-1, got {c.first_dense_layers}")
    for name in ("steps", "batch_size", "seq_len", "log_every"):
        if getattr(c, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(c, name)}")


def make_step(graphdef, tx: optax.GradientTransformation, cfg: ModelConfig, bias_rate: float):
    """jitted (state, opt_state, batch [B, T+1]) -> (state, opt_state, metrics)."""

    def loss_fn(state, batch):
        out = T.target_forward(nnx.merge(graphdef, state), batch[:, :-1])
        return T.token_nll(out.logits, batch[:, 1:]).mean(), out.loads

    @jax.jit
    def step(state, opt_state, batch):
        (loss, loads), grads = jax.value_and_grad(loss_fn, has_aux=True)(state, batch)
        updates, opt_state = tx.update(grads, opt_state, state)
        state = optax.apply_updates(state, updates)
        state = T.apply_bias_updates(state, loads, cfg, bias_rate)
        imbalance = (loads.max(-1) / jnp.maximum(loads.mean(-1), 1.0)).mean()
        return state, opt_state, {"loss": loss, "grad_norm": T.global_norm(grads), "imbalance": imbalance}

    return step


def run(c: TargetTrainConfig) -> dict:
    """Train, evaluate and save; returns {"model", "metrics", "paths"}."""
    check_config(c)
    if c.deterministic and DETERMINISTIC_FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + DETERMINISTIC_FLAG).strip()
    t_start = time.perf_counter()
    tokenizer = KimiTokenizer.from_dir(c.tokenizer)
    corpus = T.corpus_info(c.corpus)
    train_tokens = T.load_tokens(os.path.join(c.corpus, "train.txt"), tokenizer, c.tokenizer)
    held_tokens = T.load_tokens(os.path.join(c.corpus, "heldout.txt"), tokenizer, c.tokenizer)
    cfg = model_config(c, tokenizer)
    print(f"corpus: {len(train_tokens):,} train / {len(held_tokens):,} held-out tokens "
          f"(Python {corpus['python_version']}, manifest {corpus['manifest_sha256'][:12]}); {T.device_summary()}")

    model = T.init_target(cfg, c.seed, dtype=DTYPES[c.compute_dtype])
    graphdef, state = nnx.split(model)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    oc = T.OptimConfig(lr=c.lr, warmup_steps=c.warmup_steps, total_steps=c.steps, weight_decay=c.weight_decay,
                       grad_clip=c.grad_clip, min_lr_ratio=c.min_lr_ratio)
    tx = T.make_optimizer(oc, state)
    opt_state = tx.init(state)
    step_fn = make_step(graphdef, tx, cfg, c.bias_update_rate)
    batches = T.PackedBatches(train_tokens, c.seq_len + 1, c.batch_size, c.seed)
    windows = T.eval_windows(held_tokens, c.seq_len + 1, c.eval_windows)
    print(f"target: {n_params:,} params ({2 * n_params / 2**20:.1f} MiB bf16); {c.steps} steps x {c.batch_size} x "
          f"{c.seq_len} tokens")

    log = T.CurveLog(c.log_dir, "target")
    tokens_per_step = c.batch_size * c.seq_len
    compile_s, t_loop, steps_done, stopped_early = 0.0, None, 0, False
    for step in range(1, c.steps + 1):
        t0 = time.perf_counter()
        state, opt_state, m = step_fn(state, opt_state, jnp.asarray(batches.next()))
        steps_done = step
        if step == 1:
            jax.block_until_ready(m["loss"])
            compile_s, t_loop = time.perf_counter() - t0, time.perf_counter()
        if step % c.log_every == 0 or step == c.steps:
            m = jax.device_get(m)
            elapsed = time.perf_counter() - t_loop
            tps = tokens_per_step * (step - 1) / elapsed if step > 1 and elapsed > 0 else float("nan")
            rec = log.add(step, loss=m["loss"], grad_norm=m["grad_norm"], imbalance=m["imbalance"],
                          tokens_per_s=tps, epochs=batches.epochs_seen)
            if c.eval_every and step % c.eval_every == 0 and step != c.steps:
                rec["heldout_loss"] = T.heldout_nll(nnx.merge(graphdef, state), windows, c.eval_batch)
            print(f"step {step:5d}  loss {rec['loss']:.4f}  gnorm {rec['grad_norm']:.2f}  load max/mean "
                  f"{rec['imbalance']:.2f}  {tps:,.0f} tok/s  epoch {rec['epochs']:.2f}"
                  + (f"  held-out {rec['heldout_loss']:.4f}" if "heldout_loss" in rec else ""), flush=True)
        if time.perf_counter() - t_start > c.max_train_seconds:
            stopped_early = True
            print(f"stopping at step {step}: --max-train-seconds {c.max_train_seconds} reached")
            break
    jax.block_until_ready(state)
    train_s = time.perf_counter() - t_loop if t_loop else 0.0

    model = nnx.merge(graphdef, state)
    exported = T.round_params_bf16(model)  # evaluate what the bf16 checkpoint holds
    held = T.heldout_nll(exported, windows, c.eval_batch)
    uni_lp = T.unigram_log_probs(train_tokens, cfg.vocab_size)
    uni = T.unigram_nll(uni_lp, windows)
    size = T.save_target_hf(model, c.out, c.tokenizer)
    bias = {f"layer{i}": np.asarray(model.layers[i].mlp.bias[...]).round(4).tolist() for i in T.moe_layers(cfg)}
    metrics = {
        "config": dataclasses.asdict(c),
        "model_config": cfg.to_hf_dict(),
        "params": n_params,
        "safetensors_bytes": size,
        "corpus": corpus,
        "train_tokens": int(len(train_tokens)),
        "heldout_tokens_scored": int(windows.shape[0] * (windows.shape[1] - 1)),
        "steps_done": steps_done,
        "stopped_early": stopped_early,
        "epochs_seen": batches.epochs_seen,
        "final_train_loss": log.records[-1]["loss"] if log.records else None,
        "heldout_loss": held,
        "heldout_ppl": T.perplexity(held),
        "unigram_loss": uni,
        "unigram_ppl": T.perplexity(uni),
        "tokens_per_s": tokens_per_step * (steps_done - 1) / train_s if steps_done > 1 and train_s > 0 else None,
        "compile_s": compile_s,
        "train_s": train_s,
        "wall_s": time.perf_counter() - t_start,
        "router_bias": bias,
        "device": T.device_summary(),
    }
    paths = log.save(("loss", "heldout_loss"))
    metrics.update(paths)
    metrics_path = os.path.join(c.log_dir, "target_metrics.json")
    T.write_json(metrics_path, metrics)
    print(f"held-out loss {held:.4f} (ppl {metrics['heldout_ppl']:.1f}) vs unigram {uni:.4f} (ppl "
          f"{metrics['unigram_ppl']:.1f}); wrote {c.out} ({size / 2**20:.1f} MiB) and {metrics_path}")
    return {"model": model, "metrics": metrics, "paths": {"out": c.out, "metrics": metrics_path, **paths}}


def parse(argv: list[str] | None = None) -> TargetTrainConfig:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    T.add_config_args(ap, TargetTrainConfig)
    args = ap.parse_args(argv)
    base = dataclasses.replace(TargetTrainConfig(), **TINY) if args.tiny else TargetTrainConfig()
    return T.config_from_args(TargetTrainConfig, args, base)


def main(argv: list[str] | None = None) -> int:
    run(parse(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
