"""The `slabserve` command (and `build-plan`, installed on its own).

    slabserve build-plan SPEC --out DIR            plan a serving spec into a bundle; prints the plan id and summary
    slabserve plan inspect DIR                     the summary, fingerprints, per-bucket activation arenas
    slabserve plan diff OLD NEW [--max-regression PCT]   memory and capacity deltas; exit 1 on a regression
    slabserve plan verify DIR --target NAME [--reserve SIZE]   fit against a named GPU or a memory size
    slabserve serve ...                            the gRPC server (runtime.server)
    slabserve generate ...                         the gRPC client (runtime.client)
    slabserve health [--addr HOST:PORT] [--wait S]  exit 0 once the server's health is SERVING (runtime.client)

Exit status: 0 done; 1 the plan does not fit, or regressed, or does not verify; 2 bad input (a spec, a model or a
bundle that cannot be used; the message says what and where). Errors never print a traceback unless `--debug`.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from typing import Sequence

EXIT_OK, EXIT_FAIL, EXIT_INPUT = 0, 1, 2
# commands the runtime's modules parse themselves: name -> (module, whether its parser takes the command's name
# first (the client has both generate and health), its help line)
RUNTIME_COMMANDS = {
    "serve": ("slabserve.runtime.server", False, "serve a plan bundle over gRPC (and HTTP with --http-port)"),
    "generate": ("slabserve.runtime.client", True, "stream an answer from a server (the gRPC client)"),
    "health": ("slabserve.runtime.client", True, "wait until a server's health is SERVING")}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in RUNTIME_COMMANDS:
        return _dispatch_runtime(args[0], args[1:])
    parser = _parser()
    ns = parser.parse_args(args)
    if not getattr(ns, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_INPUT
    return _run(ns.func, ns)


def build_plan_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="build-plan", description="Plan a serving spec into a plan bundle.")
    _build_args(parser)
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    return _run(_cmd_build, ns)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slabserve", description="Ahead-of-time planned LLM serving.")
    sub = parser.add_subparsers(dest="command", metavar="{build-plan,plan,serve,generate,health}")
    build = sub.add_parser("build-plan", help="plan a serving spec into a bundle")
    _build_args(build)
    build.set_defaults(func=_cmd_build)
    plan = sub.add_parser("plan", help="inspect, diff or verify plan bundles")
    plan_sub = plan.add_subparsers(dest="plan_command", metavar="{inspect,diff,verify}")
    inspect = plan_sub.add_parser("inspect", help="show a bundle's plan")
    inspect.add_argument("bundle")
    inspect.set_defaults(func=_cmd_inspect)
    diff = plan_sub.add_parser("diff", help="memory and capacity deltas between two bundles (old, new)")
    diff.add_argument("old")
    diff.add_argument("new")
    diff.add_argument("--max-regression", type=float, default=5.0, metavar="PCT",
                      help="exit 1 when something gets worse by more than PCT percent (default 5)")
    diff.set_defaults(func=_cmd_diff)
    verify = plan_sub.add_parser("verify", help="check a bundle's plan fits a target")
    verify.add_argument("bundle")
    verify.add_argument("--target", required=True, metavar="NAME",
                        help="a GPU (L4-24GB, A100-40GB, A100-80GB, H100-80GB, H200-141GB), 'plan' for the plan's "
                             "own target, or a host memory size such as cpu:8GiB")
    verify.add_argument("--reserve", metavar="SIZE", help="memory kept for the framework (default: 1GiB on a GPU, "
                                                         "256MiB on cpu)")
    verify.set_defaults(func=_cmd_verify)
    for name, (_, _, line) in RUNTIME_COMMANDS.items():  # listed here; main() hands them to their module first
        sub.add_parser(name, help=f"{line} (`slabserve {name} --help`)", add_help=False)
    for p in (parser, inspect, diff, verify):
        p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return parser


def _build_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", help="a serving spec (plans/*.yaml)")
    parser.add_argument("--out", required=True, metavar="DIR", help="the bundle directory to write")
    parser.add_argument("--base-dir", metavar="DIR", help="where the spec's relative paths start (default: here)")
    parser.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)


def _run(func, ns: argparse.Namespace) -> int:
    from slabserve.compiler.build import BuildError
    from slabserve.compiler.fit import FitError
    from slabserve.compiler.memplan import PlanError
    from slabserve.compiler.slabs import SlabPlanError
    from slabserve.compiler.spec import SpecError
    from slabserve.runtime.config import ModelLoadError
    from slabserve.runtime.plan import PlanFormatError

    try:
        return func(ns)
    except FitError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAIL
    except (SpecError, BuildError, PlanFormatError, ModelLoadError, SlabPlanError, PlanError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INPUT
    except OSError as err:
        print(f"error: {err.filename or ''}: {err.strerror or err}", file=sys.stderr)
        return EXIT_INPUT
    except Exception as err:  # an internal error: say so, without a wall of traceback unless asked
        if getattr(ns, "debug", False):
            raise
        print(f"internal error: {type(err).__name__}: {err} (rerun with --debug for the traceback; "
              f"please report it)", file=sys.stderr)
        return EXIT_FAIL


def _cmd_build(ns: argparse.Namespace) -> int:
    from slabserve.compiler.build import build_plan
    from slabserve.compiler.bundle import write_bundle
    from slabserve.compiler.spec import load_spec
    from slabserve.compiler.tools import summary

    start = time.monotonic()
    spec = load_spec(ns.spec, base_dir=ns.base_dir)
    built = build_plan(spec, ns.base_dir)
    plan_id = write_bundle(built, ns.out)
    print(summary(built.plan, plan_id))
    print(f"\nwrote {Path(ns.out) / 'plan.msgpack'}, plan.yaml, step.onnx in {time.monotonic() - start:.1f} s")
    print(f"plan id {plan_id}")
    return EXIT_OK


def _read(bundle: str):
    from slabserve.runtime.plan import read_plan_and_id

    return read_plan_and_id(bundle)


def _cmd_inspect(ns: argparse.Namespace) -> int:
    from slabserve.compiler.tools import inspect

    plan, pid = _read(ns.bundle)
    print(inspect(plan, pid))
    return EXIT_OK


def _cmd_diff(ns: argparse.Namespace) -> int:
    from slabserve.compiler.tools import diff_plans

    if ns.max_regression < 0:
        print("error: --max-regression: expected a percentage >= 0", file=sys.stderr)
        return EXIT_INPUT
    (old, old_id), (new, new_id) = _read(ns.old), _read(ns.new)
    regressed, text = diff_plans(old, new, old_id, new_id, ns.max_regression)
    print(text)
    return EXIT_FAIL if regressed else EXIT_OK


def _cmd_verify(ns: argparse.Namespace) -> int:
    from slabserve.compiler.fit import check_plan_against
    from slabserve.compiler.spec import DEFAULT_RESERVE, GPUS
    from slabserve.runtime.units import parse_bytes

    plan, pid = _read(ns.bundle)
    name = ns.target
    if name == "plan":
        device, memory, label = plan.target.device, plan.target.memory_bytes, f"its own target"
        reserve = plan.target.reserve_bytes
    elif name in GPUS:
        device, memory, label, reserve = "cuda", GPUS[name], name, DEFAULT_RESERVE["cuda"]
    elif name.startswith("cpu:"):
        try:
            memory = parse_bytes(name[4:])
        except ValueError as err:
            print(f"error: --target {name}: {err}", file=sys.stderr)
            return EXIT_INPUT
        device, label, reserve = "cpu", f"cpu with {name[4:]}", DEFAULT_RESERVE["cpu"]
    else:
        print(f"error: --target: {name!r} is not a known target; expected one of {', '.join(GPUS)}, 'plan', or "
              f"cpu:SIZE (for example cpu:8GiB)", file=sys.stderr)
        return EXIT_INPUT
    if ns.reserve is not None:
        try:
            reserve = parse_bytes(ns.reserve)
        except ValueError as err:
            print(f"error: --reserve: {err}", file=sys.stderr)
            return EXIT_INPUT
    fits, text = check_plan_against(plan, memory, reserve, device, label)
    print(f"plan {plan.name} {pid[:12]}: {text}")
    return EXIT_OK if fits else EXIT_FAIL


def _dispatch_runtime(command: str, argv: list[str]) -> int:
    module_name, named, _ = RUNTIME_COMMANDS[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise
        print(f"error: `slabserve {command}` needs {module_name}, which this installation does not have yet",
              file=sys.stderr)
        return EXIT_INPUT
    result = module.main([command, *argv] if named else argv)  # `slabserve generate --help`: generate's help
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
