"""Regenerate tests/data/transformers_5.17: config.json files written by transformers' own save_pretrained.

    python3 tests/data/transformers_5.17/make_configs.py   # needs torch + transformers (the GPU machine has 5.17)

Each folder holds the config.json that `DeepseekV3ForCausalLM(DeepseekV3Config(...)).save_pretrained` writes for a
tiny DeepSeek-V3 (the model's weights are not kept): YaRN, plain RoPE, and YaRN with the extra keys a Kimi K2
config carries (passed through as kwargs, saved in bf16). expected.json records what that transformers computes
from each config (rotary inv_freq, cos/sin attention_scaling, softmax scaling), which tests/test_config.py checks
our parse against without torch.
"""
import json
import os
import shutil
import tempfile

import torch
import transformers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
            norm_topk_prob=True, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
YARN = dict(rope_theta=50000.0, rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                                              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                              "mscale_all_dim": 1.0})
KIMI_KEYS = dict(moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", num_nextn_predict_layers=0,
                 aux_loss_alpha=0.001, seq_aux=True, model_type="kimi_k2", torch_dtype="bfloat16")
CONFIGS = {  # folder: (DeepseekV3Config kwargs, save in bf16)
    "deepseek_v3_yarn": (YARN, False),
    "deepseek_v3_plain": (dict(rope_theta=20000.0), False),
    "deepseek_v3_kimi_keys": (dict(YARN, **KIMI_KEYS), True),
}


def main() -> None:
    expected = {"_what": f"transformers {transformers.__version__} (torch {torch.__version__}) values for each "
                         "config here: DeepseekV3RotaryEmbedding inv_freq and attention_scaling, DeepseekV3Attention "
                         "scaling (written by make_configs.py)"}
    for name, (kwargs, bf16) in CONFIGS.items():
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**BASE, **kwargs))
        if bf16:
            model = model.to(torch.bfloat16)
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            os.makedirs(os.path.join(HERE, name), exist_ok=True)
            shutil.copy(os.path.join(tmp, "config.json"), os.path.join(HERE, name, "config.json"))
        if not bf16:  # a bf16 model's rotary buffer is rounded to bf16
            rotary = model.model.rotary_emb
            expected[name] = {"inv_freq": rotary.inv_freq.tolist(), "attention_scaling": rotary.attention_scaling,
                              "softmax_scale": model.model.layers[0].self_attn.scaling}
    with open(os.path.join(HERE, "expected.json"), "w") as f:
        json.dump(expected, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
