"""The `loraplex` command line."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.engine_settings import EngineSettings
    from gateway.settings import ServeSettings


# Engine options `generate` has no flag for: its --seed is the sampling seed, and it streams nothing to space out.
GENERATE_SKIPS = frozenset({"seed", "stream_interval"})


def _generate(args: argparse.Namespace) -> None:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    model, demo_adapters = args.model, {}
    if model is None:
        from loraplex.demo import build_demo
        from loraplex.demo.behaviours import HELD_OUT_PROMPTS

        demo = build_demo()
        model, demo_adapters = str(demo.model), demo.adapters
        args.prompt = args.prompt or HELD_OUT_PROMPTS[:3]
    else:
        _check_model(model, "generate")
    lora = _lora_request(args.lora, demo_adapters) if args.lora else None
    llm = LLM(model=model, enable_lora=lora is not None, **_engine_settings(args).engine_options())
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    prompts = args.prompt or ["Hello, my name is", "The capital of France is"]
    chat = args.chat if args.chat is not None else llm.tokenizer.chat_template is not None
    if chat:
        conversations = [[{"role": "user", "content": p}] for p in prompts]
        outputs = llm.chat(conversations, params, use_tqdm=True, lora_request=lora)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=True, lora_request=lora)
    for prompt, out in zip(prompts, outputs):
        o = out.outputs[0]
        print(f"{prompt!r} -> {o.text!r}  [{len(o.token_ids)} tokens, {o.finish_reason}]")


def _lora_request(spec: str, known: dict):
    """NAME=PATH, vLLM's JSON form, or the name of a demo adapter."""
    from adapters.ref import LoRARequest, parse_lora_module

    if spec in known:
        return LoRARequest(spec, str(known[spec]))
    try:
        return LoRARequest(*parse_lora_module(spec, flag="--lora"))
    except ValueError as e:
        names = f" or a demo adapter ({', '.join(known)})" if known else ""
        raise SystemExit(f"{e}{names}") from None


def _bench_module(module: str):
    """The command of a benchmark that parses its own options: bench.<module>'s main, imported when it runs."""

    def run(args: argparse.Namespace) -> None:
        importlib.import_module(f"bench.{module}").main(args.bench_args)

    return run


def _take_demo(args: argparse.Namespace):
    """The embedded demo (built on first use) when the benchmark's arguments hold --demo, which is taken out; else
    None."""
    if "--demo" not in args.bench_args:
        return None
    from loraplex.demo import build_demo

    args.bench_args.remove("--demo")
    return build_demo()


def _bench_engine(args: argparse.Namespace) -> None:
    """`bench engine` (vs transformers) or, with --lora, the multi-LoRA run (vs peft) = `bench lora`."""
    if "--lora" in args.bench_args:
        args.bench_args.remove("--lora")
        return _bench_lora(args)
    _bench_module("engine")(args)


def _bench_lora(args: argparse.Namespace) -> None:
    if (demo := _take_demo(args)) is not None:  # the embedded demo's model and adapters
        args.bench_args += ["--model", str(demo.model), *(f"--lora={n}={p}" for n, p in demo.adapters.items())]
    _bench_module("lora")(args)


def _bench_peer(args: argparse.Namespace) -> None:
    # --demo: the demo's SmolLM2 (as an HF directory, which vLLM reads) and its adapters
    if (demo := _take_demo(args)) is not None:
        from loraplex.demo import hf_directory

        args.bench_args = [
            *("--model", str(hf_directory(demo))),
            *(f"--lora={n}={p}" for n, p in demo.adapters.items()),
            *("--num-prompts", "32", "--input-len", "32", "--output-len", "64"),
            *args.bench_args,  # later options win
        ]
    _bench_module("peer")(args)


def _bench_head(args: argparse.Namespace) -> None:
    if (demo := _take_demo(args)) is not None:  # the embedded demo's SmolLM2
        args.bench_args += ["--model", str(demo.model)]
    _bench_module("head")(args)


# loraplex bench <name>: (help, command); each benchmark parses its own options (`loraplex bench engine --help`)
BENCHES = {
    "engine": ("offline engine throughput vs transformers (--lora: multi-LoRA vs peft)", _bench_engine),
    "lora": ("offline multi-LoRA throughput vs transformers + peft", _bench_lora),
    "serve": ("online serving benchmark over HTTP (any OpenAI-compatible server)", _bench_module("serve")),
    "sweep": ("throughput vs number of adapters (registers random adapters)", _bench_module("sweep")),
    "fairness": ("two tenants at a 10:1 rate under fcfs and fair scheduling", _bench_module("fairness")),
    "peer": (
        "offline throughput vs vLLM-CPU in a venv you give (base and LoRA, optional busy neighbours)",
        _bench_peer,
    ),
    "latency": (
        "loraplex serve vs the offline engine on the same requests; TTFT/TPOT by concurrency",
        _bench_module("latency"),
    ),
    "replicas": (
        "engine replicas on Ray Serve: adapter-affinity routing vs round-robin under skewed adapter traffic",
        _bench_module("replicas"),
    ),
    "gpu": (
        "CUDA: Triton kernels' bandwidth (paged decode attention, shrink/expand) and the engine's LoRA / base",
        _bench_module("gpu"),
    ),
    "cpu-lora": (
        "CPU: the C++ LoRA kernels alone over a model's modules, by token count (ms, GFMA/s)",
        _bench_module("cpu_lora"),
    ),
    "cpu-linear": (
        "CPU: a model's body linears alone, kernels/linear's panels vs oneDNN, by row count (ms, GFLOP/s)",
        _bench_module("cpu_linear"),
    ),
    "head": (
        "CPU: the screened greedy head on and off in one engine, paired (time per token, same tokens)",
        _bench_head,
    ),
}


def _serve(args: argparse.Namespace) -> None:
    settings = _settings(args)
    if settings.replicas:  # engine replicas on Ray Serve; fails here, in one line, without Ray installed
        from gateway.cluster.launch import RayMissing, require_ray
        from gateway.cluster.launch import serve_on_ray as serve

        try:
            require_ray(settings)
        except RayMissing as e:
            raise SystemExit(f"loraplex serve: {e}") from None
    else:
        from gateway.server import serve

    if settings.model is not None:
        _check_model(settings.model, "serve")
    status = serve(with_demo(settings) if settings.model is None else settings)
    if status:
        raise SystemExit(status)


def _check_model(model: str, command: str) -> None:
    """A model that cannot be served (missing, truncated, an unsupported architecture or tensor type) fails here,
    in one line naming the problem and with exit status 1, before anything starts."""
    from engine.model_loader import load_arch

    try:
        load_arch(model)
    except (ValueError, OSError) as e:
        raise SystemExit(f"loraplex {command}: {e}") from None


def with_demo(settings):
    """No --model: the embedded demo (its adapters trained on first use), served without API keys unless asked."""
    from gateway.settings import default_database_url
    from loraplex.demo import build_demo

    demo = build_demo()
    name = settings.served_model_name or demo.name
    update = {
        "model": str(demo.model),
        "served_model_name": name,
        "lora_modules": settings.lora_modules or [f"{adapter}={path}" for adapter, path in demo.adapters.items()],
        "disable_auth": True if settings.disable_auth is None else settings.disable_auth,
    }
    if "database_url" not in settings.model_fields_set:
        update["database_url"] = default_database_url(name)
    return settings.model_copy(update=update)


def _settings(args: argparse.Namespace) -> ServeSettings:
    from gateway.settings import ServeSettings
    from loraplex.flags import settings_from_args

    return settings_from_args(ServeSettings, args, args.command)


def _engine_settings(args: argparse.Namespace) -> EngineSettings:
    """generate's engine options: flags > LORAPLEX_* variables > EngineConfig's defaults (its --seed is the sampling
    seed, not the engine's)."""
    from gateway.engine_settings import EngineSettings
    from loraplex.flags import settings_from_args

    return settings_from_args(EngineSettings, args, "generate", skip=GENERATE_SKIPS)


def _db_upgrade(args: argparse.Namespace) -> None:
    from registry.db import upgrade

    upgrade(_settings(args).database_url)


def build_parser() -> argparse.ArgumentParser:
    from gateway.engine_settings import EngineSettings
    from gateway.settings import ServeSettings
    from loraplex.flags import add_settings_flags

    parser = argparse.ArgumentParser(prog="loraplex", description="Multi-LoRA serving on one base model.")
    parser.add_argument(
        "--log-level", default=None, help="debug | info | warning | error (default: $LORAPLEX_LOG_LEVEL or info)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation (the embedded demo model unless --model)")
    gen.add_argument("--model", help="a Hugging Face model directory or a GGUF file; default: the embedded demo")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--lora",
        metavar="NAME=PATH",
        help="a PEFT LoRA adapter for every prompt (the demo has json, pirate, signature)",
    )
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="render each prompt as a user turn with the chat template (default: when the model has one)",
    )
    add_settings_flags(gen, EngineSettings, skip=GENERATE_SKIPS)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser(
        "serve",
        help="the OpenAI-compatible server (the embedded demo unless --model)",
        description="Serve a base model and its LoRA adapters over an OpenAI-compatible API. Every option can "
        "also be set by its environment variable; flags win.",
    )
    add_settings_flags(serve, ServeSettings, skip={"log_level"})
    serve.set_defaults(func=_serve)

    database = sub.add_parser("db", help="the registry database")
    db_sub = database.add_subparsers(dest="db_command", required=True)
    upgrade = db_sub.add_parser("upgrade", help="apply the schema migrations (serve also does at start)")
    # --model and --served-model-name name the default database
    add_settings_flags(upgrade, ServeSettings, only={"database_url", "model", "served_model_name"})
    upgrade.set_defaults(func=_db_upgrade)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, (help_text, command) in BENCHES.items():  # each parses its own options: no help of argparse's
        bench_sub.add_parser(name, help=help_text, add_help=False).set_defaults(func=command)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "command", None) != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.bench_args = extra
    if args.command == "bench":  # SIGTERM runs the finally blocks that stop its servers and driver processes
        from bench.process_group import exit_on_sigterm

        exit_on_sigterm()
    level = args.log_level or os.environ.get("LORAPLEX_LOG_LEVEL") or "info"
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))  # no line per request
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
