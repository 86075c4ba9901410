"""dtype_agreement's float32 logits line up with the engine: greedy AR picks their argmax at every position."""
import os

import numpy as np
from script_loader import load_script

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PAIR = os.path.join(_REPO, "checkpoints", "kdtree-mini")


def test_next_token_logits_argmax_is_the_engines_greedy_token():
    mod = load_script("benchmarks/dtype_agreement.py")
    engine = mod.Engine.load(os.path.join(_PAIR, "target"), None, dtype="float32")
    prompts = mod.load_prompts(os.path.join(_PAIR, "heldout_prompts.jsonl"), engine.tokenizer, 3, 64)
    rng = np.random.default_rng()
    prompts = [p[int(rng.integers(0, 32)):] for p in prompts]  # fresh prompt lengths each run
    for prompt, tokens in zip(prompts, engine.generate(prompts, 8, mode="ar").token_ids):
        logits = mod.next_token_logits(engine.target, prompt, tokens)
        assert logits.shape[0] == len(tokens) + 1
        assert np.argmax(logits[:-1], axis=-1).tolist() == tokens
        assert np.all(mod.top2_margin(logits) >= 0)
