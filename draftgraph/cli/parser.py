"""The `draftgraph` command line's parser: every command and flag, each with its help (cli.py runs them)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from draftgraph import envs
from draftgraph.cli.text import add_text_arguments

MODES = ["auto", "NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE"]  # CUDAGraphMode's values, and auto


def _add_common(p: argparse.ArgumentParser, mode_help: str) -> None:
    p.add_argument("--target", help="target checkpoint directory (default: the built-in model pair)")
    p.add_argument(
        "--drafter",
        help="drafter checkpoint directory, or 'ngram' for prompt lookup with no model (default: the built-in drafter)",
    )
    p.add_argument("--ngram-min", type=int, default=1, help="--drafter ngram: the shortest n-gram matched (default 1)")
    p.add_argument("--ngram-max", type=int, default=3, help="--drafter ngram: the longest n-gram matched (default 3)")
    p.add_argument(
        "--drafter-kind",
        choices=["eagle", "eagle3", "mtp", "draft_model"],
        help="the drafter's kind (default: detected from its checkpoint)",
    )
    p.add_argument("--no-drafter", action="store_true", help="plain decoding with the target alone")
    p.add_argument(
        "-k", "--num-speculative-tokens", type=int, default=3, help="K, draft tokens per step, 0..8 (default 3)"
    )
    p.add_argument(
        "--speculation",
        choices=["auto", "fixed", "adaptive"],
        default="auto",
        help="fixed: K drafts every step; adaptive: each decode step picks K from 0, ceil(K/2), K by measured step "
        "times and running acceptance; auto (default): adaptive where CUDA graphs time the steps, else fixed",
    )
    p.add_argument("--mode", default="auto", choices=MODES, help=mode_help)
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where to run (default auto: cuda when available, else cpu)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV cache dtype (default auto: the checkpoint's, else float32)",
    )
    p.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "sdpa", "reference", "triton"],
        help="attention kernels (default auto: triton on CUDA, sdpa on the CPU; reference is the oracle)",
    )
    p.add_argument("--max-num-seqs", type=int, default=16, help="most requests in one step (default 16)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="most tokens in one step (default 512)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="longest request, prompt + generated tokens (default 0 = the target's max_position_embeddings, "
        "at most 4096)",
    )
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=0,
        help="KV cache blocks (default 0 = auto: measured on CUDA, room for max-num-seqs requests on the CPU)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block, a power of two (default 16)")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="fraction of CUDA memory the engine may hold; the KV cache gets what weights, activations and "
        "graphs leave (default: 0.9 on CUDA unless --num-kv-blocks is set, off on the CPU; 0 = off)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the built-in weights, prompts and sampling (default 0)")
    p.add_argument(
        "--capture-sizes", default="", help="PIECEWISE: comma-separated padded token counts with graphs (default: auto)"
    )
    p.add_argument(
        "--compile-sizes",
        default="",
        help="comma-separated token counts that get an Inductor compile specialised to them, beside the one "
        "symbolic-size compile of every piece (default: none)",
    )
    p.add_argument(
        "--compile-backend",
        default="inductor",
        choices=["inductor", "eager"],
        help="inductor (default), or eager: split pieces run as plain FX, for debugging",
    )
    p.add_argument(
        "--ops",
        default="",
        metavar="NAME=0|1,...",
        help="draftgraph's kernels on CUDA (CompileConfig.ops, ops/choices.py): turn one off to run the torch ops, "
        "e.g. gemv=0,rope_kv_write=0; names: gemv, norm_kernel, rope_kernel, norm_in_projection, rope_kv_write, "
        "race_sampler, unfuse_addmm, logits_kernels (default: all on)",
    )
    p.add_argument(
        "--inductor-option",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="a torch._inductor.config setting for every compile, e.g. triton.autotune_pointwise=False; "
        "repeatable; any given replaces draftgraph's defaults (VALUE is a Python literal)",
    )
    p.add_argument(
        "--compile-workers",
        type=int,
        default=None,
        metavar="N",
        help="processes compiling pieces in parallel while tracing goes on (default: auto, half the cores "
        "on CUDA, at most 8; 0 = every compile in this process)",
    )
    p.add_argument("--no-cuda-graphs", action="store_true", help="compiled pieces without CUDA graphs")
    p.add_argument(
        "--capture",
        default="auto",
        choices=["auto", "eager", "lazy"],
        help="capture every CUDA graph at start (eager), or each when a step first needs it (lazy); default auto: "
        "lazy for generate (a one-off job, whose start is most of what the user waits for), eager for serve and "
        "with --speculation adaptive (its step times are measured on the captured graphs)",
    )
    p.add_argument(
        "--fuse-draft-loop",
        default="auto",
        choices=["auto", "on", "off"],
        help="FULL modes: trace the drafter's K steps as one function, its token choice compiled with them (on), "
        "or run the loop around the compiled drafter step (off); auto: on only without the one-graph step",
    )
    p.add_argument(
        "--no-overlap-steps",
        action="store_true",
        help="read each uniform decode step before launching the next (default: the next step is queued first, "
        "so the host's work overlaps the GPU's)",
    )
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="prefill every prompt from its start (default: full KV blocks are kept and shared by later requests "
        "whose tokens start the same, which prefill only the rest; hybrid models keep state snapshots too)",
    )
    p.add_argument(
        "--prefix-state-snapshots",
        type=int,
        default=0,
        metavar="N",
        help="hybrid models (Qwen3.5): device slots for Gated DeltaNet state snapshots at block boundaries, which "
        "prefix-cache hits need (default 0 = auto: max-num-seqs)",
    )
    p.add_argument(
        "--check-addresses",
        action="store_true",
        default=envs.check_addresses(),
        help="verify static input addresses at every graph replay (env DRAFTGRAPH_CHECK_ADDRESSES=1)",
    )
    p.add_argument(
        "--dump-graphs",
        default=envs.dump_graphs_dir(),
        help="write each pass's before/after graph here (env DRAFTGRAPH_DUMP_GRAPHS)",
    )


GENERATE_MODE_HELP = (
    "CUDA graph mode (default auto: FULL_AND_PIECEWISE on CUDA, NONE on the CPU, or the mode --artifacts were "
    "built with)"
)
BUILD_MODE_HELP = (
    "CUDA graph mode to compile for (default auto: FULL_AND_PIECEWISE; graphs are captured when the artifacts "
    "are loaded)"
)
INSPECT_MODE_HELP = "mode to compile and inspect, on the CPU (default auto: PIECEWISE)"


def _add_parallel(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor parallel size: ranks the target runs on, one worker process per device, or one per process "
        "of a torchrun launch of tp x dp processes (default 1)",
    )
    p.add_argument(
        "--draft-tp",
        type=int,
        default=None,
        help="the drafter's tensor parallel size: the target's (--tp) or 1, replicated (default: --tp)",
    )
    p.add_argument(
        "--dp",
        type=int,
        default=1,
        help="data parallel size: engine replicas, each with its own requests (--tp ranks each; default 1)",
    )
    p.add_argument(
        "--expert-parallel",
        action="store_true",
        help="split a MoE target's experts whole across all --tp x --dp ranks (replicas then step together; "
        "needs --tp x --dp >= 2)",
    )
    p.add_argument(
        "--all-reduce",
        choices=("auto", "nccl"),
        default="auto",
        help="tensor-parallel all-reduces on CUDA: auto = small messages over peer memory (one-shot kernels, "
        "by a measured rule) where the GPUs reach each other's memory, NCCL otherwise; nccl = NCCL always",
    )


class _Version(argparse.Action):
    """--version: draftgraph's version and torch's (imported only here: the parser itself loads no torch)."""

    def __call__(self, parser, namespace, values, option_string=None):
        import torch

        from draftgraph import __version__

        print(f"draftgraph {__version__} (torch {torch.__version__})")
        parser.exit()


def build_parser(commands: dict[str, Callable]) -> argparse.ArgumentParser:
    """The `draftgraph` argument parser, every command and flag (each with its help); `commands` maps each
    command to the function that runs it (`run` is `generate`)."""
    parser = argparse.ArgumentParser(
        prog="draftgraph", description="speculative decoding under CUDA graphs, compiled with torch.compile"
    )
    parser.add_argument("--version", action=_Version, nargs=0, help="print draftgraph's and torch's versions and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every decision (config, compiles)")
    sub = parser.add_subparsers(dest="command", required=True, help="what to do")
    for name in ("generate", "run"):
        p = sub.add_parser(name, help="generate with speculative decoding and report acceptance and tokens/s")
        _add_common(p, GENERATE_MODE_HELP)
        p.add_argument("--num-prompts", type=int, default=8, help="random prompts to generate from (default 8)")
        p.add_argument(
            "--prompt-len", type=int, default=24, help="longest random prompt, in tokens (default 24; shortest half)"
        )
        p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt, >= 1 (default 64)")
        p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, >= 0 (default 0: greedy)")
        p.add_argument(
            "--top-k", type=int, default=0, help="keep the k likeliest tokens, >= 1; 0 or -1 = off (default 0)"
        )
        p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 = off (default 1)")
        _add_parallel(p)
        p.add_argument("--artifacts", help="load compiled code from this `draftgraph build` directory")
        add_text_arguments(p)
        p.add_argument(
            "--strict-artifacts",
            action="store_true",
            help="stop (exit 2) when the artifacts do not match or hold files their manifest does not list, "
            "instead of compiling",
        )
        p.add_argument(
            "--verify-key",
            metavar="FILE",
            help="refuse --artifacts not signed with this key file (`draftgraph build --sign-key FILE`), before "
            "reading anything but their manifest",
        )
        p.add_argument(
            "--no-artifact-cache",
            action="store_true",
            help="neither load nor keep compiled code in the artifact cache beside Inductor's (by default a start "
            "with the same flags loads what the last one compiled: no trace, no compile; cli/artifact_cache.py)",
        )
        p.add_argument(
            "--profile",
            type=int,
            default=0,
            metavar="STEPS",
            help="afterwards, profile this many steps: GPU kernels launched from CUDA graphs vs outside them",
        )
        p.set_defaults(func=commands["generate"])
    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)"
    )
    _add_common(p, GENERATE_MODE_HELP)
    _add_parallel(p)
    p.add_argument("--artifacts", help="load compiled code from this `draftgraph build` directory")
    p.add_argument(
        "--strict-artifacts",
        action="store_true",
        help="stop (exit 2) when the artifacts do not match, instead of compiling",
    )
    p.add_argument(
        "--verify-key",
        metavar="FILE",
        help="refuse --artifacts not signed with this key file (`draftgraph build --sign-key FILE`), before "
        "reading anything but their manifest",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="directory of a transformers tokenizer (default: the --target checkpoint's, when it has one); without "
        "one, prompts must be token ids and chat completions are refused",
    )
    p.add_argument(
        "--no-artifact-cache",
        action="store_true",
        help="neither load nor keep compiled code in the artifact cache beside Inductor's (as generate's flag)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: every one)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free one, printed)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send and /v1/models lists (default: --target as given, or draftgraph-builtin)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=1024,
        help="requests that may wait for a place in the running batch (--max-num-seqs per replica); more get 503 "
        "(default 1024)",
    )
    p.set_defaults(func=commands["serve"])
    p = sub.add_parser("build", help="compile ahead of time into an artifact directory (manifest, summary, code)")
    _add_common(p, BUILD_MODE_HELP)
    p.add_argument(
        "--out", required=True, help="artifact directory to write (new or empty; with several ranks, OUT/rank-R each)"
    )
    p.add_argument(
        "--sign-key",
        metavar="FILE",
        help="sign the manifest (HMAC-SHA256, OUT/manifest.sig) with this key file of raw random bytes (make one "
        "with `head -c 32 /dev/urandom > key`; keep it apart from the artifacts); loads check it with --verify-key",
    )
    _add_parallel(p)
    p.set_defaults(func=commands["build"])
    p = sub.add_parser("inspect", help="write normalized graph dumps and a summary for a model pair and config")
    _add_common(p, INSPECT_MODE_HELP)
    p.add_argument("--out", required=True, help="inspection directory to write")
    p.add_argument(
        "--family",
        default="llama",
        choices=["llama", "qwen2", "qwen3", "mistral", "deepseek_v32", "qwen3_5"],
        help="built-in target family (without --target; deepseek_v32: sparse MLA, qwen3_5: Gated DeltaNet hybrid, "
        "each with its MTP drafter)",
    )
    p.set_defaults(func=commands["inspect"])
    p = sub.add_parser("graph-diff", help="compare two inspections; exit 0 equal, 1 different, 2 error")
    p.add_argument("a", help="the first inspection directory (e.g. before a change)")
    p.add_argument("b", help="the second inspection directory (e.g. after it)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=commands["graph-diff"])
    return parser
