"""How many transformer layers each pipeline stage holds: ``stage_layer_counts``.

One rule for the runtime, the estimator and the search (``simulator.family`` re-exports it):
an even split where the layers divide; otherwise the stages that carry more than layers -- the
first (the embedding) and the last (the final norm, the output layer and the loss) -- are the
lighter ones.
"""

from __future__ import annotations


def stage_layer_counts(num_layers: int, pp: int, chunks: int = 1) -> list[int]:
    """Layers on each of the ``pp * chunks`` (virtual) stages, in stage order.

    An even split where the layers divide. Otherwise every stage gets ``num_layers // stages``
    and one more goes to each stage but the ones that carry something besides layers: the
    first stage (the embedding) and the last (the final norm, output layer and loss) are the
    ones left lighter, then the second and the second-to-last, and so on inward. That is how
    Llama 3 405B's 126 layers were laid over 16 stages ("The Llama 3 Herd of Models", section
    3.3.2: one layer fewer on the first and the last stage) and what Megatron-LM's
    ``--decoder-first/last-pipeline-num-layers`` express.

    The first and the last stage may hold no layer at all (``num_layers`` down to ``stages -
    2``): they still hold the embedding and the output layer. That is the paper's own layout
    with one layer per chunk (its first model chunk on the first stage holds only the embedding,
    its last model chunk on the last stage only the output projection and the loss): 126 layers over 16 ranks of 8 one-layer chunks, ``[0, 1 x 126, 0]``. A
    stage between them always holds at least one layer.
    """
    for name, value in (("num_layers", num_layers), ("pp", pp), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"stage_layer_counts: {name} must be a positive int, got {value!r}")
    stages = pp * chunks
    if num_layers < max(1, stages - 2):
        raise ValueError(
            f"stage_layer_counts: {num_layers} layers cannot fill {stages} stages (pp {pp} x chunks {chunks}): "
            "every stage but the first and the last needs one"
        )
    base, extra = divmod(num_layers, stages)
    if not extra:
        return [base] * stages
    counts = [base + 1] * stages
    lighter = stages - extra
    order = [i // 2 if i % 2 == 0 else stages - 1 - i // 2 for i in range(stages)]
    for s in order[:lighter]:
        counts[s] = base
    return counts


def stage_of_layers(num_layers: int, pp: int, chunks: int = 1) -> list[int]:
    """The (virtual) stage of each layer under ``stage_layer_counts``, in layer order."""
    out: list[int] = []
    for s, n in enumerate(stage_layer_counts(num_layers, pp, chunks)):
        out += [s] * n
    return out
