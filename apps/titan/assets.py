"""The tokenizer and the text data set the TorchTitan app trains on, built here (nothing downloaded).

``build(root)`` writes, once, under ``root``:

- ``tokenizer/``: a byte-level BPE (HuggingFace ``tokenizers``) trained on the corpus, saved as
  ``tokenizer.json`` + ``tokenizer_config.json`` (what TorchTitan's ``HuggingFaceTokenizer`` loads
  from ``hf_assets_path``); its vocabulary fits the llama3 debug model's 2048 embeddings;
- ``data/train.jsonl``: documents ``{"text": ...}`` that TorchTitan's ``c4_test`` loader
  (``datasets.load_dataset(path, split="train")``) reads from a local directory.

The corpus is generated from a fixed seed, so every build is byte-identical.

    >>> import tempfile
    >>> from apps.titan.assets import build
    >>> paths = build(tempfile.mkdtemp())
    >>> sorted(p.name for p in paths.tokenizer_dir.iterdir())
    ['tokenizer.json', 'tokenizer_config.json']
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["AssetPaths", "build", "BOS", "EOS", "VOCAB_SIZE"]

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
VOCAB_SIZE = 2048  # the llama3 debug model's embedding rows; the tokenizer stays within it
N_DOCS = 600

_SUBJECTS = ["the trainer", "a rank", "the pipeline", "each stage", "the optimizer", "a replica",
             "the scheduler", "every worker", "the model", "a gradient", "the controller", "the mesh"]
_VERBS = ["reduces", "shards", "gathers", "records", "flushes", "checkpoints", "loads", "sends",
          "waits for", "computes", "logs", "averages", "broadcasts", "splits", "restores"]
_OBJECTS = ["the loss", "its parameters", "a microbatch", "the grad norm", "the tokens", "one step",
            "the activations", "a span", "the metrics", "its shard", "the batch", "the weights"]
_TAILS = ["before the next step", "on every rank", "at the end of the step", "in order",
          "without waiting", "once per step", "across the data parallel group", "on the last stage"]


@dataclass(frozen=True, slots=True)
class AssetPaths:
    root: Path
    tokenizer_dir: Path  # hf_assets_path
    data_dir: Path  # dataloader.dataset_path


def _corpus(seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(N_DOCS):
        sentences = []
        for _ in range(rng.randint(4, 12)):
            s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
            sentences.append(s[0].upper() + s[1:] + f" ({rng.randint(0, 999)}).")
        docs.append(f"Document {i}. " + " ".join(sentences))
    return docs


def _train_tokenizer(docs: list[str], out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB_SIZE, tok.get_vocab_size()
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}, indent=1))


def build(root: "str | os.PathLike") -> AssetPaths:
    """Build the assets under ``root`` unless a complete build is already there (safe when several
    processes call it at once: each builds in a private folder and renames it into place)."""
    root = Path(root)
    paths = AssetPaths(root=root, tokenizer_dir=root / "tokenizer", data_dir=root / "data")
    if (root / "DONE").exists():
        return paths
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".titan-assets-", dir=root.parent))
    docs = _corpus()
    _train_tokenizer(docs, tmp / "tokenizer")
    (tmp / "data").mkdir()
    with open(tmp / "data" / "train.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    (tmp / "DONE").write_text("ok\n")
    try:
        os.rename(tmp, root)
    except OSError:  # another process finished first (root exists and is not empty)
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        if not (root / "DONE").exists():
            raise
    return paths
