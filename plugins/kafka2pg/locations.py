"""Where kafka2pg finds its own files (SQL, the Spark job) and keeps its state, whether it is
installed (a wheel in site-packages) or run from the checkout (plugins/kafka2pg): one answer each.

Nothing else in the package spells a checkout path; everything asks this module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

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


def preview_first(arguments: str) -> str:
    """A command that changes data, as a message suggests it: `arguments` without `--confirm`
    (a preview that changes nothing), then the same with it. A command copied from a message
    never applies a change unread."""
    return f"`{COMMAND} {arguments}` then, if its preview is right, the same with `--confirm`"


#: The checkout's pipelines file; installed, it is in Airflow's DAGs folder (`config.default_pipelines_file`).
CHECKOUT_PIPELINES_FILE = CHECKOUT / "dags" / "pipelines.yaml" if CHECKOUT else None
# The wheel carries the top-level sql/ inside the package (pyproject.toml's force-include).
SQL_DIR = CHECKOUT / "sql" if CHECKOUT else PACKAGE_DIR / "sql"


def default_state_dir() -> Path:
    """Caches (jars, class-data archive, reports) and the local stack when KAFKA2PG_STATE_DIR is not
    set: `.cache` in the checkout; installed, `$XDG_CACHE_HOME/kafka2pg` (`~/.cache/kafka2pg`),
    never inside site-packages."""
    if CHECKOUT is not None:
        return CHECKOUT / ".cache"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kafka2pg"


def env_setting(env: Mapping[str, str] | None, name: str, default: str | None = None) -> str | None:
    """The environment variable `name` without surrounding white space; `default` when it is unset
    or blank, as `${NAME:-default}` in a shell (and the ./kafka2pg wrapper) reads it."""
    value = (os.environ if env is None else env).get(name)
    return value.strip() if value and value.strip() else default


def state_dir(env: dict[str, str] | None = None) -> Path:
    """KAFKA2PG_STATE_DIR (made absolute: the stack's processes and files refer to it from other
    directories), or the default above."""
    value = env_setting(env, "KAFKA2PG_STATE_DIR")
    return Path(value).expanduser().absolute() if value else default_state_dir()
