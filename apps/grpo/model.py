"""A tiny Qwen2-style causal LM and its tokenizer, built locally (no download), with a short
supervised warm start on the task so that sampling produces well-formed answers.

    from apps.grpo.model import ensure_model
    path = ensure_model()          # ~/.cache/forge_obs_grpo/<hash>/, built on the first call only

The directory is a regular Hugging Face checkpoint (config.json, model.safetensors, tokenizer),
loadable by ``transformers`` and by vLLM. Digits are single tokens so arithmetic composes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from apps.grpo import task

ARCH = dict(vocab_size=None, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
WARM_START = dict(steps=60, batch=64, lr=3e-3, seed=0)
CACHE_ROOT = Path(os.environ.get("FORGE_OBS_GRPO_CACHE", Path.home() / ".cache" / "forge_obs_grpo"))
BUILD_VERSION = 3


def _key(warm_steps: int) -> str:
    blob = json.dumps([BUILD_VERSION, ARCH, dict(WARM_START, steps=warm_steps), task.MAX_OPERAND], sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(task.sft_corpus(2000, seed=7), trainers.BpeTrainer(
        vocab_size=64, special_tokens=["<|endoftext|>", "<|pad|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                 pad_token="<|pad|>")
    hf.save_pretrained(out)
    return hf


def new_model(tok):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(WARM_START["seed"])
    cfg = Qwen2Config(**dict(ARCH, vocab_size=len(tok)), tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, torch_dtype="float32")
    return Qwen2ForCausalLM(cfg)


def warm_start(model, tok, steps: int, log=print) -> None:
    """Supervised next-token training on ``a+b=c<eos>`` (loss on the answer tokens only)."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=WARM_START["lr"])
    lines = task.sft_corpus(steps * WARM_START["batch"], seed=WARM_START["seed"] + 1)
    model.train()
    for i in range(steps):
        chunk = lines[i * WARM_START["batch"]:(i + 1) * WARM_START["batch"]]
        prompts = [s.split("=")[0] + "=" for s in chunk]
        ids, mask, labels = [], [], []
        for p, s in zip(prompts, chunk):
            pi = tok(p)["input_ids"]
            full = tok(s)["input_ids"] + [tok.eos_token_id]
            ids.append(full)
            labels.append([-100] * len(pi) + full[len(pi):])
        n = max(map(len, ids))
        x = torch.tensor([r + [tok.pad_token_id] * (n - len(r)) for r in ids])
        y = torch.tensor([r + [-100] * (n - len(r)) for r in labels])
        m = torch.tensor([[1] * len(r) + [0] * (n - len(r)) for r in ids])
        loss = model(input_ids=x, attention_mask=m, labels=y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if log and (i % 50 == 0 or i == steps - 1):
            log(f"  warm start {i + 1}/{steps}: loss {loss.item():.3f}")
    model.eval()


def ensure_model(root: "str | Path | None" = None, warm_steps: int | None = None, log=print) -> Path:
    """Build (once) and return the checkpoint directory."""
    import torch

    steps = WARM_START["steps"] if warm_steps is None else warm_steps
    root = Path(root) if root else CACHE_ROOT
    out = root / _key(steps)
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    t0 = time.perf_counter()
    tmp = root / f".{out.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    nthreads = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    try:
        tok = build_tokenizer(tmp)
        model = new_model(tok)
        if log:
            log(f"building tiny Qwen2 ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params) in {out}")
        warm_start(model, tok, steps, log)
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / "build.json").write_text(json.dumps({"warm_steps": steps, "build_s": time.perf_counter() - t0}))
        try:
            os.replace(tmp, out)
        except OSError:  # built concurrently by another process
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        torch.set_num_threads(nthreads)
    return out
