"""gpuctl's own command line for the stand-in host: `python -m tests.sandbox.cli ARGS` is `gpuctl ARGS`, with the
config schema of the stand-in's trainer, which is the bundled trainer's with the fake trainer's `--set fake.KEY`
options added (fake_trainer.py; host.py's FAKE_KEYS). gpuctl itself reads only the schema it bundles."""

from __future__ import annotations

from gpuctl import config_schema
from gpuctl.cli import main
from tests.sandbox.host import with_fake_keys


def use_standin_schema() -> None:
    """This process's gpuctl checks configs against the stand-in trainer's schema (once)."""
    bundled = config_schema.load_schema
    if getattr(bundled, "standin", False):
        return

    def load_schema() -> dict:
        return with_fake_keys(bundled())
    load_schema.standin = True
    config_schema.load_schema = load_schema


if __name__ == "__main__":
    use_standin_schema()
    main()
