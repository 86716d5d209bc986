"""A small character-level Llama trained on the Python standard library's own source files.

    python examples/llama.py --tiny                                   # every rank in-process (simulator)
    python -m simulator -n 8 examples/llama.py --tiny --mesh dp=2,cp=2,tp=2
    python -m simulator --reference examples/llama.py --tiny --mesh cp=2   # one big device
    mpiexec -n 4 python examples/llama.py --tiny --mesh tp=2,pp=2 --sequence-parallel
    python examples/llama.py --tiny --load-hf weights.safetensors --mesh tp=2 --steps 0

The model is ``mpipar/models/llama.py`` (RMSNorm, rotary positions, grouped-query attention,
SwiGLU, untied output layer) laid out like ``gpt.py``'s GPT: dp x cp x tp per pipeline stage,
pp stages. cp splits the sequence (context parallel: keys and values gathered in attention, the
sequence held in zigzag order so causal work is even). ``--load-hf`` starts from weights in the
Hugging Face Llama safetensors layout (a file or a directory of shards) on any mesh. Flags,
checkpoints (``--save-every/--save-dir/--resume``) and output are ``gpt.py``'s.
"""

from __future__ import annotations

from common import (
    add_attention_arg,
    add_training_args,
    check_layout,
    check_training_args,
    default_mesh,
    header,
    parallel_options,
    parse_mesh,
    parser,
    run_size,
    setup,
    train_language_model,
)

from mpipar.models.llama import Llama, LlamaParallel, llama_config, llama_loss, load_hf_llama


def main() -> None:
    p = parser(__doc__.splitlines()[0], steps=200)
    add_training_args(p, "Llama")
    add_attention_arg(p, "fused")
    p.add_argument(
        "--load-hf",
        default=None,
        metavar="PATH",
        help="initial weights in the Hugging Face Llama safetensors layout (a file or a directory of shards)",
    )
    shape = p.add_argument_group("model shape (override --tiny's or the default model's; e.g. to fill a GPU)")
    shape.add_argument("--hidden", type=int, default=None, help="hidden size")
    shape.add_argument("--ffn-hidden", type=int, default=None, help="SwiGLU's inner width")
    shape.add_argument("--heads", type=int, default=None, help="attention heads")
    shape.add_argument("--kv-heads", type=int, default=None, help="key/value heads (grouped-query attention)")
    shape.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    args = p.parse_args()
    check_training_args(args, "Llama")
    setup(args, seed=args.seed)
    args.mesh = args.mesh or default_mesh()
    degrees = parse_mesh(args.mesh)
    chunks = args.chunks if args.schedule == "Interleaved1F1B" else 1
    layers, batch, chars, lr = run_size(args, degrees, chunks)
    size = "tiny" if args.tiny else "small"
    overrides = {
        "hidden_size": args.hidden,
        "intermediate_size": args.ffn_hidden,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": args.seq_len,
    }
    try:
        cfg = llama_config(
            size,
            num_hidden_layers=layers,
            dtype=args.dtype,
            attention=args.attention,
            **{k: v for k, v in overrides.items() if v is not None},
        )
    except ValueError as exc:
        raise SystemExit(f"llama.py: {exc}") from None
    dp, tp, pp, cp = degrees["dp"], degrees["tp"], degrees["pp"], degrees["cp"]
    check_layout(args, degrees, cfg.num_hidden_layers, batch, chunks)
    block = cfg.max_position_embeddings
    if block % (2 * cp):
        raise SystemExit(f"--mesh cp={cp}: the sequence of {block} tokens must divide into 2 x cp = {2 * cp} chunks")
    par = LlamaParallel.from_degrees(dp, tp, pp, **parallel_options(args, cp, chunks))
    model = Llama(cfg, par)
    if args.load_hf:
        try:
            load_hf_llama(model, args.load_hf)
        except ValueError as exc:
            raise SystemExit(f"--load-hf: {exc}") from None
    train_language_model(
        args,
        model,
        par,
        llama_loss,
        block=block,
        batch=batch,
        chars=chars,
        lr=lr,
        describe=lambda n: header(
            "Llama", model.num_parameters(), args.mesh, dp * tp * pp * cp, batch, args.accumulate_steps, block, n
        ),
    )


if __name__ == "__main__":
    main()
