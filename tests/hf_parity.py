"""Shared pieces of the transformers parity suites (test_models_llama, test_models_families).

Tolerance: float32 matmuls over dims <= 64 accumulate ~1e-6 relative error; 1e-4 on logits
leaves room for the different summation orders of torch and XLA without hiding a wrong mask
or RoPE.
"""

import numpy as np

VOCAB = 96
TOL = 1e-4


def padded_batch(seq=11, batch=3, seed=0):
    """``(ids, mask)`` int64 numpy ``(batch, seq)``: row 1 left-padded by 3, row 2
    right-padded by 4, pads set to id 0."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, (batch, seq))
    mask = np.ones((batch, seq), np.int64)
    mask[1, :3] = 0  # left padding
    mask[2, -4:] = 0  # right padding
    ids[mask == 0] = 0
    return ids, mask


def random_hf_model(config, task, *, seed=0, std=0.2):
    """An eager-attention transformers model of ``config`` for ``task`` ("causal_lm" or
    "sequence_classification") with every weight drawn from N(0, std): beyond HF's tiny
    init, so every weight matters."""
    import torch
    import transformers

    auto = {
        "causal_lm": transformers.AutoModelForCausalLM,
        "sequence_classification": transformers.AutoModelForSequenceClassification,
    }[task]
    torch.manual_seed(seed)
    model = auto.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    return model.eval()


def assert_close_on_real_tokens(edl_logits, hf_logits, mask):
    """``max |edl - hf| <= TOL`` over the positions ``mask`` marks real."""
    real = mask.astype(bool)
    diff = np.abs(np.asarray(edl_logits, np.float32) - np.asarray(hf_logits))[real]
    assert diff.max() <= TOL, f"max |edl - hf| = {diff.max():.2e} on real tokens"
