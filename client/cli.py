"""The `loramux` command: adapter admin on the store, streaming generation on a worker.

    loramux [--worker HOST:PORT] [--store HOST:PORT] [--api-token T] [--admin-token T] [--timeout S]
            [--tls-ca PEM [--tls-cert PEM --tls-key PEM]]
            adapters {register,list,get,delete,pin,unpin} ... | generate ... | model-info | worker-adapters

Exit status: 0 on success, 1 when a call fails (the status and message go to stderr), 2 for usage
errors.
"""

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from .connection import DEFAULT_STORE, DEFAULT_WORKER
from .errors import LoramuxError
from .stream import Stream
from .sync_client import Client
from .types import Adapter, Completion

DIGEST_PREFIX = 12  # hex digits of the digest `adapters list` shows


def main(argv: Sequence[str] | None = None) -> None:
    sys.exit(run(sys.argv[1:] if argv is None else argv, os.environ))


def run(argv: Sequence[str], env: Mapping[str, str]) -> int:
    parser = build_parser(env)
    args = parser.parse_args(argv)
    try:
        client = Client(
            args.worker,
            args.store,
            args.api_token,
            args.admin_token,
            args.timeout,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        )
    except ValueError as e:  # a TLS file missing or unreadable: a usage error, exit status 2
        parser.error(str(e))
    try:
        with client:
            args.command(client, args)
    except LoramuxError as e:
        print(f"loramux: {e.code.name}: {e.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loramux", description="Manage LoRA adapters and generate with them.")
    p.add_argument(
        "--worker",
        default=env.get("LORAMUX_WORKER", DEFAULT_WORKER),
        help=f"worker HOST:PORT (default: $LORAMUX_WORKER, else {DEFAULT_WORKER})",
    )
    p.add_argument(
        "--store",
        default=env.get("LORAMUX_STORE", DEFAULT_STORE),
        help=f"adapter store HOST:PORT (default: $LORAMUX_STORE, else {DEFAULT_STORE})",
    )
    p.add_argument(
        "--api-token",
        default=env.get("LORAMUX_API_TOKEN"),
        help="bearer token the worker wants (default: $LORAMUX_API_TOKEN)",
    )
    p.add_argument(
        "--admin-token",
        default=env.get("LORAMUX_ADMIN_TOKEN"),
        help="bearer token for the store's admin calls (default: $LORAMUX_ADMIN_TOKEN)",
    )
    p.add_argument("--timeout", type=_positive_float, help="deadline of each call in seconds (default: none)")
    for flag, text in [
        ("ca", "PEM CA that signed the servers' certificates: connect over TLS"),
        ("cert", "PEM client certificate, for servers that want one (mTLS)"),
        ("key", "PEM private key of --tls-cert"),
    ]:
        variable = f"LORAMUX_TLS_{flag.upper()}"
        p.add_argument(f"--tls-{flag}", default=env.get(variable), help=f"{text} (default: ${variable})")
    commands = p.add_subparsers(title="commands", required=True, metavar="COMMAND")
    _add_adapter_commands(commands)
    _add_generate_command(commands)
    commands.add_parser("model-info", help="the worker's model and limits").set_defaults(command=model_info)
    worker = commands.add_parser("worker-adapters", help="adapters the worker holds now")
    worker.set_defaults(command=worker_adapters)
    return p


def _add_adapter_commands(commands) -> None:
    adapters = commands.add_parser("adapters", help="register, list and manage adapters in the store")
    verbs = adapters.add_subparsers(title="adapter commands", required=True, metavar="VERB")
    register = verbs.add_parser("register", help="fetch, validate and store a PEFT checkpoint")
    register.add_argument("id", metavar="ID")
    register.add_argument("source_uri", metavar="SOURCE_URI", help="file:///abs/dir or s3://bucket/prefix")
    register.add_argument("--request-id", help="id echoed in the store's logs")
    register.set_defaults(command=register_adapter)
    verbs.add_parser("list", help="every adapter, as a table").set_defaults(command=list_adapters)
    for verb, command, text in [
        ("get", get_adapter, "one adapter's details"),
        ("delete", delete_adapter, "remove an adapter"),
        ("pin", pin_adapter, "workers preload it and never evict it"),
        ("unpin", unpin_adapter, "clear the pinned mark"),
    ]:
        parser = verbs.add_parser(verb, help=text)
        parser.add_argument("id", metavar="ID")
        parser.set_defaults(command=command)
    verbs.choices["delete"].add_argument("--force", action="store_true", help="delete even when pinned")


def _add_generate_command(commands) -> None:
    g = commands.add_parser("generate", help="stream a completion to stdout")
    g.add_argument("prompt")
    g.add_argument("--adapter", help="registered adapter id (default: the base model)")
    g.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    g.add_argument("--max-tokens", type=int)
    g.add_argument("--temperature", type=float, help="0 = greedy")
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", metavar="STR", help="stop string (repeat for more)")
    _add_constraint_flags(g)
    g.set_defaults(command=generate)


def _add_constraint_flags(g: argparse.ArgumentParser) -> None:
    """The output constraints, mutually exclusive: a request holds one (a oneof), so two are a usage
    error here rather than the SDK's ValueError."""
    c = g.add_argument_group("output constraint (at most one)").add_mutually_exclusive_group()
    c.add_argument(
        "--json-schema", type=_text_or_file, metavar="SCHEMA", help="JSON schema text, or @FILE holding it"
    )
    c.add_argument("--json-object", action="store_true", help="any JSON object")
    c.add_argument("--regex", help="a regular expression the whole output matches")
    c.add_argument("--choice", action="append", metavar="STR", help="one allowed output (repeat for more)")
    c.add_argument("--grammar", type=_text_or_file, help="Lark or GBNF grammar text, or @FILE holding it")


def _text_or_file(text: str) -> str:
    """TEXT as is, or @PATH: the file's text (a schema or grammar too long for a command line)."""
    if not text.startswith("@"):
        return text
    try:
        return Path(text[1:]).read_text()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {text[1:]}: {e.strerror}") from None


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def register_adapter(client: Client, args) -> None:
    _print_fields(client.register_adapter(args.id, args.source_uri, args.request_id))


def list_adapters(client: Client, args) -> None:
    rows = [["ID", "DIGEST", "RANK", "SIZE", "PINNED", "SOURCE"]]
    rows += [_adapter_row(a) for a in client.list_adapters()]
    _print_table(rows)


def _adapter_row(a: Adapter) -> list[str]:
    digest = a.digest.removeprefix("sha256:")[:DIGEST_PREFIX]
    return [a.adapter_id, digest, str(a.rank), _size(a.size_bytes), _yes_no(a.pinned), a.source_uri]


def get_adapter(client: Client, args) -> None:
    _print_fields(client.get_adapter(args.id))


def delete_adapter(client: Client, args) -> None:
    deleted = client.delete_adapter(args.id, force=args.force)
    print(f"deleted {deleted.adapter_id} ({deleted.digest})")


def pin_adapter(client: Client, args) -> None:
    print(f"pinned {client.pin_adapter(args.id).adapter_id}")


def unpin_adapter(client: Client, args) -> None:
    print(f"unpinned {client.unpin_adapter(args.id).adapter_id}")


def generate(client: Client, args) -> None:
    if args.chat:
        inputs = {"messages": [{"role": "user", "content": args.prompt}]}
    else:
        inputs = {"prompt": args.prompt}
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}
    sampling |= {
        "json_schema": args.json_schema,
        "json_object": args.json_object,
        "regex": args.regex,
        "choice": args.choice,
        "grammar": args.grammar,
    }
    with client.generate(**inputs, adapter=args.adapter, stop=args.stop, **sampling) as stream:
        _write_text(stream)
    print()
    print(_summary(stream.result), file=sys.stderr)


def _write_text(stream: Stream) -> None:
    """Each delta's text as it arrives; a failure midway still ends the written line."""
    wrote = False
    try:
        for delta in stream:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            wrote = wrote or bool(delta.text)
    except BaseException:
        if wrote:
            print()
        raise


def _summary(result: Completion) -> str:
    return (
        f"[finish: {result.finish_reason}, tokens: {result.prompt_tokens} prompt ({result.cached_tokens} "
        f"cached) + {result.completion_tokens} generated, time to first token: "
        f"{result.time_to_first_token_s:.3f} s, "
        f"total: {result.total_s:.3f} s]"
    )


def model_info(client: Client, args) -> None:
    _print_fields(client.model_info())


def worker_adapters(client: Client, args) -> None:
    rows = [["ID", "LOCATION", "PINNED", "DIGEST"]]
    for a in client.worker_adapters():
        digest = a.digest.removeprefix("sha256:")[:DIGEST_PREFIX]
        rows.append([a.adapter_id, a.location, _yes_no(a.pinned), digest])
    _print_table(rows)


def _print_fields(record) -> None:
    """One `name: value` line per dataclass field; lists comma-separated."""
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if isinstance(value, list):
            value = ", ".join(map(str, value))
        elif hasattr(value, "isoformat"):
            value = value.isoformat()
        print(f"{field.name}: {value}")


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"
