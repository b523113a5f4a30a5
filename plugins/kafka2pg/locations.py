"""Where kafka2pg finds its own files (SQL, the Spark job) and keeps its state, whether it is
installed (a wheel in site-packages) or run from the checkout (plugins/kafka2pg): one answer each.

Nothing else in the package spells a checkout path; everything asks this module.
"""

from __future__ import annotations

import os
from pathlib import Path

from kafka2pg.exceptions import InstallationError

PACKAGE_DIR = Path(__file__).resolve().parent


def _checkout() -> Path | None:
    """The checkout the package runs from (it is `<checkout>/plugins/kafka2pg`), or None when installed."""
    root = PACKAGE_DIR.parents[1]
    if PACKAGE_DIR.parent.name == "plugins" and (root / "sql").is_dir() and (root / "dags").is_dir():
        return root
    return None


#: The checkout's root when the package runs from it (`./kafka2pg`, the tests), None when installed.
CHECKOUT = _checkout()
#: How a user runs kafka2pg's command here, for messages that tell them to: the checkout's
#: wrapper, or the installed package's console script.
COMMAND = "./kafka2pg" if CHECKOUT else "kafka2pg"
# The wheel carries the top-level sql/ inside the package (pyproject.toml's force-include).
SQL_DIR = CHECKOUT / "sql" if CHECKOUT else PACKAGE_DIR / "sql"


def migration_files() -> list[Path]:
    """The numbered migrations kafka2pg ships; an installation without them is an error, never "none pending"."""
    files = sorted(SQL_DIR.glob("[0-9][0-9][0-9][0-9]_*.sql"))
    if not files:
        raise InstallationError("SQL migrations", SQL_DIR)
    return files


def default_state_dir() -> Path:
    """Caches (jars, class-data archive, reports) and the local stack when KAFKA2PG_STATE_DIR is not
    set: `.cache` in the checkout; installed, `$XDG_CACHE_HOME/kafka2pg` (`~/.cache/kafka2pg`),
    never inside site-packages."""
    if CHECKOUT is not None:
        return CHECKOUT / ".cache"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kafka2pg"


def state_dir(env: dict[str, str] | None = None) -> Path:
    """KAFKA2PG_STATE_DIR (made absolute: the stack's processes and files refer to it from other
    directories), or the default above."""
    value = (os.environ if env is None else env).get("KAFKA2PG_STATE_DIR")
    return Path(value).expanduser().absolute() if value else default_state_dir()


def default_pipelines_file() -> Path:
    """The pipelines file when neither KAFKA2PG_PIPELINES nor the DAG file names one: the checkout's
    `dags/pipelines.yaml`; installed, `pipelines.yaml` in Airflow's DAGs folder (`[core] dags_folder`),
    where the README's installation puts it beside the DAG file."""
    if CHECKOUT is not None:
        return CHECKOUT / "dags" / "pipelines.yaml"
    from airflow.configuration import conf

    return Path(conf.get("core", "dags_folder")).expanduser() / "pipelines.yaml"
