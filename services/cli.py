"""The `sparsecast` command: run the local demo, submit prompts, inspect a running stack.

Talks to the services' REST APIs only (docs/cli.md). Exit codes scripts can rely on:
0 ok, 1 the service could not be reached or answered with an error, 2 bad usage.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import httpx
from rich.console import Console
from rich.markup import escape

from services.trainer.kv_budget import KVControlSettings
from services.views import human_bytes, registry_version_row, step_summary, versions_table, workers_table
from shared.kv import KV_POLICIES
from shared.schemas import DEFAULT_RUN
from shared.tasks.addition import Scratchpad

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
REPO_ROOT = Path(__file__).resolve().parents[1]
# Where a stack's token lives, for the 401 message.
TOKEN_HELP = ("pass --token or set SPARSECAST_API_TOKEN to the token the services run with: "
              "deploy/env/sparsecast.env (or sparsecast.local.env) under docker compose; "
              "the release's Secret under Helm (kubectl get secret RELEASE-sparsecast-secrets -o jsonpath="
              "'{.data.SPARSECAST_API_TOKEN}' | base64 -d); the one `sparsecast demo` prints")

console = Console(highlight=False)
errors = Console(stderr=True, highlight=False)


class CLIError(Exception):
    """The service was unreachable or refused the request (exit 1)."""


class UsageError(Exception):
    """The command line makes no sense (exit 2)."""


# -- talking to the services --


class Service:
    """A REST endpoint of one service; every failure becomes a CLIError naming the service."""

    def __init__(self, name: str, url: str, token: str | None, timeout: float) -> None:
        self.name, self.url = name, url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise CLIError(f"cannot reach the {self.name} at {self.url}: {exc}") from exc
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            hint = ""
            if response.status_code == 401:
                hint = ("; no token was sent: " if "Authorization" not in self.client.headers
                        else "; the token was refused: ") + TOKEN_HELP
            raise CLIError(f"the {self.name} answered {response.status_code} to {method} {path}: "
                           f"{detail}{hint}")
        try:
            return response.json()
        except ValueError as exc:
            raise CLIError(f"the {self.name} sent a non-JSON answer to {method} {path}") from exc


def trainer(args: argparse.Namespace) -> Service:
    return Service("trainer", args.trainer_url, args.token, args.timeout)


# -- formatting --


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


# -- commands --


def cmd_status(args: argparse.Namespace) -> int:
    status = trainer(args).request("GET", "/v1/status")
    if args.json:
        print_json(status)
        return EXIT_OK
    steps = f"{status['step']}/{status['max_steps']}" if status.get("max_steps") else str(status["step"])
    version = "-" if status.get("version") is None else f"v{status['version']}"
    console.print(
        f"[bold]run[/] {status['run']} · [bold]state[/] {status['state']}"
        f"{' (paused)' if status.get('paused') else ''} · [bold]step[/] {steps} · [bold]version[/] {version}"
    )
    if status.get("error"):
        console.print(f"[red]error:[/] {escape(status['error'])}")
    q = status.get("queue") or {}
    console.print(
        f"queue: {q.get('prompts_queued', 0)} prompt groups waiting, {q.get('leases_pending', 0)} leased, "
        f"{q.get('trajectories_queued', 0)} trajectories waiting, {q.get('groups_completed', 0)} completed, "
        f"{q.get('dead_letter_depth', 0)} dead letters"
    )
    if status.get("last"):
        console.print("last " + step_summary(status["last"]))
    workers = status.get("workers") or []
    if workers:
        console.print(workers_table(workers, status.get("version")))
    else:
        console.print("no rollout workers registered")
    return EXIT_OK


def cmd_workers(args: argparse.Namespace) -> int:
    status = trainer(args).request("GET", "/v1/status")
    workers = status.get("workers") or []
    if args.json:
        print_json(workers)
    elif workers:
        console.print(workers_table(workers, status.get("version")))
    else:
        console.print("no rollout workers registered")
    return EXIT_OK


def cmd_versions(args: argparse.Namespace) -> int:
    if args.registry_url:
        registry = Service("registry", args.registry_url, args.token, args.timeout)
        manifests = registry.request("GET", f"/v1/runs/{args.run}/versions")
        run, rows = args.run, [registry_version_row(m) for m in manifests]
    else:
        answer = trainer(args).request("GET", "/v1/versions")
        run, rows = answer["run"], answer["versions"]
    rows.sort(key=lambda r: r["version"])
    if args.json:
        print_json({"run": run, "versions": rows})
        return EXIT_OK
    if not rows:
        console.print(f"run {run!r} has no published versions yet")
        return EXIT_OK
    console.print(versions_table(rows, args.last))
    patches = [r for r in rows if r.get("patch_bytes")]
    if patches:
        shipped = sum(r["patch_bytes"] for r in patches)
        dense = sum(r["dense_bytes"] for r in patches)
        console.print(
            f"{len(patches)} patches: {human_bytes(shipped)} shipped instead of {human_bytes(dense)} "
            f"of dense weights ({dense / shipped:.0f}x less)"
        )
    return EXIT_OK


def cmd_control(args: argparse.Namespace) -> int:
    """pause, resume, checkpoint: the trainer's control calls (they need the token)."""
    paths = {"pause": "/v1/train/pause", "resume": "/v1/train/resume", "checkpoint": "/v1/checkpoint"}
    path = paths[args.command]
    result = trainer(args).request("POST", path)
    if args.json:
        print_json(result)
    elif args.command == "checkpoint":
        console.print(f"checkpoint of step {result['step']} (v{result['version']}) "
                      f"written to {result['path']}")
    else:
        console.print(f"training {'paused' if result['paused'] else 'resumed'} at step {result['step']}")
    return EXIT_OK


def cmd_tasks(args: argparse.Namespace) -> int:
    result = trainer(args).request("GET", "/v1/tasks")
    if args.json:
        print_json(result)
    else:
        console.print("tasks: " + ", ".join(f"{t} (default)" if t == result.get("default") else t
                                            for t in result["tasks"]))
    return EXIT_OK


def _read_jsonl(path: str) -> bytes:
    try:
        raw = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from exc
    for n, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), start=1):
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{path} line {n} is not JSON: {exc.msg}") from exc
    return raw


def cmd_submit(args: argparse.Namespace) -> int:
    sources = sum(bool(x) for x in (args.prompts, args.file, args.generate))
    if sources != 1:
        raise UsageError("give prompts as arguments, or --file JSONL, or --generate N (exactly one of them)")
    if args.answer and len(args.answer) != len(args.prompts):
        raise UsageError(
            f"{len(args.answer)} --answer for {len(args.prompts)} prompts: give one per prompt or none"
        )
    service = trainer(args)
    if args.file:
        params = {
            k: v for k, v in (("task", args.task), ("samples_per_prompt", args.samples)) if v is not None
        }
        result = service.request("POST", "/v1/prompts", params=params, content=_read_jsonl(args.file),
                                 headers={"Content-Type": "application/x-ndjson"})
    else:
        body: dict[str, Any] = {"task": args.task, "samples_per_prompt": args.samples}
        if args.generate:
            body["generate"] = {"count": args.generate, "seed": args.seed}
        else:
            answers = args.answer or [None] * len(args.prompts)
            # The shell makes newlines awkward; task prompts end with one (e.g. "add 12+34\n").
            body["prompts"] = [{"prompt": p.replace("\\n", "\n"), "answer": a}
                               for p, a in zip(args.prompts, answers, strict=True)]
        result = service.request("POST", "/v1/prompts", json=body)
    if args.json:
        print_json(result)
    else:
        console.print(f"queued {result['count']} prompt groups of task {result['task']!r}, "
                      f"{result['samples_per_prompt']} samples each")
    return EXIT_OK


def list_benches() -> list[str]:
    folder = REPO_ROOT / "bench"
    return sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))


def cmd_bench(args: argparse.Namespace) -> int:
    names = list_benches()
    if not args.name:
        if args.json:
            print_json(names)
        else:
            console.print("benchmarks: " + (", ".join(names) if names else "none found")
                          + "\nrun one with: sparsecast bench NAME [ARGS...] (e.g. --device cuda)")
        return EXIT_OK
    if args.name not in names:
        raise UsageError(f"unknown benchmark {args.name!r}; known: {', '.join(names) or 'none'}")
    command = [sys.executable, "-m", f"bench.{args.name}", *args.bench_args]
    errors.print(escape(f"running {' '.join(command[1:])} (results go to bench/results/)"))
    code = subprocess.call(command, cwd=REPO_ROOT)
    if code != 0:
        raise CLIError(f"bench.{args.name} exited with status {code}")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from services.demo.options import DemoOptions
    from services.demo.supervisor import run_demo

    kv_min = args.kv_min if args.kv_min is not None else DemoOptions.kv_min
    if kv_min and args.kv_max and kv_min > args.kv_max:
        given_min = "" if args.kv_min is not None else " (the default)"
        raise UsageError(f"--kv-min {kv_min}{given_min} is above --kv-max {args.kv_max}")
    given = dict(
        steps=args.steps, workers=args.workers, kv_policy=args.kv_policy, kv_budget=args.kv_budget,
        groups_per_step=args.groups, samples_per_prompt=args.samples, keep_running=args.keep_running,
        folder=Path(args.dir), model=args.model, lr=args.lr, kl_coef=args.kl_coef, token=args.token,
        device=args.device,
        kv_buffer=args.kv_buffer, kv_keep_prompt=args.kv_keep_prompt, kv_calibrate=args.kv_calibrate,
        digits=args.digits, scratchpad=args.scratchpad, seed=args.seed, kv_adaptive=args.kv_adaptive,
        kv_target=args.kv_target,
        kv_min=args.kv_min, kv_max=args.kv_max, kv_min_saved=args.kv_min_saved, recompute=args.recompute,
        report=Path(args.report) if args.report else None,
    )
    # Options left out take DemoOptions' defaults: they are defined there once.
    return run_demo(DemoOptions(**{k: v for k, v in given.items() if v is not None}))


# -- the parser --


def package_version() -> str:
    try:
        return importlib.metadata.version("sparsecast")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not 0 <= value < math.inf:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text}")
    return value


def _share(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _floor(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:  # a cache saves less than all of the KV
        raise argparse.ArgumentTypeError(f"must be in [0, 1) (0: no floor), got {value}")
    return value


def demo_defaults() -> Any:
    from services.demo.options import DemoOptions  # dataclasses only: cheap to import for --help

    return DemoOptions()


def _digit_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition("-")
    if not (sep and low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
        raise argparse.ArgumentTypeError(f"expected MIN-MAX with 1 <= MIN <= MAX, got {text!r}")
    return int(low), int(high)


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    connection = argparse.ArgumentParser(add_help=False)
    group = connection.add_argument_group("connection")
    group.add_argument("--trainer-url", default=env("SPARSECAST_TRAINER_URL", "http://127.0.0.1:8000"),
                       help="trainer REST API (env SPARSECAST_TRAINER_URL; default %(default)s)")
    group.add_argument("--token", default=env("SPARSECAST_API_TOKEN") or None,
                       help="bearer token for writes (env SPARSECAST_API_TOKEN)")
    group.add_argument(
        "--timeout", type=float, default=10.0, help="seconds per request (default %(default)s)"
    )
    output = argparse.ArgumentParser(add_help=False)
    output.add_argument("--json", action="store_true", help="print the API's answer as JSON (for scripts)")

    parser = argparse.ArgumentParser(
        prog="sparsecast",
        description="sparsecast: RL post-training with sparse-KV rollouts and sparse weight patches.",
        epilog="Exit status: 0 ok, 1 a service was unreachable or answered with an error, 2 bad usage. "
               "See docs/cli.md.",
    )
    parser.add_argument("--version", action="version", version=f"sparsecast {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="run the whole stack locally and train the tiny model for a few minutes",
        description="Start Redis, the registry, the trainer and rollout workers as local processes, train "
                    "the "
        "warm-started tiny model on the addition task, show live progress, print a summary. "
        "Ctrl-C stops every process it started.",
    )
    defaults = demo_defaults()
    kv_defaults = KVControlSettings()  # the trainer's: the demo passes only what is given
    demo.add_argument("--steps", type=_positive, help=f"training steps (default {defaults.steps})")
    demo.add_argument("--workers", type=_positive, help=f"rollout workers (default {defaults.workers})")
    demo.add_argument("--kv-policy", choices=KV_POLICIES,
                      help=f"KV-cache policy of the workers (default {defaults.kv_policy})")
    demo.add_argument("--kv-budget", type=_positive,
                      help="KV tokens kept per sequence by sparse policies: the workers' first budget "
                           "(default: with --kv-adaptive and --kv-min-saved, the largest that saves that "
                           "share on the task's reference completions, 30 for the demo's task; else 32)")
    demo.add_argument("--kv-buffer", type=_positive,
                      help=f"tokens generated between re-compressions (default {defaults.kv_buffer})")
    demo.add_argument("--kv-calibrate", type=_share, metavar="RATIO",
                      help="raise --kv-budget (steps of 4, up to twice it) until the sparse sampler keeps "
                           "RATIO of the model's dense accuracy, measured before training and cached "
                           "(e.g. 0.7; default off)")
    demo.add_argument("--kv-adaptive", action=argparse.BooleanOptionalAction,
                      help="let the trainer move the workers' KV budget between versions to hold the "
                           "mismatch at --kv-target, from --kv-budget within [--kv-min, --kv-max] "
                           "(docs/training.md, \"Adaptive KV budget\"; default "
                           f"{'on' if defaults.kv_adaptive else 'off'}; "
                           "--no-kv-adaptive: a fixed --kv-budget)")
    demo.add_argument("--kv-target", type=_share, metavar="RATE",
                      help=f"share of sequences with a divergent token the adaptive budget holds "
                           f"(kv_control.metric {kv_defaults.metric}; default {kv_defaults.target})")
    demo.add_argument("--kv-min", type=_positive, metavar="N",
                      help=f"smallest adaptive KV budget (default {defaults.kv_min})")
    demo.add_argument("--kv-max", type=_positive, metavar="N",
                      help=f"largest adaptive KV budget (default {kv_defaults.max_budget})")
    demo.add_argument("--kv-min-saved", type=_floor, metavar="SHARE",
                      help="floor on the share of KV the adaptive budget saves: it never raises the "
                           "budget past it and lowers it when under it (0: no floor; default "
                           f"{defaults.kv_min_saved})")
    demo.add_argument("--recompute", choices=["dense", "replayed"],
                      help="how the trainer recomputes log-probs: with a dense cache (Sparse-RL's "
                           "correction) or under the workers' replayed eviction "
                           f"(default {defaults.recompute}; docs/training.md, \"Eviction replay\")")
    demo.add_argument("--kv-keep-prompt", action=argparse.BooleanOptionalAction,
                      help="never evict the prompt; the budget then counts generated tokens only "
                           f"(default {'on' if defaults.kv_keep_prompt else 'off'}; off: Sparse-RL's "
                           "semantics, the prompt evictable)")
    demo.add_argument(
        "--groups", type=_positive, help=f"prompt groups per step (default {defaults.groups_per_step})"
    )
    demo.add_argument(
        "--samples", type=_positive, help=f"samples per prompt (default {defaults.samples_per_prompt})"
    )
    demo.add_argument("--lr", type=float, help=f"trainer learning rate (default {defaults.lr})")
    demo.add_argument("--kl-coef", type=_non_negative, metavar="BETA",
                      help="k3 KL to the starting model in the loss (default the trainer's, 0: none); "
                           "0.04 kept lr 1e-4 stable on a GPU (docs/training.md, \"A KL anchor\")")
    demo.add_argument("--seed", type=int, help=f"trainer and prompt seed (default {defaults.seed})")
    demo.add_argument("--keep-running", action="store_true",
                      help="after the last step keep the stack (and the dashboard) up until Ctrl-C")
    demo.add_argument(
        "--dir", default="data/demo", help="folder for logs and the store (default %(default)s)"
    )
    demo.add_argument(
        "--model",
        default="tiny-demo",
        help="'tiny-demo' (the cached warm-start model) or a HF model folder (default %(default)s)",
    )
    demo.add_argument("--token", default=os.environ.get("SPARSECAST_API_TOKEN") or None,
                      help="API token for the stack (env SPARSECAST_API_TOKEN; default: a random one)")
    demo.add_argument("--device", help=f"device of the trainer and the workers: cpu, cuda, cuda:N "
                                       f"(default {defaults.device})")
    demo.add_argument("--digits", type=_digit_range, metavar="MIN-MAX",
                      help="digits of the addition prompts, e.g. 6-12 (default: the task's own)")
    demo.add_argument("--scratchpad", choices=get_args(Scratchpad),
                      help="the addition scratchpad (shared.tasks.addition; default: the task's own)")
    demo.add_argument("--report", help="also write the run's history and summary as JSON here")
    demo.set_defaults(func=cmd_demo)

    submit = sub.add_parser(
        "submit",
        parents=[connection, output],
        help="queue prompts for training",
        description="Queue prompt groups on the trainer: prompts as arguments (with --answer each), a JSONL "
                    "file "
        "(objects with 'prompt' and 'answer', or GSM8K-style 'question'/'answer'), or --generate N "
        "prompts made by the task itself. '\\n' in an argument becomes a newline.",
        epilog="example: sparsecast submit --task addition 'add 12+34\\n' --answer 46",
    )
    submit.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt texts")
    submit.add_argument("--answer", action="append", help="reference answer of each PROMPT, in order")
    submit.add_argument(
        "--file", "-f", metavar="JSONL", help="read prompts from a JSONL file ('-' for stdin)"
    )
    submit.add_argument("--generate", type=_positive, metavar="N", help="let the task make N prompts")
    submit.add_argument("--seed", type=int, default=0, help="seed for --generate (default %(default)s)")
    submit.add_argument("--task", help="task that rewards the completions (default: the trainer's)")
    submit.add_argument(
        "--samples", type=_positive, metavar="N", help="samples per prompt (default: the trainer's)"
    )
    submit.set_defaults(func=cmd_submit)

    status = sub.add_parser(
        "status",
        parents=[connection, output],
        help="training state, queue and last step",
        description="Show the trainer's state, step, version, queue depths, the last "
        "step's metrics and the rollout workers.",
    )
    status.set_defaults(func=cmd_status)

    versions = sub.add_parser(
        "versions",
        parents=[connection, output],
        help="published weight versions and their patch sizes",
        description="List the published versions: patch bytes against dense bytes, changed fraction and the "
        "step's reward. Reads the trainer, or the registry directly when --registry-url is given.",
    )
    versions.add_argument("--registry-url", default=env("SPARSECAST_REGISTRY_URL") or None,
                          help="ask this registry instead of the trainer (env SPARSECAST_REGISTRY_URL)")
    versions.add_argument("--run", default=env("SPARSECAST_RUN", DEFAULT_RUN),
                          help="run name at the registry (env SPARSECAST_RUN; default %(default)s)")
    versions.add_argument(
        "--last", type=int, default=20, help="rows to show, 0 for all (default %(default)s)"
    )
    versions.set_defaults(func=cmd_versions)

    workers = sub.add_parser(
        "workers",
        parents=[connection, output],
        help="rollout workers and their versions",
        description="List the registered rollout workers: engine, KV policy, weight version "
        "and lag behind the trainer, leases held, tokens/s, download speed.",
    )
    workers.set_defaults(func=cmd_workers)

    for name, summary in (
        ("pause", "pause training after the current step (needs the token)"),
        ("resume", "resume paused training (needs the token)"),
        ("checkpoint", "write a checkpoint now, once the last version is published (needs the token)"),
    ):
        control = sub.add_parser(name, parents=[connection, output], help=summary,
                                 description=summary[0].upper() + summary[1:] + ".")
        control.set_defaults(func=cmd_control)
    tasks = sub.add_parser("tasks", parents=[connection, output], help="the trainer's reward tasks",
                           description="List the tasks the trainer can reward, and its default one.")
    tasks.set_defaults(func=cmd_tasks)

    bench = sub.add_parser(
        "bench",
        parents=[output],
        help="run a benchmark (python -m bench.NAME)",
        description="Run python -m bench.NAME with the remaining arguments; without NAME, list "
        "the benchmarks. Results are written to bench/results/NAME-<device>.json.",
    )
    bench.add_argument("name", nargs="?", help="benchmark name")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to the benchmark")
    bench.set_defaults(func=cmd_bench)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse argv, letting `submit` interleave prompts with their answers.

    argparse fills a positional from one run of arguments only, so `submit 'add 12+34\\n' --answer 46
    'add 5+6\\n' --answer 11` would leave the second prompt "unrecognized". Later runs of plain
    arguments are appended to the prompts in order; anything else unknown is still bad usage.
    """
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "command", None) == "submit" and not any(a.startswith("-") for a in extra):
        args.prompts = [*args.prompts, *extra]
    elif extra:
        parser.parse_args(argv)  # reports the unrecognized arguments and exits 2
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parse_args(parser, argv)
    except SystemExit as exc:  # argparse: --help exits 0, bad usage 2
        return int(exc.code or 0)
    try:
        return args.func(args)
    except UsageError as exc:
        parser.print_usage(sys.stderr)
        errors.print(f"sparsecast {args.command}: error: {escape(str(exc))}")
        return EXIT_USAGE
    except CLIError as exc:
        errors.print(f"[red]error:[/] {escape(str(exc))}")
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
