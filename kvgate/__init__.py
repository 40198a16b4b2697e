"""kvgate: the `kvgate` command that fronts every process (up, gateway, worker, demo-model, bench)."""
