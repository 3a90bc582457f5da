"""The `keras-vit` command: one sub-command per module of keras_vit.commands.

Each module of `keras_vit.commands` named in COMMANDS defines
`HELP` (one line), `add_arguments(parser)` and `run(args) -> int`. A user
error (bad argument, missing file) is raised as `UsageError`, or as a
`ValueError`/`FileNotFoundError` from keras_vit's own checks (or a `TypeError`
that keras_vit's own code raises on purpose, as its rules say bad input may),
and printed with the usage, exit status 2, no traceback. An error raised inside
TensorFlow or Keras, or a `TypeError` of a bug in keras_vit, is not the user's:
it keeps its traceback (exit status 1).
"""

import argparse
import importlib
import os
import sys
import traceback

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

COMMANDS = {
    "train": "keras_vit.commands.train",
    "evaluate": "keras_vit.commands.evaluate",
    "predict": "keras_vit.commands.predict",
    "convert": "keras_vit.commands.convert",
    "export": "keras_vit.commands.export",
    "explain": "keras_vit.commands.explain",
}


class UsageError(Exception):
    """A mistake in what the user asked for; reported without a traceback."""


def _available_commands():
    modules = {}
    for name, module_name in COMMANDS.items():
        try:
            modules[name] = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise
    return modules


def build_parser(modules=None):
    modules = _available_commands() if modules is None else modules
    parser = argparse.ArgumentParser(
        prog="keras-vit", description="Vision Transformers for Keras 3: train, evaluate, export."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name, module in modules.items():
        sub = subparsers.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run, _parser=sub)
    return parser


def is_user_error(error):
    """UsageError, or a ValueError/FileNotFoundError raised by keras_vit's own code.

    A TypeError counts when a `raise` statement of keras_vit raised it (a check
    of the user's input), not when Python raised it inside keras_vit (a bug).
    """
    if isinstance(error, UsageError):
        return True
    if not isinstance(error, (ValueError, FileNotFoundError, TypeError)):
        return False
    frames = traceback.extract_tb(error.__traceback__)
    if not frames or not os.path.abspath(frames[-1].filename).startswith(PACKAGE_DIR + os.sep):
        return False
    if isinstance(error, TypeError):
        return (frames[-1].line or "").lstrip().startswith("raise ")
    return True


def main(argv=None, own_process=None):
    """Runs `keras-vit ARGV` (default: the command line). `own_process`: whether the
    command may change process-wide settings; by default, only when argv is None."""
    parser = build_parser()
    own_process = argv is None if own_process is None else bool(own_process)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args._argv = argv  # what was typed: commands tell passed flags from defaults with it
    # From the command line (no argv given) the command owns the process and may set
    # process-wide settings (train's --cpu-streams auto); called from a program, not.
    args._own_process = own_process
    try:
        return int(args._run(args) or 0)
    except (UsageError, ValueError, FileNotFoundError, TypeError) as error:
        if not is_user_error(error):
            raise
        args._parser.print_usage(sys.stderr)
        print(f"keras-vit {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("keras-vit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # `python -m keras_vit.cli`: this file runs as __main__, a second copy whose
    # UsageError is not the one the commands raise; run the package's own.
    from keras_vit.cli import main as package_main

    sys.exit(package_main())
