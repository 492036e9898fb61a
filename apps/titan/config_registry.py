"""TorchTitan ``--module apps.titan --config titan_debugmodel``: the llama3 debug model on CPU,
with this app's trainer, metrics processor and checkpointer (TorchTitan's extension points: each
is a subclass whose ``Config`` builds it), a local tokenizer and data set, fixed seed and
deterministic mode. Every field can still be overridden on the command line
(``--training.steps 4``, ``--parallelism.pipeline_parallel_degree 2``, ``--obs.fault_slow_rank 1``).

What differs from TorchTitan's own ``llama3_debugmodel``, for the CPU:

- attention: TorchTitan's maskless causal SDPA instead of FlexAttention (no backward on CPU);
- data parallel: DDP (``data_parallel_replicate_degree``), not FSDP: FSDP's reduce-scatter uses
  ``PREMUL_SUM``, which gloo lacks; ``spmd_backend="partial_dtensor"`` (with ``full_dtensor`` and
  DDP, TorchTitan 0.3.0 on torch 2.13 logs each step's loss summed over the data-parallel ranks:
  twice the loss at DP=2; the grad norm is the same in both);
- no activation checkpointing, sequences of 128 tokens, one per rank per step (a CPU budget).
"""

from __future__ import annotations

import os

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import model_registry

from apps.titan.run import ASSETS_ENV
from apps.titan.trainer import ObservedCheckpointManager, ObservedMetricsProcessor, ObservedTrainer

__all__ = ["titan_debugmodel", "ASSETS_ENV"]


def _use_sdpa(model_config) -> None:
    """Each layer's inner attention becomes TorchTitan's maskless causal SDPA: FlexAttention (the
    debug model's) has no backward on CPU."""
    for _, _, parent, attr in list(model_config.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())


def titan_debugmodel() -> ObservedTrainer.Config:
    assets = os.environ.get(ASSETS_ENV, "runs/titan-assets")
    model_spec = model_registry("debugmodel")
    _use_sdpa(model_spec.model)
    return ObservedTrainer.Config(
        hf_assets_path=os.path.join(assets, "tokenizer"),
        dump_folder="runs/titan",
        model_spec=model_spec,
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec))),
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                  min_lr_factor=0.0),
        training=TrainingConfig(local_batch_size=1, seq_len=128, steps=6, disable_cuda_graphs=True),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test",
                                                     dataset_path=os.path.join(assets, "data")),
        metrics=ObservedMetricsProcessor.Config(log_freq=1, enable_tensorboard=True, disable_color_printing=True),
        parallelism=ParallelismConfig(data_parallel_replicate_degree=2, data_parallel_shard_degree=1,
                                      pipeline_parallel_schedule="1F1B", spmd_backend="partial_dtensor"),
        checkpoint=ObservedCheckpointManager.Config(enable=True, interval=3, keep_latest_k=2,
                                                last_save_model_only=False),
        activation_checkpoint=None,
        debug=DebugConfig(seed=42, deterministic=True),
    )
