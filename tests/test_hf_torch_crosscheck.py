"""Cross-check the float64 reference against transformers' DeepseekV3ForCausalLM (fp32, CPU) on a synthetic model.

Runs only where torch + transformers are installed (marker `torch`; the GPU machine has them). The HF model is
built from our config dict and loaded from the synthetic checkpoint's effective weights (bf16 values, exact in
fp32). Written defensively for transformers 4.5x-5.x; each version hazard is handled where it arises:
- rope config keys: 4.x reads `rope_scaling` ("type" or "rope_type") + `rope_theta`; 5.x reads `rope_parameters`
  (with `rope_theta` inside). We pass both forms, then assert the model's actual inv_freq / attention scale equal
  the reference's, so a silently ignored key fails loudly instead of as a logits mismatch.
- 4.5x computes the YaRN factor as max_position_embeddings / original_max_position_embeddings when the latter is
  present, so the config sets max_position_embeddings = factor * original.
- `rope_interleave` (4.5x+, default True) selects the DeepSeek pair layout; set explicitly.
- routed experts: ModuleList of per-expert Linears (4.x) or fused `experts.gate_up_proj` [E, 2I, d] and
  `experts.down_proj` [E, d, I] (5.x). The state dict is filled by key and shape; moe_intermediate_size is chosen
  so 2I != d, which keeps the fused orientation unambiguous.
- hidden_states[-1] is post-final-norm in HF, so only layers 0..L-2 are compared as hidden states.
Two configs: `tiny` (q_lora, n_group 4 / topk_group 2, one dense layer, mscale == mscale_all_dim) and `direct_q`
(q_lora_rank None -> q_proj, n_group 2 / topk_group 1, no dense layer, mscale != mscale_all_dim so the cos/sin
amplitude is not 1). Both route with sigmoid: HF's DeepseekV3 has no softmax routing.
"""
import inspect

import numpy as np
import pytest

from kdtree_jax.config import RopeScaling, tiny
from kdtree_jax.hf_checkpoint import HFCheckpoint
from kdtree_jax.reference import reference_forward, reference_weights, softmax_scale, yarn_inv_freq
from kdtree_jax.synthetic import write_synthetic_checkpoint

REL_TOL = 1e-4
T = 12
# moe_intermediate_size 48: 2I = 96 != hidden 64, so the fused-expert orientation is unambiguous
CONFIGS = {
    "tiny": tiny(moe_intermediate_size=48),
    "direct_q": tiny(moe_intermediate_size=48, q_lora_rank=None, n_group=2, topk_group=1, first_k_dense_replace=0,
                     rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=256, beta_fast=16.0,
                                              beta_slow=2.0, mscale=0.8, mscale_all_dim=1.2)),
}


def _amplitude(cfg) -> float:
    """cos/sin multiplier mscale(factor, mscale) / mscale(factor, mscale_all_dim) (HF's yarn attention_factor)."""
    rs = cfg.rope_scaling
    m = [0.1 * v * np.log(rs.factor) + 1.0 if rs.factor > 1 else 1.0 for v in (rs.mscale, rs.mscale_all_dim)]
    return m[0] / m[1]


def _hf_config(cfg):
    from transformers import DeepseekV3Config

    d = cfg.to_hf_dict(wrapped=False)
    for key in ("quantization_config", "model_type", "torch_dtype"):  # bf16 weights go in as fp32; class sets type
        d.pop(key, None)
    d.update(architectures=["DeepseekV3ForCausalLM"], rope_interleave=True, head_dim=cfg.qk_rope_head_dim,
             pretraining_tp=1, use_cache=False, attn_implementation="eager")
    rs = dict(d["rope_scaling"])
    rs.update(rope_type="yarn", rope_theta=cfg.rope_theta)  # 5.x takes rope_scaling as rope_parameters
    d["rope_scaling"] = rs
    d["max_position_embeddings"] = int(rs["factor"] * rs["original_max_position_embeddings"])
    if "rope_parameters" in inspect.signature(DeepseekV3Config.__init__).parameters:
        d["rope_parameters"] = dict(rs)
    hf = DeepseekV3Config(**d)
    hf._attn_implementation = "eager"  # fp32 eager softmax: no fused-kernel differences
    return hf


def _fill_state_dict(model, cfg, weights):
    """Our canonical float64 weights -> the model's own state-dict layout (per-expert or fused experts)."""
    import torch

    ours = {("lm_head.weight" if n == "lm_head.weight" else "model." + n): w for n, w in weights.items()}
    used, sd = set(), {}
    d, inter, n_exp = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    for key, param in model.state_dict().items():
        if key.endswith("inv_freq"):
            sd[key] = param
            continue
        if key in ours:
            value = ours[key]
            used.add(key)
        elif key.endswith("mlp.experts.gate_up_proj") or key.endswith("mlp.experts.down_proj"):
            base = key[: -len("gate_up_proj" if key.endswith("gate_up_proj") else "down_proj")]
            if key.endswith("gate_up_proj"):
                names = [(f"{base}{e}.gate_proj.weight", f"{base}{e}.up_proj.weight") for e in range(n_exp)]
                value = np.stack([np.concatenate([ours[g], ours[u]], axis=0) for g, u in names])  # [E, 2I, d]
                used.update(n for pair in names for n in pair)
                if tuple(param.shape) == (n_exp, d, 2 * inter):
                    value = value.transpose(0, 2, 1)
            else:
                names = [f"{base}{e}.down_proj.weight" for e in range(n_exp)]
                value = np.stack([ours[n] for n in names])  # [E, d, I]
                used.update(names)
                if tuple(param.shape) == (n_exp, inter, d):
                    value = value.transpose(0, 2, 1)
        else:
            raise AssertionError(f"transformers parameter {key} {tuple(param.shape)} has no source weight")
        assert tuple(param.shape) == value.shape, f"{key}: model {tuple(param.shape)} vs ours {value.shape}"
        sd[key] = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32))
    unused = sorted(set(ours) - used)
    assert not unused, f"weights the transformers model did not take: {unused[:5]}"
    model.load_state_dict(sd, strict=True)


def test_configs_differ_where_intended():  # runs without torch too: guards the second config's purpose
    a, b = CONFIGS["tiny"], CONFIGS["direct_q"]
    assert a.q_lora_rank and b.q_lora_rank is None
    assert (a.n_group, a.topk_group, a.first_k_dense_replace) == (4, 2, 1)
    assert (b.n_group, b.topk_group, b.first_k_dense_replace) == (2, 1, 0)
    assert _amplitude(a) == 1.0 and abs(_amplitude(b) - 1.0) > 0.02
    assert a.scoring_func == b.scoring_func == "sigmoid"


@pytest.mark.torch
@pytest.mark.parametrize("name", list(CONFIGS))
def test_reference_matches_transformers(tmp_path, rng, name):
    import torch
    from transformers import DeepseekV3ForCausalLM
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    if "interleave" not in inspect.getsource(modeling_deepseek_v3):
        pytest.skip("this transformers' DeepseekV3 has no interleaved (DeepSeek) rope layout")
    write_synthetic_checkpoint(tmp_path, CONFIGS[name], fmt="bf16", seed=int(rng.integers(0, 2**31)))
    ck = HFCheckpoint.open(tmp_path)
    cfg = ck.config
    assert cfg.q_lora_rank == CONFIGS[name].q_lora_rank and cfg.rope_scaling == CONFIGS[name].rope_scaling
    weights = reference_weights(ck)

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(_hf_config(cfg)).to(torch.float32).eval()
    _fill_state_dict(model, cfg, weights)

    inv_freq = model.model.rotary_emb.inv_freq.double().numpy()
    np.testing.assert_allclose(inv_freq, yarn_inv_freq(cfg), rtol=1e-6,
                               err_msg="transformers built different YaRN frequencies: rope config keys ignored?")
    assert float(getattr(model.model.rotary_emb, "attention_scaling", 1.0)) == pytest.approx(_amplitude(cfg), rel=1e-6)
    scaling = getattr(model.model.layers[0].self_attn, "scaling", None)
    if scaling is not None:
        assert scaling == pytest.approx(softmax_scale(cfg), rel=1e-6), "attention softmax scale differs"

    tokens = rng.integers(0, cfg.vocab_size, size=T)
    with torch.no_grad():
        out = model(torch.from_numpy(tokens)[None], output_hidden_states=True, use_cache=False)
    logits = out.logits[0].double().numpy()
    ref_logits, ref_hidden = reference_forward(cfg, weights, tokens, return_hidden=True)
    err = np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()
    assert err < REL_TOL, f"logits relative error {err:.2e}"
    assert len(out.hidden_states) == cfg.num_hidden_layers + 1  # [embeddings, layer 0, ..., final (normed)]
    for layer in range(cfg.num_hidden_layers - 1):
        hs = out.hidden_states[layer + 1][0].double().numpy()
        err = np.abs(hs - ref_hidden[layer]).max() / np.abs(ref_hidden[layer]).max()
        assert err < REL_TOL, f"layer {layer} hidden relative error {err:.2e}"
