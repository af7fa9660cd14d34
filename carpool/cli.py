"""`carpool generate`, `carpool chat`, `carpool bench hybrid`."""

from __future__ import annotations

import argparse
import logging
import sys

from carpool.config import EngineConfig, parse_memory


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (named as in vllm serve)")
    g.add_argument("--model", default=None,
                   help="HF model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per iteration")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", type=parse_memory, default=None,
                   help="bytes for the KV cache, e.g. 2GiB (default: min(4GiB, free RAM/4) on CPU)")
    g.add_argument("--scheduler", default="sarathi")
    g.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    g.add_argument("--seed", type=int, default=0)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                        scheduler=args.scheduler, num_threads=args.num_threads, seed=args.seed)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])


def sampling_params(args: argparse.Namespace):
    from carpool.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.sampling_seed, stop=args.stop)


def stream(engine, prompt_ids: list[int], sp, out=sys.stdout) -> str:
    """Generate one answer, printing text as it arrives."""
    request = engine.add_request(prompt_ids, sp)
    text = ""
    while not request.is_finished:
        for o in engine.step():
            if o.request_id == request.request_id:
                out.write(o.new_text)
                out.flush()
                text += o.new_text
                if o.error:
                    out.write(f"\n[error: {o.error}]")
    out.write("\n")
    return text


def cmd_generate(args) -> int:
    from carpool.engine import LLMEngine

    sp = sampling_params(args)  # bad values fail before the model loads
    engine = LLMEngine(engine_config(args))
    for prompt in args.prompts:
        if args.raw:
            ids = engine.tokenizer.encode(prompt)
        else:
            ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                       add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        stream(engine, ids, sp)
    return 0


def cmd_chat(args) -> int:
    from carpool.engine import LLMEngine

    sp = sampling_params(args)
    engine = LLMEngine(engine_config(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("carpool chat: type a message, /reset to start over, Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        try:
            answer = stream(engine, ids, sp)
        except ValueError as e:  # e.g. the conversation outgrew the context
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": answer})


def cmd_serve(args) -> int:
    from carpool.server.api_server import run_server

    if args.model_tag:
        args.model = args.model_tag
    return run_server(args)


def cmd_bench_hybrid(args) -> int:
    from carpool.bench.hybrid import run_hybrid_bench

    run_hybrid_bench(engine_config(args), args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="carpool", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="answer prompts with the model (streams to stdout)")
    p.add_argument("prompts", nargs="+")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive streaming chat")
    p.add_argument("--system", default=None, help="system prompt")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (like `vllm serve`)")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model")
    add_engine_args(p)
    from carpool.server import add_server_args

    add_server_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench", required=True)
    h = bench.add_parser("hybrid", help="iteration time of prefill-only, decode-only and hybrid batches "
                                        "(Sarathi Table 2)")
    h.add_argument("--chunks", default="128,256,512")
    h.add_argument("--decodes", default="1,4,16,32")
    h.add_argument("--context", type=int, default=512)
    h.add_argument("--repeats", type=int, default=5)
    h.add_argument("--output", default="bench_results/hybrid")
    h.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    add_engine_args(h)
    h.set_defaults(func=cmd_bench_hybrid)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("carpool").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"carpool: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
