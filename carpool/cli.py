"""`carpool generate`, `carpool chat`, `carpool bench hybrid`."""

from __future__ import annotations

import argparse
import logging
import sys

from carpool.args import add_engine_args, engine_config_from_args as engine_config


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
    from carpool.args import apply_vllm_engine_flags
    from carpool.server.launch import run_server
    from carpool.server.options import ServerOptions

    if args.model_tag:
        args.model = args.model_tag
    return run_server(apply_vllm_engine_flags(args, engine_config(args)), ServerOptions.from_args(args))


def cmd_export_tokenizer(args) -> int:
    """The model's tokenizer (a GGUF's rebuilt from its metadata) as a Hugging Face folder."""
    from carpool.config import default_model_path
    from carpool.model.loader import load_model_config, resolve_model_path
    from carpool.tokenizer import load_tokenizer
    from carpool.tokenizer_export import save_tokenizer

    if len(args.paths) > 2:
        raise ValueError("export-tokenizer takes [MODEL] FOLDER")
    *model, folder = args.paths
    model = resolve_model_path(model[0] if model else (args.model or default_model_path()))
    context = load_model_config(model).max_position_embeddings
    save_tokenizer(load_tokenizer(model), folder, model_max_length=context)
    print(f"carpool: wrote {model!r}'s tokenizer to {folder} (load it with AutoTokenizer.from_pretrained)",
          file=sys.stderr)
    return 0


def cmd_bench_pipeline(args) -> int:
    from carpool.bench.pipeline import run_pipeline_bench

    run_pipeline_bench(engine_config(args), args)
    return 0


def cmd_bench_soak(args) -> int:
    from carpool.bench.soak import run_soak

    return 0 if run_soak(args).passed else 1


def cmd_bench_hybrid(args) -> int:
    from carpool.bench.hybrid import run_hybrid_bench

    run_hybrid_bench(engine_config(args), args)
    return 0


def cmd_bench_quant(args) -> int:
    from carpool.bench.quant import run_quant_bench

    run_quant_bench(engine_config(args), args)
    return 0


def cmd_bench_startup(args) -> int:
    from carpool.bench.startup import run_startup_bench

    run_startup_bench(args)
    return 0


def cmd_bench_structured(args) -> int:
    from carpool.bench.structured import run_structured_bench

    run_structured_bench(engine_config(args), args)
    return 0


def cmd_bench_spec(args) -> int:
    from carpool.bench.spec import run_spec_bench

    run_spec_bench(engine_config(args), args)
    return 0


def cmd_simulate(args) -> int:
    from carpool.sim.run import run_simulate

    run_simulate(args)
    return 0


def cmd_fidelity(args) -> int:
    from carpool.sim.fidelity import run_fidelity

    run_fidelity(engine_config(args), args)
    return 0


def cmd_profile(args) -> int:
    from carpool.sim.profile import run_profile

    run_profile(engine_config(args), args)
    return 0


def _bench_engine_config(args):
    """In-process engine settings, or None when --base-url points at a server."""
    return None if getattr(args, "base_url", None) else engine_config(args)


def _guarded(run, args, config) -> int:
    """Run a serving benchmark; a host too busy to measure on is an error, not a traceback."""
    from carpool.bench.serving import HostContendedError

    try:
        run(args, config)
    except HostContendedError as e:
        print(f"carpool: error: {e}", file=sys.stderr)
        return 3
    return 0


def cmd_bench_serving(args) -> int:
    from carpool.bench.serving import run_serving

    return _guarded(run_serving, args, _bench_engine_config(args))


def cmd_bench_burst(args) -> int:
    from carpool.bench.serving import run_burst

    return _guarded(run_burst, args, _bench_engine_config(args))


def cmd_bench_ablation(args) -> int:
    from carpool.bench.serving import run_ablation

    return _guarded(run_ablation, args, _bench_engine_config(args))


def cmd_bench_budget_sweep(args) -> int:
    from carpool.bench.serving import run_budget_sweep

    return _guarded(run_budget_sweep, args, engine_config(args))


def cmd_capacity(args) -> int:
    from carpool.bench.serving import run_capacity

    return _guarded(run_capacity, args, _bench_engine_config(args))


def _add_capacity_args(p: argparse.ArgumentParser) -> None:
    from carpool.harness.options import positive_float, positive_int

    g = p.add_argument_group("capacity search (defaults: the full preset; --quick: the quick one, see BENCHMARKS.md)")
    g.add_argument("--quick", action="store_true", help="short runs: 30 s per rate, <= 6 rates, 15%% resolution")
    g.add_argument("--duration", type=positive_float, default=None,
                   help="seconds of arrivals per rate (requests = max(--min-requests, QPS x duration))")
    g.add_argument("--min-requests", type=positive_int, default=None)
    g.add_argument("--max-evals", type=positive_int, default=None, help="rates tried per search")
    g.add_argument("--resolution", type=positive_float, default=None,
                   help="stop when (fail - pass) / fail <= this (relative)")
    g.add_argument("--start-qps", type=positive_float, default=1.0)
    g.add_argument("--min-qps", type=positive_float, default=0.05)
    g.add_argument("--max-qps", type=positive_float, default=64.0)
    g.add_argument("--scheduling-delay", type=positive_float, default=2.0,
                   help="bound on P50 scheduling delay, seconds (Sarathi-Serve: 2)")
    g.add_argument("--reference-decode-time", type=positive_float, default=None,
                   help="seconds; default: measured (one request alone, median decode iteration)")


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
    p.add_argument("--config", metavar="FILE", help="a YAML file of flags (`max_num_seqs: 8`), as vLLM's; "
                                                    "the command line's own flags win")
    add_engine_args(p)
    from carpool.server.options import add_server_args

    add_server_args(p)
    from carpool.args import add_vllm_engine_flags

    add_vllm_engine_flags(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("export-tokenizer", help="write the model's tokenizer (a GGUF's too) as a Hugging Face "
                                                "folder that transformers' AutoTokenizer loads")
    p.add_argument("paths", nargs="+", metavar="[MODEL] FOLDER",
                   help="the model (default: --model, else the embedded one), then the folder to write")
    p.add_argument("--model", default=None, help="the model, as with other commands")
    p.set_defaults(func=cmd_export_tokenizer)

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

    k = bench.add_parser("soak", help="minutes of mixed valid, malformed, disconnecting, slow and bursty clients "
                                      "against a `carpool serve` process: no 5xx, nothing leaked, outputs intact")
    k.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    k.add_argument("--clients", type=int, default=8, help="concurrent clients")
    k.add_argument("--max-waiting-requests", type=int, default=8, help="the server's limit (bursts exceed it)")
    k.add_argument("--model", default=None)
    k.add_argument("--dtype", default="float32", help="float32 (default) keeps greedy outputs batch-invariant")
    k.add_argument("--max-num-batched-tokens", type=int, default=256)
    k.add_argument("--kv-cache-memory", default="512MiB",
                   help="small, so that the cache is soon all touched and later RSS growth means a leak")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--output", default="bench_results/soak")
    k.set_defaults(func=cmd_bench_soak)

    from carpool.harness import options as opts

    q = bench.add_parser("quant", help="int8/int4 weight-only kernels vs oneDNN bf16 per weight shape and "
                                       "token count; single-stream decode per --quantization mode")
    q.add_argument("--tokens", type=opts.int_list, default=[1, 2, 4, 16, 64, 256, 512])
    q.add_argument("--rounds", type=opts.positive_int, default=3, help="best of this many passes per point")
    q.add_argument("--kernels", type=opts.str_list, default=None,
                   help="the kernels to time beside bf16 F.linear, e.g. 'int4 C,Q4_K C' (default: all; torch's "
                        "int8/int4 take minutes a shape where the CPU lacks AVX-512)")
    q.add_argument("--modes", type=opts.str_list, default=["none", "int8", "int4"],
                   help="--quantization modes whose single-stream decode is timed")
    q.add_argument("--new-tokens", type=int, default=64, help="decode length per mode (0: skip)")
    q.add_argument("--output", default="bench_results/quant")
    add_engine_args(q)
    q.set_defaults(func=cmd_bench_quant)

    su = bench.add_parser("startup", help="seconds from `carpool serve` to its first answer, by phase "
                                          "(the server's log lines timestamped as they arrive)")
    su.add_argument("--model", default=None)
    su.add_argument("--timeout", type=float, default=600.0)
    su.add_argument("--output", default="bench_results/startup")
    su.add_argument("serve_args", nargs="*", help="more `carpool serve` flags, after --")
    su.set_defaults(func=cmd_bench_startup)

    st = bench.add_parser("structured", help="structured outputs: every output of 53 JSON schemas validates; "
                                             "decode step time, all rows constrained vs none")
    st.add_argument("--batch", type=opts.positive_int, default=16, help="requests decoding together")
    st.add_argument("--rounds", type=opts.positive_int, default=8, help="rounds per mode, alternating")
    st.add_argument("--decode-tokens", type=opts.positive_int, default=24, help="max tokens per timed request")
    st.add_argument("--max-tokens", type=opts.positive_int, default=200, help="max tokens per validity request")
    st.add_argument("--output", default="bench_results/structured")
    add_engine_args(st)
    st.set_defaults(func=cmd_bench_structured)

    sp = bench.add_parser("spec", help="speculative decoding on vs off in one process: code editing, random "
                                       "prompts, a burst of edits, a draft model (tokens/s, acceptance)")
    sp.add_argument("--workloads", type=opts.str_list, default=["editing", "random", "burst", "draft"],
                    help="comma list of editing, random, burst, repeat, draft")
    sp.add_argument("--method", choices=["ngram", "suffix"], default="ngram",
                    help="the proposer of the editing, random, burst and repeat workloads")
    sp.add_argument("--num-speculative-tokens", type=opts.positive_int, default=5)
    sp.add_argument("--prompt-lookup-max", type=opts.positive_int, default=4)
    sp.add_argument("--repeats", type=opts.positive_int, default=3, help="runs per workload and mode, alternating")
    sp.add_argument("--num-functions", type=opts.positive_int, default=8, help="editing prompts (8 functions)")
    sp.add_argument("--max-tokens", type=opts.positive_int, default=None,
                    help="cap on an editing answer (default: its function's tokens + 32)")
    sp.add_argument("--num-random", type=opts.positive_int, default=4, help="random prompts")
    sp.add_argument("--random-tokens", type=opts.positive_int, default=128, help="output tokens per random prompt")
    sp.add_argument("--random-repetition-penalty", type=opts.positive_float, default=1.3,
                    help="of the random prompts' answers (1: plain greedy, which loops on them)")
    sp.add_argument("--burst-size", type=opts.positive_int, default=16, help="editing requests at once")
    sp.add_argument("--draft-cost-ratio", type=opts.positive_float, default=0.1,
                    help="a draft model's step cost / the target's, for the projection")
    sp.add_argument("--workload-seed", type=int, default=0, help="of the random prompts")
    sp.add_argument("--output", default="bench_results/spec")
    add_engine_args(sp)
    sp.set_defaults(func=cmd_bench_spec)

    def serving_like(name: str, help: str, output: str, workload: dict, func, qps_default) -> argparse.ArgumentParser:
        s = bench.add_parser(name, help=help)
        s.add_argument("--schedulers", type=opts.scheduler_list, default=None,
                       help="comma list of NAME[:BUDGET] to compare in process (default: --scheduler)")
        s.add_argument("--qps", type=opts.float_list, default=qps_default, help="request rate(s), comma list")
        s.add_argument("--timeline-requests", type=opts.positive_int, default=40, help="requests drawn in timeline.png")
        opts.add_workload_args(s, **workload)
        opts.add_driver_args(s)
        opts.add_output_args(s, output)
        add_engine_args(s)
        s.set_defaults(func=func)
        return s

    serving_like("serving", "replay a workload (in process or against --base-url); latency/throughput metrics",
                 "bench_results/serving", {}, cmd_bench_serving, None)
    b = serving_like("burst", "16 requests at once (prompts 64..1024, outputs 64..256): tok/s, TBT, largest gap",
                     "bench_results/burst", opts.BURST, cmd_bench_burst, None)
    b.add_argument("--reference-tps", type=opts.positive_float, default=44.0,
                   help="output tok/s to compare against (llama.cpp server on this machine: ~44)")
    b.add_argument("--max-gap", type=opts.positive_float, default=0.5, help="seconds; the gap goal")
    serving_like("ablation", "hybrid-only vs chunked-only vs sarathi at one QPS (Sarathi-Serve Table 4)",
                 "bench_results/ablation", opts.LONG_PROMPT, cmd_bench_ablation, [1.0])

    s = bench.add_parser("budget-sweep", help="token budgets: chunked-prefill overhead, TBT P99, capacity")
    s.add_argument("--budgets", type=opts.int_list, default=[128, 256, 512, 1024, 2048])
    s.add_argument("--sweep-scheduler", default="sarathi")
    s.add_argument("--qps", type=opts.float_list, default=[1.0], help="rate(s) of the serving runs")
    s.add_argument("--overhead-prompt-len", type=opts.positive_int, default=2048,
                   help="prompt whose prefill time is compared chunked vs in one iteration")
    s.add_argument("--overhead-repeats", type=opts.positive_int, default=3)
    s.add_argument("--capacity-slo", type=opts.str_list, default=None,
                   help="also search capacity per budget under these SLOs (comma list, e.g. strict,relaxed)")
    opts.add_workload_args(s, **opts.LONG_PROMPT)
    opts.add_output_args(s, "bench_results/budget_sweep")
    _add_capacity_args(s)
    add_engine_args(s)
    s.set_defaults(func=cmd_bench_budget_sweep, base_url=None)

    p = sub.add_parser("capacity", help="highest QPS meeting P99 TBT and P50 scheduling-delay SLOs, per scheduler")
    p.add_argument("--schedulers", type=opts.scheduler_list, default=opts.scheduler_list("sarathi,vllm"),
                   help="comma list of NAME[:BUDGET][@SLO] (default: sarathi,vllm)")
    p.add_argument("--slo", type=opts.str_list, default=["strict", "relaxed"],
                   help="comma list: strict (5x reference decode), relaxed (25x), <k>x, <seconds>, <n>ms")
    opts.add_workload_args(p, **opts.LONG_PROMPT)
    opts.add_driver_args(p)
    opts.add_output_args(p, "bench_results/capacity")
    _add_capacity_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_capacity)

    s = bench.add_parser("pipeline", help="pipeline bubbles (idle stage time) per scheduler with "
                                          "--pipeline-parallel-size > 1 (Sarathi section 5.3)")
    s.add_argument("--schedulers", type=opts.str_list, default=["sarathi", "vllm", "orca"],
                   help="comma list of policies, each replaying the same workload")
    s.add_argument("--qps", type=opts.positive_float, default=1.0, help="request rate (Poisson arrivals)")
    s.add_argument("--workload-seed", type=int, default=0)
    s.add_argument("--max-other-cpu", type=float, default=0.3,
                   help="wait for a quiet host, and run again if other processes used more CPU cores "
                        "than this during a run (a negative value disables the check)")
    s.add_argument("--retries", type=int, default=2)
    s.add_argument("--output", default="bench_results/pipeline")
    opts.add_workload_args(s, lengths="uniform", num_requests=64, prompt_range=(64, 1024), output_range=(16, 128))
    add_engine_args(s)
    s.set_defaults(func=cmd_bench_pipeline)

    p = sub.add_parser("simulate", help="replay a workload over a simulated deployment (the real schedulers, "
                                        "a profiled cost model)")
    from carpool.sim.run import add_simulate_args

    add_simulate_args(p)
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("fidelity", help="simulator vs the real engine on the same workload (this machine)")
    from carpool.harness.options import add_workload_args, positive_float, positive_int, scheduler_list

    p.add_argument("--profile", default="bench_results/profile.json", help="from `carpool profile`")
    p.add_argument("--schedulers", type=scheduler_list, default=scheduler_list("sarathi,vllm"))
    p.add_argument("--qps", type=positive_float, default=1.0)
    p.add_argument("--output", default="bench_results/fidelity")
    p.add_argument("--real-runs", type=positive_int, default=1,
                   help="serve the workload this many times per scheduler: each run after the first is compared "
                        "with it as the simulations are (how far the engine's own latencies move between runs)")
    add_workload_args(p, lengths="uniform", num_requests=40, prompt_range=(64, 1024), output_range=(16, 128))
    add_engine_args(p)
    p.set_defaults(func=cmd_fidelity)

    p = sub.add_parser("profile", help="time the engine's steps on this machine, for the simulator's cost model")
    p.add_argument("--output", default="bench_results/profile.json")
    p.add_argument("--repeats", type=positive_int, default=3, help="passes over the designed workloads")
    p.add_argument("--quick", action="store_true", help="every other workload")
    p.add_argument("--compare", default=None, help="another profile of this machine: print how far the two agree")
    add_engine_args(p)
    p.set_defaults(func=cmd_profile)
    return parser


def _dashed(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


def vllm_argv(argv: list[str]) -> list[str]:
    """`vllm serve`'s spellings: --max_num_seqs is --max-num-seqs, and `--config FILE` (YAML)
    stands for the flags it lists, placed before the command line's own so that those win."""
    argv = [_dashed(a) for a in argv]
    if not argv or argv[0] != "serve":
        return argv
    for i, a in enumerate(argv):
        if a == "--config" or a.startswith("--config="):
            path = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            rest = argv[:i] + argv[i + (1 if "=" in a else 2):]
            at = 2 if len(rest) > 1 and not rest[1].startswith("-") else 1  # after `serve MODEL`
            return rest[:at] + config_file_argv(path) + rest[at:]
    return argv


def config_file_argv(path: str) -> list[str]:
    """The flags a vLLM YAML config file sets: `key: value`, a list as several values, true as the
    bare switch, false as its --no- form."""
    import yaml

    try:
        with open(path) as f:
            config = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"carpool: error: --config {path}: {exc}") from None
    if not isinstance(config, dict):
        raise SystemExit(f"carpool: error: --config {path}: expected a mapping of flag names to values")
    argv = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + flag[2:])
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif isinstance(value, dict):
            import json

            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(vllm_argv(sys.argv[1:] if argv is None else list(argv)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
