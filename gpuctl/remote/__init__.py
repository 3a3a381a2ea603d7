"""The container's side, reached from here: one SSH connection (`ssh`), `pct exec` of a rendered script
(`container`, `scripts`), what the scripts say back (`protocol`), and a pull's receiving end (`transfer`).
Nothing here knows a command of the CLI."""
