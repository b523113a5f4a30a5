"""PySpark's Python worker daemon (`pyspark.daemon`), with PySpark imported from the installed
package instead of the zip inside it. Standard library only: it runs before PySpark is imported.

Spark starts the daemon, which forks the Python workers of its tasks, with `pyspark.zip` first on
PYTHONPATH; the driver under spark-submit gets the same. Python keeps no compiled modules for a
zip, so the daemon and every worker it forks compile PySpark's modules from source again, in every
job (about 0.4 s of one core each, the first batch waiting on it). For a local master (the workers
run on this machine, with this Python) kafka2pg.staging makes this module the daemon
(`spark.python.daemon.module`); kafka2pg.stage_job does the same for the job's driver.
"""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path


def skip_bundled_pyspark_zip(path: list[str]) -> list[str]:
    """Take the installed pyspark package's own `python/lib/pyspark.zip` off `path` when that
    package is importable from the rest of it; returns what was taken off.

    The zip holds the same files as the package it lies in, whose modules Python compiled once.
    A zip of another Spark installation (SPARK_HOME elsewhere) stays, and so does this one if the
    package would not be the one imported without it.
    """
    skipped = []
    for entry in [e for e in path if e.endswith("pyspark.zip")]:
        package = Path(entry).parent.parent.parent  # <pyspark>/python/lib/pyspark.zip
        if package.name != "pyspark" or not (package / "__init__.py").is_file():
            continue
        rest = [e for e in path if e != entry]
        spec = importlib.machinery.PathFinder.find_spec("pyspark", rest)
        if spec is not None and spec.origin and Path(spec.origin).resolve() == (package / "__init__.py").resolve():
            path[:] = rest
            skipped.append(entry)
    return skipped


if __name__ == "__main__":
    skip_bundled_pyspark_zip(sys.path)
    from pyspark.daemon import manager

    manager()
