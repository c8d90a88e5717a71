"""`draftgraph generate` with text: --prompt / --prompts-file in, text out (streamed with --stream).

Everything here is checked before the engine is built: the prompts file, the stop ids, and that a
tokenizer exists when prompts are text.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_text_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="a text prompt (repeat for several); needs a tokenizer (the --target checkpoint's, or --tokenizer). "
        "Without --prompt / --prompts-file, random token-id prompts are generated (--num-prompts)",
    )
    p.add_argument("--prompts-file", metavar="FILE", help="text prompts, one per line (blank lines skipped)")
    p.add_argument(
        "--stream",
        action="store_true",
        help="print text as it is generated (one prompt: as running text; several: a '[i] text' line per "
        "request and step)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="directory of a transformers tokenizer (default: the --target checkpoint's, when it has one)",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="text prompts: do not stop at the checkpoint's eos ids (config.json, generation_config.json); "
        "random prompts always ignore them",
    )
    p.add_argument(
        "--stop-token-ids",
        default="",
        metavar="IDS",
        help="comma-separated token ids that end a request (kept as its last token), besides eos",
    )


def text_prompts(args) -> list[str]:
    """The --prompt values, then the lines of --prompts-file."""
    prompts = list(args.prompt)
    if args.prompts_file:
        if not os.path.isfile(args.prompts_file):
            raise FileNotFoundError(f"--prompts-file {args.prompts_file!r} does not exist")
        with open(args.prompts_file, encoding="utf-8") as f:
            lines = [line.rstrip("\r\n") for line in f]
        file_prompts = [line for line in lines if line.strip()]
        if not file_prompts:
            raise ValueError(f"--prompts-file {args.prompts_file!r} holds no prompt; write one prompt per line")
        prompts += file_prompts
    if any(not p for p in prompts):
        raise ValueError("--prompt '' is empty; give some text")
    return prompts


def stop_token_ids(args) -> tuple[int, ...]:
    try:
        ids = tuple(int(x) for x in args.stop_token_ids.split(",") if x.strip())
    except ValueError:
        ids = (-1,)
    if any(t < 0 for t in ids):
        raise ValueError(
            f"--stop-token-ids {args.stop_token_ids!r} must be comma-separated token ids >= 0, e.g. 2,32000"
        )
    return ids


def cli_tokenizer(args, needed: bool):
    """--tokenizer's tokenizer, else the --target checkpoint's, else False (none). With `needed` (text
    prompts), having none is an error that says how to give one."""
    from draftgraph.runtime.text import has_tokenizer_files, load_tokenizer

    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    if args.target and has_tokenizer_files(args.target):
        return load_tokenizer(args.target)
    if needed:
        where = f"the checkpoint {args.target!r} has none" if args.target else "the built-in pair has none"
        raise ValueError(
            f"text prompts need a tokenizer and {where}; pass --tokenizer DIR (a directory a transformers "
            "tokenizer was saved to with save_pretrained), or --target a checkpoint that holds one"
        )
    return False


def generate_text(engine, prompts: list[str], params, stream: bool) -> None:
    """Generate for the text prompts and print each one's text (streamed with `stream`)."""
    if not stream:
        outputs = engine.generate(prompts, params, progress=True)
    else:
        outputs = [None] * len(prompts)
        single = len(prompts) == 1
        if single:
            print(f"prompt: {prompts[0]!r}\n", flush=True)
        for d in engine.stream(prompts, params):
            if d.text:
                if single:
                    sys.stdout.write(d.text)
                    sys.stdout.flush()
                else:
                    print(f"[{d.index}] {d.text}", flush=True)
            if d.output is not None:
                outputs[d.index] = d.output
        print()
        if single:
            out = outputs[0]
            print(f"({len(out.token_ids)} tokens, finish: {out.finish_reason})")
            return
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        print(f"--- [{i}] prompt: {prompt!r} ({len(out.prompt_token_ids)} tokens)")
        print(out.text)
        print(f"--- [{i}] {len(out.token_ids)} tokens, finish: {out.finish_reason}")
