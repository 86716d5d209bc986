"""Published GPT training configurations the strategy search is checked against.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21, arXiv:2104.04473), Table 1: GPT models with sequence length 2048 and
vocabulary 51,200 trained on DGX A100 nodes (8 x A100 80GB, NVLink; HDR InfiniBand between
nodes) -- our ``a100-nvlink-ib`` preset. Each row: parameters (billions, as published),
attention heads, hidden size, layers, tensor-parallel size, pipeline-parallel size, GPUs, batch
size (sequences per step). The data-parallel size is GPUs / (tp * pp).
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.step_trace import GPTShape, GPTStrategy

SEQ = 2048
VOCAB = 51200


@dataclass(frozen=True)
class PublishedRun:
    billions: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def shape(self, micro_batch_size: int = 1) -> GPTShape:
        return GPTShape(self.layers, self.hidden, self.heads, SEQ, VOCAB, micro_batch_size)

    def strategy(self) -> GPTStrategy:
        """The published layout as ``estimate`` prices it: micro-batch 1, sequence parallel and
        selective recompute (Korthikanti et al. 2022's recipe for these models), interleaved
        1F1B with 2 chunks where the layers divide (else 1F1B), no ZeRO, mixed precision."""
        chunks = 2 if self.pp > 1 and self.layers % (2 * self.pp) == 0 else 1
        schedule = "Interleaved1F1B" if chunks > 1 else "1F1B"
        return GPTStrategy(
            self.dp,
            self.tp,
            self.pp,
            self.tp > 1,
            "selective",
            0,
            True,
            "adamw",
            self.batch // self.dp,
            schedule,
            chunks,
        )


NARAYANAN_2021_TABLE_1 = (
    PublishedRun(1.7, 24, 2304, 24, 1, 1, 32, 512),
    PublishedRun(3.6, 32, 3072, 30, 2, 1, 64, 512),
    PublishedRun(7.5, 32, 4096, 36, 4, 1, 128, 512),
    PublishedRun(18.4, 48, 6144, 40, 8, 1, 256, 1024),
    PublishedRun(39.1, 64, 8192, 48, 8, 2, 512, 1536),
    PublishedRun(76.1, 80, 10240, 60, 8, 4, 1024, 1792),
    PublishedRun(145.6, 96, 12288, 80, 8, 8, 1536, 2304),
    PublishedRun(310.1, 128, 16384, 96, 8, 16, 1920, 2160),
    PublishedRun(529.6, 128, 20480, 105, 8, 35, 2520, 2520),
    PublishedRun(1008.0, 160, 25600, 128, 8, 64, 3072, 3072),
)
