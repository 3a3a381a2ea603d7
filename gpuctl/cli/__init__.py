"""The gpuctl command line: parse, call gpuctl.commands, render (the commands: gpuctl.cli.app; every option:
gpuctl.cli.options). Nothing else lives here.

run() turns every outcome into one exit code (gpuctl.errors.ExitCode) and every error into one line on
stderr, never a traceback (GPUCTL_DEBUG=1 shows it).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from gpuctl import __version__
from gpuctl.errors import ExitCode, GpuctlError
from gpuctl.runs import is_run_ref

if TYPE_CHECKING:
    from gpuctl.ui.output import Output

__all__ = ["app", "main", "run"]


def __getattr__(name: str):
    """`app` (the Typer application) is imported when asked for: `gpuctl --version` does without it."""
    if name == "app":
        from gpuctl.cli.app import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _bare_resume(argv: list[str]) -> list[str]:
    """Typer has no option with an optional value: `launch --resume` not followed by a run number or name
    becomes `--resume=` (the latest run). (A bare TARGET that reads as a name, `pve`, goes before it.)"""
    if "launch" not in argv:
        return argv
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        following = argv[i + 1] if i + 1 < len(argv) else None
        out.append("--resume=" if arg == "--resume" and not (following and is_run_ref(following)) else arg)
    return out


def _container_argv(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """`gpuctl shell [OPTIONS] -- CMD ARGS...`: the words after `--` are the container's command, never gpuctl's
    (TARGET would take the first); None when there is no `--`."""
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    if command != "shell" or "--" not in argv:
        return argv, None
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def _help_of(ctx, argv: list[str]) -> str:
    """The --help that a usage error points to: its command's. Click gives some errors (an option missing its
    value) no context: the command is then the first argument that names one."""
    if ctx is not None and ctx.parent is not None:
        return f"{ctx.command_path} --help"
    from gpuctl.cli.app import app

    names = {info.name or info.callback.__name__ for info in app.registered_commands}
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    return f"gpuctl {command} --help" if command in names else "gpuctl --help"


def run(argv: list[str] | None = None, out: Output | None = None) -> int:
    """Run gpuctl with these arguments, writing through `out` (default: sys.stdout and sys.stderr as they are
    then); return its exit code (tests call this in-process)."""
    argv, container_argv = _container_argv(_bare_resume(sys.argv[1:] if argv is None else list(argv)))
    if argv == ["--version"]:  # needs nothing of the rest: answered before Typer is imported
        (out.stdout if out else sys.stdout).write(f"gpuctl {__version__}\n")
        return int(ExitCode.OK)
    import typer

    from gpuctl.cli.app import Invocation, click_command
    from gpuctl.ui.output import Output

    # Newer Typer releases vendor their own click: take its exceptions from the module Typer's own come from.
    click_exceptions = sys.modules[typer.BadParameter.__module__]
    no_args_is_help = getattr(click_exceptions, "NoArgsIsHelpError", ())
    out = out or Output()
    invocation = Invocation(out, container_argv)  # what its connection costs: its session counts into it
    try:
        command = click_command(help_asked=bool({"-h", "--help"} & set(argv)))
        code = int(command.main(args=argv, prog_name="gpuctl", standalone_mode=False, obj=invocation) or 0)
        if code == ExitCode.INTERRUPTED:  # Typer's own answer to a Ctrl-C before a command ran (ours raise, said)
            out.message("interrupted")
        return code
    except GpuctlError as e:
        # An interrupt the user asked for (Ctrl-C in logs -f, status --watch), or nothing left to do (a resume of a
        # finished run), is said, not reported as an error.
        (out.message if e.code in (ExitCode.INTERRUPTED, ExitCode.OK) else out.error)(str(e))
        return int(e.code)
    except no_args_is_help as e:
        out.write(e.ctx.get_help() + "\n")
        return int(ExitCode.USAGE)
    except click_exceptions.UsageError as e:
        out.error(f"{e.format_message()} (see {_help_of(e.ctx, argv)})")
        return int(ExitCode.USAGE)
    except (KeyboardInterrupt, typer.Abort):
        out.message("interrupted")
        return int(ExitCode.INTERRUPTED)
    except BrokenPipeError:
        # The reader went away (gpuctl logs | head): not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.stdout.fileno())
        return int(ExitCode.OK)
    except Exception as e:  # a bug: still one line, with the way to see more
        if os.environ.get("GPUCTL_DEBUG"):
            raise
        out.error(f"internal error: {type(e).__name__}: {e} (GPUCTL_DEBUG=1 shows the traceback)")
        return int(ExitCode.RUN_FAILED)
    finally:
        trace = invocation.trace()
        if trace:
            print(trace, file=out.stderr)


def main() -> None:
    sys.exit(run(sys.argv[1:]))
