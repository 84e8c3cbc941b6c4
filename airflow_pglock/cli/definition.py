"""``airflow pglock ...``: the provider's CLI commands for Airflow >= 3.2 (its ``cli`` entry).

Light on purpose (Airflow imports it for every ``airflow`` command): the commands load
lazily, and the arguments are the console script's (``airflow_pglock.cli.main.ARGS``).
"""

from __future__ import annotations

from airflow.cli.cli_config import ActionCommand, Arg, GroupCommand, lazy_load_command

from airflow_pglock.cli.main import ARGS, COMMANDS, COMMON


def _arg(name: str) -> Arg:
    flags, kwargs = ARGS[name]
    return Arg(flags, **kwargs)


def get_pglock_cli_commands() -> list[GroupCommand]:
    """The ``airflow pglock`` group: locks, key, doctor, init-db (same as ``airflow-pglock``)."""
    return [
        GroupCommand(
            name="pglock",
            help="PostgreSQL advisory locks (airflow-pglock): locks, key, doctor, init-db",
            subcommands=[
                ActionCommand(
                    name=name,
                    help=help_text,
                    description=help_text,
                    func=lazy_load_command(f"airflow_pglock.cli.main.{name.replace('-', '_')}_command"),
                    args=tuple(_arg(arg) for arg in (*specific, *COMMON)),
                )
                for name, (help_text, specific) in COMMANDS.items()
            ],
        )
    ]
