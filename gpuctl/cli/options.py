"""Every option of gpuctl's command line, declared once (httpie's cli/definition.py, SkyPilot's flags.py): the
target options every command takes (with_address adds them), and each command's own. The commands in
gpuctl.cli.app name these types in their signatures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpuctl.commands.options import LaunchTask
from gpuctl.paths import DEFAULT_VENV
from gpuctl.runs import PullWhat

ADDRESS_HELP = "Target options"
# The target options every command accepts (ARCHITECTURE §2); with_address adds them to each command.
ADDRESS_PARAMS = [
    ("host", Annotated[str | None, typer.Option(metavar="HOST", help="Proxmox host: address, name or ~/.ssh/config alias "
                                                        "[env GPUCTL_HOST]", rich_help_panel=ADDRESS_HELP)]),
    ("port", Annotated[int | None, typer.Option(metavar="N", help="SSH port [env GPUCTL_PORT; default 22]",
                                                   rich_help_panel=ADDRESS_HELP)]),
    ("user", Annotated[str | None, typer.Option(metavar="USER", help="SSH user [env GPUCTL_USER; default root]",
                                                   rich_help_panel=ADDRESS_HELP)]),
    ("identity", Annotated[str | None, typer.Option(metavar="PATH", help="private key file [env GPUCTL_IDENTITY]",
                                                       rich_help_panel=ADDRESS_HELP)]),
    ("ct", Annotated[int | None, typer.Option(metavar="CTID", help="container id [env GPUCTL_CT]",
                                                 rich_help_panel=ADDRESS_HELP)]),
    ("ssh_config", Annotated[str | None, typer.Option(metavar="PATH", help="ssh_config file [env GPUCTL_SSH_CONFIG; default "
                                                              "~/.ssh/config]", rich_help_panel=ADDRESS_HELP)]),
    ("accept_new_host_key", Annotated[bool, typer.Option("--accept-new-host-key", help="record an unknown host's key in known_hosts",
                                                         rich_help_panel=ADDRESS_HELP)]),
    ("connect_timeout", Annotated[float | None, typer.Option(metavar="SECONDS", help="seconds to wait for the host [default 10]",
                                                                rich_help_panel=ADDRESS_HELP)]),
    ("profile", Annotated[str | None, typer.Option(metavar="NAME", help="a [profiles.NAME] table of "
                                                   "$XDG_CONFIG_HOME/gpuctl/config.toml [env GPUCTL_PROFILE]",
                                                   rich_help_panel=ADDRESS_HELP)]),
]
AddressArg = Annotated[str | None, typer.Argument(metavar="TARGET", help="[USER@]HOST[:PORT][/CTID], instead of the options",
                                                    show_default=False)]
RunOpt = Annotated[str | None, typer.Option("--run", metavar="N|NAME", help="run number (7 or tl7) or name (launch "
                                            "--name); default: the latest")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON document on stdout, nothing else there")]


NODES_HELP = "Multi-node runs"

# launch
Task = Annotated[LaunchTask | None, typer.Option(help="what to run: train (python -m training.train) or regenerate "
                                                 "(python -m training.regenerate) [default: train, or the resumed "
                                                 "run's]")]
Config = Annotated[str | None, typer.Option(metavar="PRESET|PATH", help="preset name, or a config file (a local "
                                            "file is staged) [default: tiny (regenerate: tiny-regenerate), or the "
                                            "resumed run's]")]
Sets = Annotated[list[str] | None, typer.Option("--set", metavar="KEY=VALUE", help="override a config value: "
                                                "KEY=VALUE (repeatable)")]
LaunchPython = Annotated[str | None, typer.Option(metavar="PATH", help="Python interpreter in the container "
                                                  "[default: the one gpuctl setup made, else python3]")]
Workdir = Annotated[str | None, typer.Option(metavar="DIR", help="the run's working directory in the container "
                                             "[default: /workspace]")]
LogDir = Annotated[str | None, typer.Option(metavar="DIR", help="where train_tlN.log goes in the container "
                                            "[default: /workspace]")]
KeepCompileCache = Annotated[bool, typer.Option("--keep-compile-cache", help="keep /tmp/torchinductor_root")]
RunName = Annotated[str | None, typer.Option("--name", metavar="NAME", help="name the run (a short slug, unique in "
                                             "the container): --run NAME then finds it")]
Replace = Annotated[bool, typer.Option("--replace", help="kill the active run first instead of refusing")]
Queue = Annotated[bool, typer.Option("--queue", help="with a run active, wait in the container's queue instead of "
                                     "refusing: the run starts, detached, when the runs ahead of it end (first in, "
                                     "first out; gpuctl kill --run N takes it out)")]
Resume = Annotated[str | None, typer.Option("--resume", metavar="[RUN]", help="continue RUN, a number or name "
                                            "(default: the latest "
                                            "run, of --task when given) from its checkpoints: its task, config, sets "
                                            "and directories, the trainer's --resume (a regenerate run: the same "
                                            "command, which skips the records done), a new log")]
Retry = Annotated[int, typer.Option("--retry", metavar="N", help="restart a failed run with the trainer's --resume "
                                    "(a regenerate run: the same command) up to N times, each attempt a new run "
                                    "number and log (not after gpuctl kill, nor after two attempts that fail "
                                    "alike)")]
RetryDelay = Annotated[float, typer.Option("--retry-delay", metavar="SECONDS", help="wait before a retry; doubled "
                                           "for each attempt in a row that failed before its first step")]
LaunchFollow = Annotated[bool, typer.Option("--follow", "-f", help="stream the log until the run ends; exit with "
                                            "its outcome")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="print what would run, run nothing")]
Env = Annotated[list[str] | None, typer.Option("--env", metavar="KEY=VALUE", help="an environment variable for the "
                                               "trainer (repeatable), e.g. NCCL_SOCKET_IFNAME=eth0")]
NodeAddresses = Annotated[list[str] | None, typer.Option("--node", metavar="TARGET", rich_help_panel=NODES_HELP,
                                                       help="a node of a multi-node run: [USER@]HOST[:PORT]/CTID or "
                                                            "a profile name (repeatable; node 0 first)")]
Cluster = Annotated[str | None, typer.Option("--cluster", metavar="NAME", rich_help_panel=NODES_HELP,
                                             help="the nodes of config.toml's [clusters.NAME] (nodes = [...])")]
MasterAddr = Annotated[str | None, typer.Option(metavar="ADDR", rich_help_panel=NODES_HELP,
                                                help="where every node reaches node 0 (MASTER_ADDR) [default: node "
                                                     "0's address, found in its container]")]
MasterPort = Annotated[int | None, typer.Option(metavar="N", rich_help_panel=NODES_HELP,
                                                help="node 0's rendezvous port (MASTER_PORT), reachable from every "
                                                     "node [default: 29500]")]

# logs
Tail = Annotated[int | None, typer.Option("--tail", "-n", help="only the last LINES lines", metavar="LINES", min=0)]
LogsFollow = Annotated[bool, typer.Option("--follow", "-f", help="stream until the run ends; exit with its outcome "
                                          "(0 succeeded, 1 otherwise)")]
RawLog = Annotated[bool, typer.Option("--raw", help="the log's bytes as they are (by default its control "
                                     "characters are shown as \\xNN and a carriage return as a line end, to a "
                                     "terminal, a pipe or a file alike)")]
LogNode = Annotated[int | None, typer.Option("--node", metavar="K", min=0, help="a multi-node run: node K's log "
                                             "[default: node 0's]")]

# status
Watch = Annotated[bool, typer.Option("--watch", "-w", help="refresh in place until Ctrl-C")]
Interval = Annotated[float, typer.Option(metavar="SECONDS", help="seconds between refreshes with --watch", min=0.1)]

# plot
PlotOutput = Annotated[Path, typer.Option("--output", "-o", metavar="FILE.png", help="the image to write (.png, "
                                          ".svg or .pdf)")]

# runs rm, runs prune
RemoveRefs = Annotated[list[str], typer.Argument(metavar="RUN", show_default=False, help="the runs to remove: "
                                                 "numbers (7 or tl7) or names")]
Keep = Annotated[int, typer.Option("--keep", metavar="K", min=0, help="how many finished runs stay: the newest K")]
RemoveDryRun = Annotated[bool, typer.Option("--dry-run", help="list what would be removed, remove nothing")]

# kill
Signal = Annotated[str, typer.Option(metavar="NAME", help="first signal: TERM, INT, HUP, QUIT, USR1, USR2 or KILL")]
Grace = Annotated[float, typer.Option(metavar="SECONDS", help="seconds to wait before SIGKILL", min=0)]

# pull
Dest = Annotated[str | None, typer.Argument(metavar="DEST", show_default=False, help="where the files go: a "
                                            "directory (export, checkpoint), a file or a directory (metrics)")]
What = Annotated[PullWhat, typer.Option(help="the run's export (made from its newest checkpoint when it has none), "
                                        "its newest checkpoint, its metrics file, or a regenerate run's data file "
                                        "(its output_path)")]
WithOptimizer = Annotated[bool, typer.Option("--with-optimizer", help="with --what checkpoint: state.pt too "
                                             "(optimizer, schedule, data position)")]

# doctor, setup
DoctorPython = Annotated[str | None, typer.Option(metavar="PATH", help="the interpreter to check [default: the one "
                                                  "gpuctl setup made, else python3]")]
SetupPython = Annotated[str | None, typer.Option(metavar="PATH", help="the interpreter (>= 3.10) to make the "
                                                 "environment from [default: python3]")]
Venv = Annotated[str, typer.Option(metavar="DIR", help="the virtual environment in the container")]
Torch = Annotated[str | None, typer.Option(metavar="SPEC", help="a pip requirement for torch instead of the "
                                           "trainer's, e.g. 'torch==2.11.0' [default: a CUDA build for the driver, "
                                           "from PyTorch's index]")]
IndexUrl = Annotated[list[str] | None, typer.Option("--index-url", metavar="URL", help="where pip gets packages "
                                                    "(repeatable; the first is pip's --index-url, the others "
                                                    "--extra-index-url): an index URL, or a directory of wheels in "
                                                    "the container (/DIR, file:///DIR)")]
SystemSitePackages = Annotated[bool, typer.Option("--system-site-packages", help="let the environment see the "
                                                  "interpreter's packages (an image that has torch already)")]
SetupDryRun = Annotated[bool, typer.Option("--dry-run", help="print what would run, send nothing")]
SetupConfig = Annotated[str | None, typer.Option("--config", metavar="PRESET|PATH", help="a training config "
                                                 "whose report_to packages (tensorboard, wandb, mlflow) are "
                                                 "installed too")]
SetupSets = Annotated[list[str] | None, typer.Option("--set", metavar="KEY=VALUE", help="override a value of "
                                                     "--config, e.g. report_to=[\"tensorboard\"] (repeatable)")]
VENV_DEFAULT = DEFAULT_VENV
