"""A tiny Llama with seeded random weights, for output checks that can fail.

`--load-format dummy` weights give nearly the same tokens for every prompt, so a
disaggregated run could match its reference by accident. A 2-layer, 256-token-vocab
Llama with random weights (~1 MB of safetensors, written with numpy: no torch or
transformers import) gives prompt-dependent tokens. No tokenizer: prompts are token
ids. Written once per config into the cache directory.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np

from harness.config import write_model_dir

SEED = 1234
INIT_STD = 0.2  # larger than Llama's 0.02 so greedy tokens depend strongly on the prompt


def llama_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of a Llama checkpoint (Hugging Face layout)."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h),
                                          "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter),
                   p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    return shapes


def random_checkpoint(cache: Path, num_layers: int = 2) -> Path:
    """Directory with config.json + model.safetensors; reused when already written."""
    from safetensors.numpy import save_file

    staging = write_model_dir(cache / "config-only", num_layers)
    config = json.loads((staging / "config.json").read_text())
    digest = hashlib.sha1(json.dumps([config, SEED, INIT_STD], sort_keys=True).encode()).hexdigest()[:10]
    path = cache / f"tiny-llama-random-{digest}"
    if (path / "model.safetensors").exists():
        return path
    rng = np.random.default_rng(SEED)
    tensors = {name: (np.ones(shape) if len(shape) == 1 else rng.normal(0, INIT_STD, shape))
               .astype(np.float32) for name, shape in llama_shapes(config).items()}
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(path)
    return path
