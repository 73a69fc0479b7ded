"""`marind data prepare`: raw text or JSONL -> a token ``.bin`` + ``.idx`` pair."""

from __future__ import annotations

import json
from pathlib import Path


def register(sub) -> None:
    data = sub.add_parser("data", help="prepare training data")
    dsub = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    p = dsub.add_parser("prepare", help="tokenize text or JSONL into OUTPUT.bin + OUTPUT.idx")
    p.add_argument("inputs", nargs="*", help="text/JSONL files or directories (omit with --example)")
    p.add_argument("-o", "--output", required=True, help="output prefix, e.g. data/corpus")
    p.add_argument("--format", choices=("auto", "text", "jsonl"), default="auto",
                   help="auto: .jsonl/.json files are JSONL, others text")
    p.add_argument("--jsonl-key", default="text", help="field of each JSONL record holding the text")
    p.add_argument("--tokenizer", default=None, help="a local Hugging Face tokenizer.json (default: bytes)")
    p.add_argument("--example", action="store_true", help="use the built-in generated example corpus")
    p.add_argument("--example-docs", type=int, default=600, help="paragraphs of the example corpus")
    p.set_defaults(handler=_prepare)


def _files(inputs: list[str]) -> list[Path]:
    out = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            out.extend(sorted(p for p in path.rglob("*") if p.is_file()))
        elif path.is_file():
            out.append(path)
        else:
            raise FileNotFoundError(f"input {item} does not exist; give text/JSONL files or directories")
    return out


def iter_texts(files: list[Path], fmt: str, key: str):
    for path in files:
        is_jsonl = fmt == "jsonl" or (fmt == "auto" and path.suffix in (".jsonl", ".json"))
        if not is_jsonl:
            yield path.read_text(encoding="utf-8", errors="replace")
            continue
        with open(path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg}); fix the line or use --format text") from None
                if not isinstance(record, dict) or not isinstance(record.get(key), str):
                    raise ValueError(f"{path}:{n}: no string field {key!r}; pass --jsonl-key")
                yield record[key]


def prepare(inputs: list[str], output: str, *, fmt: str = "auto", jsonl_key: str = "text",
            tokenizer: str | None = None, example: bool = False, example_docs: int = 600):
    from marind.trainer.data import corpus
    from marind.trainer.data.dataset import write_dataset
    from marind.trainer.data.tokenize import get_tokenizer

    tok = get_tokenizer(tokenizer)
    if example:
        texts = corpus.documents(example_docs)
    else:
        files = _files(inputs)
        if not files:
            raise ValueError("no input files: give text/JSONL files or directories, or --example")
        texts = iter_texts(files, fmt, jsonl_key)
    return write_dataset(output, (tok.encode(t) for t in texts), tok.vocab_size)


def _prepare(args) -> int:
    if not args.example and not args.inputs:
        raise ValueError("give input files or directories, or --example for the built-in corpus")
    header = prepare(args.inputs, args.output, fmt=args.format, jsonl_key=args.jsonl_key,
                     tokenizer=args.tokenizer, example=args.example, example_docs=args.example_docs)
    print(json.dumps({"output": args.output, "documents": header.documents, "tokens": header.tokens,
                      "vocab_size": header.vocab_size}))
    return 0
